// TcpMesh set-up: the connections of a rank, made at init for the peers its algorithms
// talk to and later, on demand, for any other. Every rank r of n runs the same steps:
//  1. Listen on bind_host (any port, backlog kBacklog) and publish "host port token"
//     under tcp/<r> in the store. The token is random per listener; only holders of the
//     store's secret can read it. The listener stays open for the mesh's life.
//  2. Decide which peers to connect now: at init the peers of the mesh's algorithms,
//     rank +- 2^k (mod n) for every power of two below n (AlgorithmPeers: at most
//     2 ceil(log2 n) of them; every peer when n <= 4); later, in a collective that
//     exchanges with a peer not connected yet (an alltoall), that peer. Both ranks of a
//     pair reach the same collective, so both come to connect it; of each pair the
//     higher rank connects and the lower one accepts.
//  3. Read the addresses of the lower peers to connect that it has not read yet, in one
//     request (Store::MultiGet), which waits for them and fails at once when the
//     rendezvous service has lost a rank of the job (its process exited or its host
//     vanished): a rank that never came does not hold the others until the deadline.
//     Nothing else is waited on before step 4, so no rank waits on another's accept
//     loop: a late rank leaves its connections queued in its listener's backlog, their
//     hellos buffered by the kernel.
//  4. One poll loop until each of these higher peers has connected and each lower one
//     has acknowledged:
//     - to each lower peer p: a non-blocking connection (started again after a
//       failure), then the hello {magic, r, p's token}, then p's acknowledgement (p's
//       rank, 4 bytes) read back;
//     - the listener accepts whatever arrives, and each accepted connection has
//       kHelloTimeoutS from its accept for its whole hello, read as it arrives;
//     - a valid hello (the magic, this listener's token, a higher rank not connected
//       yet) is acknowledged and its connection kept, also one of a peer this round
//       does not wait for (it reached a later collective first: the connection waits
//       for it). Anything else (a stray client, another job's rank, a connection silent
//       or closed mid-hello) is closed and logged with what happened; it never delays
//       the others.
//  5. While waiting in step 4, at least every kLostCheckS: if the rendezvous service
//     has lost a peer, fail with kPeerLost naming it rather than wait out the deadline.
// Steps 3 and 4 share one deadline, connect_timeout_s after they start. Running out of
// file descriptors (socket() or accept() failing with EMFILE or ENFILE) is an error at
// once, naming this rank's limit and what the mesh needs.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <sstream>

#include "backends/host_reduce.h"
#include "backends/tcp/hello.h"
#include "backends/tcp/mesh.h"
#include "backends/tcp/socket.h"
#include "common/logging.h"
#include "common/traffic.h"

namespace spark_hvd {
namespace {

using tcp::After;
using tcp::Clock;

constexpr int kBacklog = 1024;          // connections the kernel queues for accept
constexpr double kHelloTimeoutS = 5.0;  // per accepted connection, for its whole hello
constexpr double kLostCheckS = 0.5;     // how often to ask the store for lost peers
constexpr double kRetryS = 0.02;        // pause before connecting again after a failure

[[noreturn]] void Throw(Status s) { throw StatusError(std::move(s)); }

}  // namespace

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

// One mesh's connection set-up (steps 1 to 5 above), kept for the mesh's life.
class TcpLinks {
 public:
  TcpLinks(int rank, int size, std::shared_ptr<Store> store, double connect_timeout_s,
           TcpMesh::LostPeers lost_peers)
      : rank_(rank),
        size_(size),
        store_(std::move(store)),
        timeout_s_(connect_timeout_s),
        lost_peers_(std::move(lost_peers)),
        listener_(-1) {}

  ~TcpLinks() {
    for (auto& kv : lower_) {
      if (kv.second.fd >= 0) ::close(kv.second.fd);
    }
  }

  // Step 1.
  void Listen(const std::string& bind_host) {
    int port = 0;
    listener_ = tcp::Listen(bind_host, kBacklog, &port);
    closer_ = std::make_unique<tcp::FdCloser>(listener_);
    token_ = tcp::RandomHex(tcp::kTokenBytes);
    desk_ = std::make_unique<tcp::HelloDesk>(rank_, size_, token_, kHelloTimeoutS);
    store_->Set("tcp/" + std::to_string(rank_),
                bind_host + " " + std::to_string(port) + " " + token_);
  }

