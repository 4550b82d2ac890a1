// TcpMesh set-up: the mesh's connections are PeerLinks (net/links.h, whose numbered
// comment is the protocol): at init to AlgorithmPeers, later on demand (EnsureConnected).
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "backends/tcp/mesh.h"
#include "common/logging.h"
#include "net/links.h"
#include "net/socket.h"

namespace spark_hvd {

int DescriptorsPerRank(int size) {
  int mesh = 0;
  for (int d = 1; d < size; d *= 2) mesh += 2;
  // The mesh's peers and listener, the heartbeats' two neighbours and listener, the two
  // connections of the rendezvous client.
  return std::min(mesh, size - 1) + 1 + 2 + 1 + 2;
}

std::vector<int> AlgorithmPeers(int rank, int size) {
  std::vector<int> peers;
  for (int d = 1; d < size; d *= 2) {
    for (int p : {(rank + d) % size, (rank - d % size + size) % size}) {
      if (p != rank && std::find(peers.begin(), peers.end(), p) == peers.end()) {
        peers.push_back(p);
      }
    }
  }
  std::sort(peers.begin(), peers.end());
  return peers;
}

// Here, where PeerLinks is complete.
TcpMesh::TcpMesh(int rank, int size, std::vector<int> fds, double timeout_s,
                 std::vector<int32_t> members, PeerLiveness* liveness,
                 std::unique_ptr<PeerLinks> links)
    : rank_(rank),
      size_(size),
      fds_(std::move(fds)),
      links_(std::move(links)),
      timeout_s_(timeout_s),
      members_(std::move(members)),
      liveness_(liveness) {
  // Whole at once: the first op to wait on the wire (maybe long after warm-up) allocates
  // nothing.
  const size_t n = static_cast<size_t>(size);
  xs_.reserve(2 * n);
  waits_.reserve(2 * n);
  pfds_.reserve(n + 1);
  poll_peers_.reserve(n);
}

TcpMesh::~TcpMesh() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

std::vector<int> TcpMesh::ConnectSockets(int rank, int size, std::shared_ptr<Store> store,
                                         const std::string& bind_host, double connect_timeout_s,
                                         const LostPeers& lost_peers) {
  PeerLinks links(rank, size, std::move(store), connect_timeout_s, lost_peers,
                  DescriptorsPerRank(size));
  links.Listen(bind_host);
  std::vector<int> fds(static_cast<size_t>(size), -1);
  std::vector<int> all;
  for (int p = 0; p < size; ++p) {
    if (p != rank) all.push_back(p);
  }
  links.Connect(all, &fds);
  for (int p = 0; p < size; ++p) {
    if (p != rank) net::SetNoDelay(fds[p]);
  }
  return fds;
}

std::unique_ptr<TcpMesh> TcpMesh::Connect(int rank, int size, std::shared_ptr<Store> store,
                                          const std::string& bind_host, double timeout_s,
                                          double connect_timeout_s, LostPeers lost_peers,
                                          std::vector<int32_t> members, PeerLiveness* liveness) {
  auto links = std::make_unique<PeerLinks>(rank, size, std::move(store), connect_timeout_s,
                                           lost_peers, DescriptorsPerRank(size));
  links->Listen(bind_host);
  std::vector<int> fds(static_cast<size_t>(size), -1);
  links->Connect(AlgorithmPeers(rank, size), &fds);
  for (int p = 0; p < size; ++p) {
    if (fds[p] >= 0) net::SetNoDelay(fds[p]);
  }
  SHVD_LOG(kDebug, "tcp") << "mesh of rank " << rank << " of " << size << " connected";
  return std::unique_ptr<TcpMesh>(new TcpMesh(rank, size, std::move(fds), timeout_s,
                                              std::move(members), liveness, std::move(links)));
}

Status TcpMesh::EnsureConnected(const std::vector<Transfer>& xs) {
  need_.clear();
  for (const auto& x : xs) {
    if (fds_[x.peer] < 0 && std::find(need_.begin(), need_.end(), x.peer) == need_.end()) {
      need_.push_back(x.peer);
    }
  }
  if (need_.empty()) return Status::OK();
  try {
    links_->Connect(need_, &fds_);
  } catch (const StatusError& e) {  // mesh ranks, in the message and .ranks, to job ranks
    return Fail(
        Status(e.status().code(), e.status().message(),
               JobRanks(std::vector<int>(e.status().ranks().begin(), e.status().ranks().end()))));
  }
  for (int p : need_) net::SetNoDelay(fds_[p]);
  return Status::OK();
}

}  // namespace spark_hvd
