// TcpMesh set-up. Every rank r of n runs the same steps:
//  1. Listen on bind_host (any port, backlog kBacklog) and publish
//     "host port token" under tcp/<r> in the store. The token is random per
//     listener; only holders of the store's secret can read it.
//  2. Read the address of every lower rank from the store, waiting for each.
//     Nothing else is waited on before step 3, so no rank waits on another's
//     accept loop: a rank that is late in step 2 leaves its connections queued in
//     its listener's backlog, their hellos buffered by the kernel.
//  3. One poll loop until every higher rank has connected and every lower rank
//     has acknowledged:
//     - to each lower rank p: a non-blocking connection (started again after a
//       failure), then the hello {magic, r, p's token}, then p's acknowledgement
//       (p's rank, 4 bytes) read back;
//     - the listener accepts whatever arrives, and each accepted connection has
//       kHelloTimeoutS from its accept for its whole hello, read as it arrives;
//     - a valid hello (the magic, this listener's token, a higher rank not yet
//       connected) is acknowledged and its connection kept. Anything else (a stray
//       client, another job's rank, a connection silent or closed mid-hello) is
//       closed and logged with what happened; it never delays the others.
//  4. While waiting in steps 2 and 3, at least every kLostCheckS: if the
//     rendezvous service has lost a peer (its process exited or its host
//     vanished), fail with kPeerLost naming it rather than wait out the deadline.
// Steps 2 and 3 share one deadline, connect_timeout_s after the start.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

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

// One rank's set-up: steps 1 to 4 above.
class MeshSetup {
 public:
  MeshSetup(int rank, int size, Store* store, double connect_timeout_s,
            const TcpMesh::LostPeers& lost_peers)
      : rank_(rank),
        size_(size),
        store_(store),
        timeout_s_(connect_timeout_s),
        deadline_(After(connect_timeout_s)),
        lost_peers_(lost_peers),
        lower_(static_cast<size_t>(rank)) {}

  ~MeshSetup() {
    for (const auto& l : lower_) {
      if (l.fd >= 0) ::close(l.fd);
    }
  }

  std::vector<int> Run(const std::string& bind_host) {
    int port = 0;
    tcp::FdCloser listener(tcp::Listen(bind_host, kBacklog, &port));
    const std::string token = tcp::RandomHex(tcp::kTokenBytes);
    store_->Set("tcp/" + std::to_string(rank_),
                bind_host + " " + std::to_string(port) + " " + token);
    for (int p = 0; p < rank_; ++p) ReadAddress(p);
    tcp::HelloDesk desk(rank_, size_, token, kHelloTimeoutS);
    while (!Done(desk)) Step(listener.get(), &desk);
    std::vector<int> fds(static_cast<size_t>(size_), -1);
    for (int p = 0; p < rank_; ++p) std::swap(fds[p], lower_[p].fd);
    for (int p = rank_ + 1; p < size_; ++p) fds[p] = desk.Take(p);
    return fds;
  }

 private:
  struct Lower {
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

  bool Done(const tcp::HelloDesk& desk) const {
    for (const auto& l : lower_) {
      if (!l.acked) return false;
    }
    return desk.Missing().empty();
  }

  // Step 2 for rank p, watching for lost peers while its address is not there.
  void ReadAddress(int p) {
    const std::string key = "tcp/" + std::to_string(p);
    std::string address;
    while (true) {
      CheckLost(false);
      const double left = std::chrono::duration<double>(deadline_ - Clock::now()).count();
      if (left <= 0) {
        std::ostringstream os;
        os << "rank " << rank_ << " waited " << timeout_s_ << " s for the address of rank " << p
           << " (key " << key << " in the rendezvous store): rank " << p
           << " did not reach init in time (SPARK_HVD_START_TIMEOUT_S)";
        Throw(Status(StatusCode::kTimeout, os.str(), {p}));
      }
      try {
        address =
            store_->Get(key, lost_peers_ ? std::max(0.01, std::min(left, kLostCheckS)) : left);
        break;
      } catch (const StatusError& e) {
        if (e.status().code() != StatusCode::kTimeout) throw;
      }
    }
    Lower& l = lower_[p];
    std::istringstream in(address);
    in >> l.host >> l.port >> l.token;
    if (l.token.size() != tcp::kTokenBytes) {
      Throw(Status::StoreError("malformed address of rank " + std::to_string(p) +
                               " in the store: '" + address + "'"));
    }
    l.hello = tcp::MakeHello(rank_, l.token);
  }