  // Steps 2 to 5 for `peers`: on return each has its socket in (*fds)[peer].
  void Connect(const std::vector<int>& peers, std::vector<int>* fds) {
    deadline_ = After(timeout_s_);
    // The addresses' read fails at once on a lost rank; after it, peers rarely die
    // before they connect: ask the service only once a wait has lasted (step 5).
    next_lost_check_ = After(kLostCheckS);
    higher_.clear();
    std::vector<std::string> unread;
    for (int p : peers) {
      if ((*fds)[p] >= 0 || p == rank_) continue;
      if (p > rank_) {
        higher_.push_back(p);
        continue;
      }
      Lower& l = lower_[p];
      l.wanted = true;
      if (l.token.empty()) unread.push_back("tcp/" + std::to_string(p));
    }
    if (!unread.empty()) ReadAddresses(unread);
    while (!Done()) Step();
    for (auto it = lower_.begin(); it != lower_.end();) {
      if (!it->second.acked) {
        ++it;
        continue;
      }
      (*fds)[it->first] = it->second.fd;
      it->second.fd = -1;
      it->second.acked = it->second.wanted = false;
      it->second.connected = false;
      ++it;
    }
    for (int p : higher_) (*fds)[p] = desk_->Take(p);
  }

 private:
  struct Lower {
    bool wanted = false;
    std::string host;
    int port = 0;
    std::string token;
    int fd = -1;
    bool connected = false;
    Clock::time_point retry_at{};
    tcp::Hello hello{};
    size_t sent = 0;
    uint32_t ack = 0;
    size_t got = 0;
    bool acked = false;
    std::string last_error = "not tried yet";
  };

  bool Done() const {
    for (const auto& kv : lower_) {
      if (kv.second.wanted && !kv.second.acked) return false;
    }
    for (int p : higher_) {
      if (!desk_->Has(p)) return false;
    }
    return true;
  }

  // Step 3, one request: the addresses of `keys` ("tcp/<p>").
  void ReadAddresses(const std::vector<std::string>& keys) {
    std::vector<std::string> values;
    try {
      values = store_->MultiGet(keys, timeout_s_, /*fail_on_lost=*/true);
    } catch (const StatusError& e) {
      if (e.status().code() == StatusCode::kPeerLost && !e.status().ranks().empty()) {
        Throw(LostDuringInit("rank " + std::to_string(rank_) + " stopped connecting to its peers",
                             e.status()));
      }
      if (e.status().code() != StatusCode::kTimeout) throw;
      std::vector<int32_t> late;
      for (size_t i : MissingKeys(store_.get(), keys)) late.push_back(std::stoi(keys[i].substr(4)));
      std::ostringstream os;
      os << "rank " << rank_ << " waited " << timeout_s_
         << " s (SPARK_HVD_START_TIMEOUT_S) to hear from rank" << (late.size() > 1 ? "s " : " ")
         << JoinRanks(late)
         << " in the rendezvous store (its address): " << (late.size() > 1 ? "they" : "it")
         << " did not reach init in time";
      Throw(Status(StatusCode::kTimeout, os.str(), late));
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      const int p = std::stoi(keys[i].substr(4));
      Lower& l = lower_[p];
      std::istringstream in(values[i]);
      in >> l.host >> l.port >> l.token;
      if (l.token.size() != tcp::kTokenBytes) {
        Throw(Status::StoreError("malformed address of rank " + std::to_string(p) +
                                 " in the store: '" + values[i] + "'"));
      }
      l.hello = tcp::MakeHello(rank_, l.token);
    }
  }

