// PeerLinks (links.h): the connections of a rank, made at init for the peers its
// algorithms talk to (a tcp mesh: TcpMesh::Connect) and later, on demand, for any other. Every rank
// r of n runs the same steps:
//  1. Listen on bind_host (any port, backlog kBacklog); its "host port token" is
//     published under tcp/<r> in the store by step 3's request. The token is random per
//     listener; only holders of the store's secret can read it. The listener stays open
//     for the mesh's life.
//  2. Decide which peers to connect now: at init the peers of the mesh's algorithms,
//     rank +- 2^k (mod n) for every power of two below n (AlgorithmPeers: at most
//     2 ceil(log2 n) of them; every peer when n <= 4); later, in a collective that
//     exchanges with a peer not connected yet (an alltoall), that peer. Both ranks of a
//     pair reach the same collective, so both come to connect it; of each pair the
//     higher rank connects and the lower one accepts.
//  3. Read the addresses of the lower peers to connect that it has not read yet, in one
//     request (Store::MultiGet; the first time Store::SetAndMultiGet, which publishes
//     this rank's address in the same request), which waits for them and fails at once when the
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
#include "net/links.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

#include "common/logging.h"
#include "common/traffic.h"
#include "common/types.h"

namespace spark_hvd {
namespace {

using net::After;
using net::Clock;

constexpr int kBacklog = 1024;          // connections the kernel queues for accept
constexpr double kHelloTimeoutS = 5.0;  // per accepted connection, for its whole hello
constexpr double kLostCheckS = 0.5;     // how often to ask the store for lost peers
constexpr double kRetryS = 0.02;        // pause before connecting again after a failure

[[noreturn]] void Throw(Status s) { throw StatusError(std::move(s)); }

}  // namespace

PeerLinks::PeerLinks(int rank, int size, std::shared_ptr<Store> store, double connect_timeout_s,
                     LostPeers lost_peers, int descriptors_per_rank, std::string key_prefix)
    : rank_(rank),
      size_(size),
      store_(std::move(store)),
      timeout_s_(connect_timeout_s),
      lost_peers_(std::move(lost_peers)),
      listener_(-1),
      descriptors_per_rank_(descriptors_per_rank),
      key_prefix_(std::move(key_prefix)) {}

PeerLinks::~PeerLinks() {
  for (auto& kv : lower_) {
    if (kv.second.fd >= 0) ::close(kv.second.fd);
  }
}

void PeerLinks::Listen(const std::string& bind_host) {
  int port = 0;
  listener_ = net::Listen(bind_host, kBacklog, &port);
  closer_ = std::make_unique<net::FdCloser>(listener_);
  token_ = net::RandomHex(net::kTokenBytes);
  desk_ = std::make_unique<net::HelloDesk>(rank_, size_, token_, kHelloTimeoutS);
  unpublished_ = bind_host + " " + std::to_string(port) + " " + token_;  // with step 3's read
}

void PeerLinks::Connect(const std::vector<int>& peers, std::vector<int>* fds) {
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
    if (l.token.empty()) unread.push_back(key_prefix_ + std::to_string(p));
  }
  if (!unread.empty() || !unpublished_.empty()) ReadAddresses(unread);
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

bool PeerLinks::Done() const {
  for (const auto& kv : lower_) {
    if (kv.second.wanted && !kv.second.acked) return false;
  }
  for (int p : higher_) {
    if (!desk_->Has(p)) return false;
  }
  return true;
}

void PeerLinks::ReadAddresses(const std::vector<std::string>& keys) {
  std::vector<std::string> values;
  std::string mine;
  mine.swap(unpublished_);
  try {
    values = mine.empty() ? store_->MultiGet(keys, timeout_s_, /*fail_on_lost=*/true)
                          : store_->SetAndMultiGet(key_prefix_ + std::to_string(rank_), mine, keys,
                                                   timeout_s_, /*fail_on_lost=*/true);
  } catch (const StatusError& e) {
    if (e.status().code() == StatusCode::kPeerLost && !e.status().ranks().empty()) {
      Throw(LostDuringInit("rank " + std::to_string(rank_) + " stopped connecting to its peers",
                           e.status()));
    }
    if (e.status().code() != StatusCode::kTimeout) throw;
    std::vector<int32_t> late;
    for (size_t i : MissingKeys(store_.get(), keys)) {
      late.push_back(std::stoi(keys[i].substr(key_prefix_.size())));
    }
    std::ostringstream os;
    os << "rank " << rank_ << " waited " << timeout_s_
       << " s (SPARK_HVD_START_TIMEOUT_S) to hear from rank" << (late.size() > 1 ? "s " : " ")
       << JoinRanks(late)
       << " in the rendezvous store (its address): " << (late.size() > 1 ? "they" : "it")
       << " did not reach init in time";
    Throw(Status(StatusCode::kTimeout, os.str(), late));
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    const int p = std::stoi(keys[i].substr(key_prefix_.size()));
    Lower& l = lower_[p];
    std::istringstream in(values[i]);
    in >> l.host >> l.port >> l.token;
    if (l.token.size() != net::kTokenBytes) {
      Throw(Status::StoreError("malformed address of rank " + std::to_string(p) +
                               " in the store: '" + values[i] + "'"));
    }
    l.hello = net::MakeHello(rank_, l.token);
  }
}

void PeerLinks::CheckLost(bool now) {
  if (!lost_peers_ || (!now && Clock::now() < next_lost_check_)) return;
  next_lost_check_ = After(kLostCheckS);
  const std::vector<int> lost = lost_peers_();
  if (lost.empty()) return;
  Throw(Status::PeerLost("rank " + std::to_string(rank_) + " stopped connecting to its peers: " +
                             "the rendezvous service lost rank" + (lost.size() > 1 ? "s " : " ") +
                             JoinRanks(lost) + " (the process exited or its host is unreachable)",
                         std::vector<int32_t>(lost.begin(), lost.end())));
}

void PeerLinks::OutOfDescriptors(const char* doing) {
  Throw(Status::InvalidArgument("rank " + std::to_string(rank_) + " ran out of file descriptors " +
                                doing + ": " + net::DescriptorLimitAdvice(descriptors_per_rank_)));
}

void PeerLinks::Step() {
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
  int rc = ::poll(pfds_.data(), pfds_.size(), net::MillisUntil(wake));
  if (rc < 0 && errno != EINTR) Throw(Status::Internal("poll: " + net::Errno(errno)));
  for (size_t i = 0; i < first_desk; ++i) {
    if (pfds_[i].revents != 0) Advance(owner_[i]);
  }
  desk_->Handle(listener_, pfds_, first_desk);
  if (desk_->out_of_descriptors()) OutOfDescriptors("accepting a peer's connection");
}

void PeerLinks::Start(int p) {
  Lower& l = lower_[p];
  bool out_of_descriptors = false;
  l.fd = net::StartConnect(l.host, l.port, &l.last_error, &out_of_descriptors);
  l.connected = false;
  l.sent = 0;
  l.got = 0;
  if (l.fd < 0) {
    if (out_of_descriptors) OutOfDescriptors(("connecting to rank " + std::to_string(p)).c_str());
    Connections().failed.fetch_add(1, std::memory_order_relaxed);
    l.retry_at = After(kRetryS);
  }
}

void PeerLinks::Retry(int p, int err) {
  Connections().failed.fetch_add(1, std::memory_order_relaxed);
  Lower& l = lower_[p];
  l.last_error = net::Errno(err);
  ::close(l.fd);
  l.fd = -1;
  l.retry_at = After(kRetryS);
}

void PeerLinks::Advance(int p) {
  Lower& l = lower_[p];
  if (!l.connected) {
    const int err = net::ConnectError(l.fd);
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
                           (r == 0 ? std::string("closed") : net::Errno(errno)) +
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

void PeerLinks::ThrowTimeout() {
  std::ostringstream os;
  os << "rank " << rank_ << " waited " << timeout_s_ << " s (SPARK_HVD_START_TIMEOUT_S) for";
  const char* sep = " ";
  std::vector<int32_t> silent;
  std::vector<int32_t> missing;
  for (int p : higher_) {
    if (!desk_->Has(p)) missing.push_back(p);
  }
  if (!missing.empty()) {
    os << sep << "connections from rank" << (missing.size() > 1 ? "s " : " ") << JoinRanks(missing);
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

}  // namespace spark_hvd