  // Step 4: throws kPeerLost when the rendezvous service has lost a peer.
  void CheckLost(bool now) {
    if (!lost_peers_ || (!now && Clock::now() < next_lost_check_)) return;
    next_lost_check_ = After(kLostCheckS);
    const std::vector<int> lost = lost_peers_();
    if (lost.empty()) return;
    Throw(Status::PeerLost("rank " + std::to_string(rank_) + " stopped connecting to its peers: " +
                               "the rendezvous service lost rank" + (lost.size() > 1 ? "s " : " ") +
                               JoinRanks(lost) +
                               " during init (the process exited or its host is " + "unreachable)",
                           std::vector<int32_t>(lost.begin(), lost.end())));
  }

  // One round of step 3: poll everything pending, then move what is ready.
  void Step(int listener, tcp::HelloDesk* desk) {
    CheckLost(false);
    if (Clock::now() >= deadline_) ThrowTimeout(*desk);
    Clock::time_point wake = lost_peers_ ? std::min(deadline_, next_lost_check_) : deadline_;
    std::vector<pollfd> pfds;
    std::vector<int> owner;  // lower rank, or -1 for the listener and accepted connections
    for (int p = 0; p < rank_; ++p) {
      Lower& l = lower_[p];
      if (l.acked) continue;
      if (l.fd < 0 && Clock::now() >= l.retry_at) Start(p);
      if (l.fd < 0) {
        wake = std::min(wake, l.retry_at);
        continue;
      }
      const bool sending = !l.connected || l.sent < sizeof(l.hello);
      pfds.push_back(pollfd{l.fd, static_cast<short>(sending ? POLLOUT : POLLIN), 0});
      owner.push_back(p);
    }
    const size_t first_desk = pfds.size();
    desk->AddPolls(listener, &pfds, &wake);
    owner.resize(pfds.size(), -1);
    int rc = ::poll(pfds.data(), pfds.size(), tcp::MillisUntil(wake));
    if (rc < 0 && errno != EINTR) Throw(Status::Internal("poll: " + tcp::Errno(errno)));
    for (size_t i = 0; i < first_desk; ++i) {
      if (pfds[i].revents != 0) Advance(owner[i]);
    }
    desk->Handle(listener, pfds, first_desk);
  }

  void Start(int p) {
    Lower& l = lower_[p];
    l.fd = tcp::StartConnect(l.host, l.port, &l.last_error);
    l.connected = false;
    l.sent = 0;
    if (l.fd < 0) {
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

  // Moves the connection to lower rank p on: connected, hello sent, ack read.
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

  [[noreturn]] void ThrowTimeout(const tcp::HelloDesk& desk) {
    std::ostringstream os;
    os << "rank " << rank_ << " waited " << timeout_s_ << " s (SPARK_HVD_START_TIMEOUT_S) for";
    const char* sep = " ";
    const std::vector<int> missing = desk.Missing();
    std::vector<int32_t> silent(missing.begin(), missing.end());
    if (!missing.empty()) {
      os << sep << "connections from rank" << (missing.size() > 1 ? "s " : " ")
         << JoinRanks(std::vector<int32_t>(missing.begin(), missing.end()));
      sep = "; ";
    }
    for (int p = 0; p < rank_; ++p) {
      const Lower& l = lower_[p];
      if (l.acked) continue;
      silent.push_back(p);
      os << sep << "rank " << p << " at " << l.host << ":" << l.port;
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
  Store* store_;
  double timeout_s_;
  Clock::time_point deadline_;
  const TcpMesh::LostPeers& lost_peers_;
  Clock::time_point next_lost_check_{};
  std::vector<Lower> lower_;
};

}  // namespace

std::vector<int> TcpMesh::ConnectSockets(int rank, int size, Store* store,
                                         const std::string& bind_host, double connect_timeout_s,
                                         const LostPeers& lost_peers) {
  std::vector<int> fds = MeshSetup(rank, size, store, connect_timeout_s, lost_peers).Run(bind_host);
  for (int p = 0; p < size; ++p) {
    if (p != rank) tcp::SetNoDelay(fds[p]);
  }
  return fds;
}

std::unique_ptr<TcpMesh> TcpMesh::Connect(int rank, int size, Store* store,
                                          const std::string& bind_host, double timeout_s,
                                          double connect_timeout_s, const LostPeers& lost_peers,
                                          std::vector<int32_t> members, PeerLiveness* liveness) {
  std::vector<int> fds =
      ConnectSockets(rank, size, store, bind_host, connect_timeout_s, lost_peers);
  SHVD_LOG(kDebug, "tcp") << "mesh of rank " << rank << " of " << size << " connected";
  return std::unique_ptr<TcpMesh>(
      new TcpMesh(rank, size, std::move(fds), timeout_s, std::move(members), liveness));
}

}  // namespace spark_hvd