  // Step 5: throws kPeerLost when the rendezvous service has lost a peer.
  void CheckLost(bool now) {
    if (!lost_peers_ || (!now && Clock::now() < next_lost_check_)) return;
    next_lost_check_ = After(kLostCheckS);
    const std::vector<int> lost = lost_peers_();
    if (lost.empty()) return;
    Throw(Status::PeerLost("rank " + std::to_string(rank_) + " stopped connecting to its peers: " +
                               "the rendezvous service lost rank" + (lost.size() > 1 ? "s " : " ") +
                               JoinRanks(lost) + " (the process exited or its host is unreachable)",
                           std::vector<int32_t>(lost.begin(), lost.end())));
  }

  [[noreturn]] void OutOfDescriptors(const char* doing) {
    Throw(Status::InvalidArgument("rank " + std::to_string(rank_) +
                                  " ran out of file descriptors " + doing + ": " +
                                  tcp::DescriptorLimitAdvice(DescriptorsPerRank(size_))));
  }

  // One round of step 4: poll everything pending, then move what is ready.
  void Step() {
    CheckLost(false);
    if (Clock::now() >= deadline_) ThrowTimeout();
    Clock::time_point wake = lost_peers_ ? std::min(deadline_, next_lost_check_) : deadline_;
    pfds_.clear();
    owner_.clear();
    for (auto& kv : lower_) {
      Lower& l = kv.second;
      if (!l.wanted || l.acked) continue;
      if (l.fd < 0 && Clock::now() >= l.retry_at) Start(kv.first);
      if (l.fd < 0) {
        wake = std::min(wake, l.retry_at);
        continue;
      }
      const bool sending = !l.connected || l.sent < sizeof(l.hello);
      pfds_.push_back(pollfd{l.fd, static_cast<short>(sending ? POLLOUT : POLLIN), 0});
      owner_.push_back(kv.first);
    }
    const size_t first_desk = pfds_.size();
    desk_->AddPolls(listener_, &pfds_, &wake);
    int rc = ::poll(pfds_.data(), pfds_.size(), tcp::MillisUntil(wake));
    if (rc < 0 && errno != EINTR) Throw(Status::Internal("poll: " + tcp::Errno(errno)));
    for (size_t i = 0; i < first_desk; ++i) {
      if (pfds_[i].revents != 0) Advance(owner_[i]);
    }
    desk_->Handle(listener_, pfds_, first_desk);
    if (desk_->out_of_descriptors()) OutOfDescriptors("accepting a peer's connection");
  }

  void Start(int p) {
    Lower& l = lower_[p];
    bool out_of_descriptors = false;
    l.fd = tcp::StartConnect(l.host, l.port, &l.last_error, &out_of_descriptors);
    l.connected = false;
    l.sent = 0;
    l.got = 0;
    if (l.fd < 0) {
      if (out_of_descriptors) OutOfDescriptors(("connecting to rank " + std::to_string(p)).c_str());
      Connections().failed.fetch_add(1, std::memory_order_relaxed);
      l.retry_at = After(kRetryS);
    }
  }

  void Retry(int p, int err) {
    Connections().failed.fetch_add(1, std::memory_order_relaxed);
    Lower& l = lower_[p];
    l.last_error = tcp::Errno(err);
    ::close(l.fd);
    l.fd = -1;
    l.retry_at = After(kRetryS);
  }

  // Moves the connection to lower peer p on: connected, hello sent, ack read.
  void Advance(int p) {
    Lower& l = lower_[p];
    if (!l.connected) {
      const int err = tcp::ConnectError(l.fd);
      if (err != 0) return Retry(p, err);
      l.connected = true;
    }
    if (l.sent < sizeof(l.hello)) {
      const char* h = reinterpret_cast<const char*>(&l.hello);
      ssize_t w = ::send(l.fd, h + l.sent, sizeof(l.hello) - l.sent, MSG_NOSIGNAL);
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      if (w < 0) return Retry(p, errno);  // e.g. refused: connect again until lost or late
      l.sent += static_cast<size_t>(w);
      return;
    }
    char* a = reinterpret_cast<char*>(&l.ack);
    ssize_t r = ::recv(l.fd, a + l.got, sizeof(l.ack) - l.got, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (r <= 0) {
      CheckLost(true);
      Throw(Status::PeerLost("rank " + std::to_string(p) + " dropped the connection from rank " +
                             std::to_string(rank_) + " before acknowledging its hello (" +
                             (r == 0 ? std::string("closed") : tcp::Errno(errno)) +
                             "): it exited, or refused the hello (see its log)"));
    }
    l.got += static_cast<size_t>(r);
    if (l.got < sizeof(l.ack)) return;
    if (l.ack != static_cast<uint32_t>(p)) {
      Throw(Status::PeerLost("the listener of rank " + std::to_string(p) + " at " + l.host + ":" +
                             std::to_string(l.port) + " acknowledged as rank " +
                             std::to_string(l.ack) + " (a stale address in the store?)"));
    }
    l.acked = true;
    Connections().opened.fetch_add(1, std::memory_order_relaxed);
  }

  [[noreturn]] void ThrowTimeout() {
    std::ostringstream os;
    os << "rank " << rank_ << " waited " << timeout_s_ << " s (SPARK_HVD_START_TIMEOUT_S) for";
    const char* sep = " ";
    std::vector<int32_t> silent;
    std::vector<int32_t> missing;
    for (int p : higher_) {
      if (!desk_->Has(p)) missing.push_back(p);
    }
    if (!missing.empty()) {
      os << sep << "connections from rank" << (missing.size() > 1 ? "s " : " ")
         << JoinRanks(missing);
      silent = missing;
      sep = "; ";
    }
    for (const auto& kv : lower_) {
      const Lower& l = kv.second;
      if (!l.wanted || l.acked) continue;
      silent.push_back(kv.first);
      os << sep << "rank " << kv.first << " at " << l.host << ":" << l.port;
      if (l.connected) {
        os << " to acknowledge this rank's hello";
      } else {
        os << " to accept a connection (last error: " << l.last_error << ")";
      }
      sep = "; ";
    }
    std::sort(silent.begin(), silent.end());
    Throw(Status(StatusCode::kTimeout, os.str(), silent));
  }

  int rank_;
  int size_;
  std::shared_ptr<Store> store_;
  double timeout_s_;
  TcpMesh::LostPeers lost_peers_;
  int listener_;
  std::unique_ptr<tcp::FdCloser> closer_;  // the listener's
  std::string token_;
  std::unique_ptr<tcp::HelloDesk> desk_;
  Clock::time_point deadline_{};
  Clock::time_point next_lost_check_{};
  std::map<int, Lower> lower_;  // lower peers: addresses read, connections in progress
  std::vector<int> higher_;     // higher peers this round waits for
  std::vector<pollfd> pfds_;
  std::vector<int> owner_;  // lower peer of each of the first pfds_
};

// Here, where TcpLinks is complete.
TcpMesh::TcpMesh(int rank, int size, std::vector<int> fds, double timeout_s,
                 std::vector<int32_t> members, PeerLiveness* liveness,
                 std::unique_ptr<TcpLinks> links)
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
  TcpLinks links(rank, size, std::move(store), connect_timeout_s, lost_peers);
  links.Listen(bind_host);
  std::vector<int> fds(static_cast<size_t>(size), -1);
  std::vector<int> all;
  for (int p = 0; p < size; ++p) {
    if (p != rank) all.push_back(p);
  }
  links.Connect(all, &fds);
  for (int p = 0; p < size; ++p) {
    if (p != rank) tcp::SetNoDelay(fds[p]);
  }
  return fds;
}

std::unique_ptr<TcpMesh> TcpMesh::Connect(int rank, int size, std::shared_ptr<Store> store,
                                          const std::string& bind_host, double timeout_s,
                                          double connect_timeout_s, LostPeers lost_peers,
                                          std::vector<int32_t> members, PeerLiveness* liveness) {
  auto links =
      std::make_unique<TcpLinks>(rank, size, std::move(store), connect_timeout_s, lost_peers);
  links->Listen(bind_host);
  std::vector<int> fds(static_cast<size_t>(size), -1);
  links->Connect(AlgorithmPeers(rank, size), &fds);
  for (int p = 0; p < size; ++p) {
    if (fds[p] >= 0) tcp::SetNoDelay(fds[p]);
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
  for (int p : need_) tcp::SetNoDelay(fds_[p]);
  return Status::OK();
}

}  // namespace spark_hvd
