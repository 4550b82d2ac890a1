#include "backends/tcp/heartbeat.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

#include "backends/backend.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/traffic.h"

namespace spark_hvd {
namespace {

using tcp::After;
using tcp::Clock;
using tcp::SecondsSince;

constexpr char kBeat = 'H';
constexpr char kLostRecord = 'L';
constexpr char kLeftRecord = 'G';
constexpr char kBye = 'B';
constexpr size_t kLostRecordBytes = 1 + 4 + 1 + 4;
constexpr size_t kLeftRecordBytes = 1 + 4;
constexpr double kLeaveWaitS = 0.5;     // step 6: for the neighbours to close their side
constexpr double kHelloTimeoutS = 5.0;  // per accepted connection, for its whole hello
constexpr int kBook = 16;               // successors' addresses read at set-up
constexpr int kProbeBatch = 8;          // would-be successors tried at once (step 5)
constexpr int kBacklog = 128;

void Signal(int efd) {
  const uint64_t one = 1;
  ssize_t w = ::write(efd, &one, sizeof(one));
  (void)w;  // an eventfd write of 1 cannot fail short of overflow
}

std::string Seconds(double s) {
  std::ostringstream os;
  os.precision(2);
  os << std::fixed << s;
  return os.str();
}

Clock::duration Duration(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::string LostRecord(int32_t rank, uint8_t how, int32_t reporter) {
  std::string r(1, kLostRecord);
  r.append(reinterpret_cast<const char*>(&rank), sizeof(rank));
  r.push_back(static_cast<char>(how));
  r.append(reinterpret_cast<const char*>(&reporter), sizeof(reporter));
  return r;
}

std::string LeftRecord(int32_t rank) {
  std::string r(1, kLeftRecord);
  r.append(reinterpret_cast<const char*>(&rank), sizeof(rank));
  return r;
}

}  // namespace

std::unique_ptr<PeerLiveness> StartHeartbeats(const BackendOptions& options) {
  const double timeout_s = env::HeartbeatTimeoutS();
  if (timeout_s <= 0 || options.size <= 1 || !options.store) return nullptr;
  return std::make_unique<Heartbeats>(options, timeout_s);
}

Heartbeats::Heartbeats(const BackendOptions& options, double timeout_s)
    : rank_(options.rank),
      size_(options.size),
      timeout_s_(timeout_s),
      interval_s_(timeout_s / 6),
      store_(std::make_shared<PrefixStore>(options.store_prefix + "/live", options.store)),
      ranks_(static_cast<size_t>(options.size)) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0 || stop_fd_ < 0) {
    if (wake_fd_ >= 0) ::close(wake_fd_);
    if (stop_fd_ >= 0) ::close(stop_fd_);
    throw StatusError(Status::Internal("eventfd: " + tcp::Errno(errno)));
  }
  try {
    SetUp(options);
  } catch (...) {
    for (Link& l : links_) {
      if (l.fd >= 0) ::close(l.fd);
    }
    if (listener_ >= 0) ::close(listener_);
    ::close(wake_fd_);
    ::close(stop_fd_);
    throw;
  }
  thread_ = std::thread([this] {
#ifdef __linux__
    pthread_setname_np(pthread_self(), "shvd_heartbeat");
#endif
    Run();
  });
}

Heartbeats::~Heartbeats() {
  Leave({});
  if (listener_ >= 0) ::close(listener_);
  ::close(wake_fd_);
  ::close(stop_fd_);
}

std::string Heartbeats::Address(int32_t rank) {
  auto it = book_.find(rank);
  if (it != book_.end()) return it->second;
  // Past the book read at set-up: the next kBook ranks from here, in one request.
  std::vector<std::string> keys;
  std::vector<int32_t> which;
  for (int32_t k = 0; k < kBook && k < size_ - 1; ++k) {
    const int32_t r = (rank + k) % size_;
    if (r != rank_ && !book_.count(r)) {
      keys.push_back(std::to_string(r));
      which.push_back(r);
    }
  }
  try {
    std::vector<std::string> values = store_->MultiGet(keys, timeout_s_, false);
    for (size_t i = 0; i < which.size(); ++i) book_[which[i]] = values[i];
  } catch (const StatusError& e) {
    SHVD_LOG(kWarning, "heartbeat") << "rank " << rank_ << " could not read the address of rank "
                                    << rank << ": " << e.status().message();
    book_[rank] = "";  // unreadable: healing stops there
    return "";
  }
  return book_[rank];
}

// Step 1: the successor is probed as in healing, the predecessor accepted; both must
// be there by the start deadline.
void Heartbeats::SetUp(const BackendOptions& options) {
  int port = 0;
  listener_ = tcp::Listen(options.bind_host, kBacklog, &port);
  token_ = tcp::RandomHex(tcp::kTokenBytes);
  desk_ = std::make_unique<tcp::HelloDesk>(rank_, size_, token_, kHelloTimeoutS, true);
  store_->Set(std::to_string(rank_), options.bind_host + " " + std::to_string(port) + " " + token_);
  std::vector<std::string> keys;
  std::vector<int32_t> which;
  for (int32_t k = 1; k <= kBook && k < size_; ++k) {
    which.push_back((rank_ + k) % size_);
    keys.push_back(std::to_string(which.back()));
  }
  std::vector<std::string> values;
  try {
    values = store_->MultiGet(keys, options.connect_timeout_s, true);
  } catch (const StatusError& e) {
    if (e.status().code() == StatusCode::kPeerLost && !e.status().ranks().empty()) {
      throw StatusError(LostDuringInit(
          "rank " + std::to_string(rank_) + " stopped setting up its heartbeats", e.status()));
    }
    if (e.status().code() != StatusCode::kTimeout) throw;
    std::vector<int32_t> late;
    for (size_t i : MissingKeys(store_.get(), keys)) late.push_back(which[i]);
    std::sort(late.begin(), late.end());
    throw StatusError(Status(
        StatusCode::kTimeout,
        "rank " + std::to_string(rank_) + " waited " + Seconds(options.connect_timeout_s) +
            " s (SPARK_HVD_START_TIMEOUT_S) to hear from rank" + (late.size() > 1 ? "s " : " ") +
            JoinRanks(late) + " in the rendezvous store (its heartbeat address): " +
            (late.size() > 1 ? "they" : "it") + " did not reach init in time",
        late));
  }
  for (size_t i = 0; i < which.size(); ++i) book_[which[i]] = values[i];

  const int32_t pred = (rank_ + size_ - 1) % size_;
  const int32_t succ = (rank_ + 1) % size_;
  const auto deadline = After(options.connect_timeout_s);
  Link s;  // the successor's connection, started again after a failure until the deadline
  auto retry_at = Clock::now();
  bool have_pred = false;
  std::vector<pollfd> pfds;
  auto lost_check = After(0.5);  // the service, asked every half second once a wait lasts
  while (!(s.ok && (have_pred || pred == succ))) {  // 2 ranks: one pair, either link
    const auto now = Clock::now();
    if (now >= deadline) {
      std::vector<int32_t> silent;
      if (!s.ok) silent.push_back(succ);
      if (!have_pred && pred != succ) silent.push_back(pred);
      std::sort(silent.begin(), silent.end());
      if (s.fd >= 0) ::close(s.fd);
      throw StatusError(Status(StatusCode::kTimeout,
                               "rank " + std::to_string(rank_) + " waited " +
                                   Seconds(options.connect_timeout_s) +
                                   " s (SPARK_HVD_START_TIMEOUT_S) for the heartbeat "
                                   "connections of ranks " +
                                   JoinRanks(silent),
                               silent));
    }
    if (options.lost_ranks && now >= lost_check) {
      lost_check = now + Duration(0.5);
      const std::vector<int32_t> lost = options.lost_ranks();
      if (!lost.empty()) {
        if (s.fd >= 0) ::close(s.fd);
        throw StatusError(Status::PeerLost("rank " + std::to_string(rank_) +
                                               " stopped setting up its heartbeats: the "
                                               "rendezvous service lost rank" +
                                               (lost.size() > 1 ? "s " : " ") + JoinRanks(lost),
                                           lost));
      }
    }
    if (!s.ok && s.failed) {
      ::close(s.fd);
      s = Link{};
      retry_at = now + Duration(0.02);
    }
    if (!s.ok && s.fd < 0 && now >= retry_at) {
      s.peer = succ;
      s.probe = true;
      std::string host, error, token;
      int p = 0;
      std::istringstream in(book_[succ]);
      in >> host >> p >> token;
      s.fd = tcp::StartConnect(host, p, &error);
      if (s.fd < 0) retry_at = now + Duration(0.02);
    }
    pfds.clear();
    auto wake = std::min(deadline, now + Duration(0.5));
    if (s.fd >= 0 && !s.ok) {
      const bool reading = s.connected && s.hello_sent >= sizeof(tcp::Hello);
      pfds.push_back(pollfd{s.fd, static_cast<short>(reading ? POLLIN : POLLOUT), 0});
    } else if (!s.ok) {
      wake = std::min(wake, retry_at);
    }
    const size_t first = pfds.size();
    desk_->AddPolls(listener_, &pfds, &wake);
    ::poll(pfds.data(), pfds.size(), tcp::MillisUntil(wake));
    if (first == 1 && pfds[0].revents != 0) AdvanceProbe(s);
    desk_->Handle(listener_, pfds, first);
    if (desk_->out_of_descriptors()) {
      if (s.fd >= 0) ::close(s.fd);
      throw StatusError(Status::InvalidArgument(
          "rank " + std::to_string(rank_) +
          " ran out of file descriptors accepting a heartbeat connection: " +
          tcp::DescriptorLimitAdvice(0)));
    }
    for (int peer : desk_->Ready()) {
      Link in;
      in.peer = peer;
      in.fd = desk_->Take(peer);
      in.last_heard = Clock::now();
      links_.push_back(std::move(in));
      have_pred = have_pred || peer == pred;
    }
  }
  s.probe = false;
  s.last_heard = Clock::now();
  links_.push_back(std::move(s));
  succ_ = succ;
  for (Link& link : links_) tcp::SetNoDelay(link.fd);
}

void Heartbeats::AdvanceProbe(Link& l) {
  if (!l.connected) {
    const int err = tcp::ConnectError(l.fd);
    if (err != 0) {
      l.failed = true;
      l.refused = err == ECONNREFUSED || err == ECONNRESET;
      Connections().failed.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    l.connected = true;
  }
  if (l.hello_sent < sizeof(tcp::Hello)) {
    std::string host, token;
    int port = 0;
    std::istringstream in(book_[l.peer]);
    in >> host >> port >> token;
    const tcp::Hello hello = tcp::MakeHello(rank_, token);
    const char* h = reinterpret_cast<const char*>(&hello);
    ssize_t w =
        ::send(l.fd, h + l.hello_sent, sizeof(hello) - l.hello_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (w < 0) {
      l.failed = true;
      l.refused = true;
      return;
    }
    l.hello_sent += static_cast<size_t>(w);
    return;
  }
  char* a = reinterpret_cast<char*>(&l.ack);
  ssize_t r = ::recv(l.fd, a + l.ack_got, sizeof(l.ack) - l.ack_got, MSG_DONTWAIT);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (r <= 0) {
    l.failed = true;
    l.refused = true;  // closed by its process: it refused us or is gone
    return;
  }
  l.ack_got += static_cast<size_t>(r);
  if (l.ack_got < sizeof(l.ack)) return;
  if (l.ack != static_cast<uint32_t>(l.peer)) {
    l.failed = true;
    l.refused = true;
    return;
  }
  l.ok = true;
  Connections().opened.fetch_add(1, std::memory_order_relaxed);
}

void Heartbeats::Run() {
  auto next_beat = Clock::now();
  std::vector<pollfd> pfds;
  std::vector<int> who;  // link index of each pfd past the stop fd, -1: the desk's
  while (true) {
    pfds.assign(1, pollfd{stop_fd_, POLLIN, 0});
    who.assign(1, -1);
    auto wake = next_beat;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < links_.size(); ++i) {
        const Link& l = links_[i];
        if (l.fd < 0) continue;
        short events = POLLIN;
        if (l.probe && !l.ok && !l.failed) {
          events = l.connected && l.hello_sent >= sizeof(tcp::Hello) ? POLLIN : POLLOUT;
          wake = std::min(wake, l.deadline);
        } else if (!l.outbox.empty()) {
          events |= POLLOUT;
        }
        if (!l.probe) wake = std::min(wake, l.last_heard + Duration(timeout_s_));
        pfds.push_back(pollfd{l.fd, events, 0});
        who.push_back(static_cast<int>(i));
      }
    }
    const size_t first_desk = pfds.size();
    desk_->AddPolls(listener_, &pfds, &wake);
    if (::poll(pfds.data(), pfds.size(), tcp::MillisUntil(wake)) < 0 && errno != EINTR) {
      SHVD_LOG(kError, "heartbeat") << "poll: " << tcp::Errno(errno) << "; heartbeats stop";
      return;
    }
    if (pfds[0].revents != 0) return;  // Leave
    std::unique_lock<std::mutex> lock(mu_);
    for (size_t i = 1; i < first_desk; ++i) {
      if (pfds[i].revents == 0) continue;
      Link& l = links_[static_cast<size_t>(who[i])];
      if (l.probe && !l.ok) {
        AdvanceProbe(l);
        continue;
      }
      if (pfds[i].revents & POLLOUT) Flush(l);
      if (pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) Read(l);
    }
    desk_->Handle(listener_, pfds, first_desk);
    for (int peer : desk_->Ready()) {  // a neighbour healing towards this rank (step 5)
      Link in;
      in.peer = peer;
      in.fd = desk_->Take(peer);
      tcp::SetNoDelay(in.fd);
      in.last_heard = Clock::now();
      links_.push_back(std::move(in));
    }
    const auto now = Clock::now();
    for (Link& l : links_) {  // step 3 (and probes that ran out of time)
      if (l.fd < 0) continue;
      if (l.probe && !l.ok && !l.failed && now >= l.deadline) {
        l.failed = true;
      } else if (!l.probe && SecondsSince(l.last_heard) > timeout_s_) {
        const int32_t p = l.peer;
        CloseLink(l, false);
        Learn(p, kLost, kFrozen, -1, nullptr);
      }
    }
    SettleProbes();
    if (now >= next_beat) {  // step 2
      for (Link& l : links_) {
        if (l.fd < 0 || l.probe || !l.outbox.empty()) continue;
        ssize_t w = ::send(l.fd, &kBeat, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w == 1) CountMessage(TrafficSender::kHeartbeat, TrafficKind::kLiveness, 1);
        if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          const int32_t p = l.peer;
          CloseLink(l, false);
          Learn(p, kLost, kGone, -1, nullptr);  // reset by the peer's kernel: it is gone
        }
      }
      next_beat = now + Duration(interval_s_);
    }
    links_.erase(
        std::remove_if(links_.begin(), links_.end(), [](const Link& l) { return l.fd < 0; }),
        links_.end());
    if (succ_ < 0) {
      const std::vector<int32_t> unknown = ProbeCandidates();
      if (!unknown.empty()) {  // past the book: read outside the lock (the GIL may wait)
        lock.unlock();
        for (int32_t r : unknown) Address(r);
        lock.lock();
      }
      Probe(now);
    }
  }
}

void Heartbeats::Read(Link& l) {
  char buf[256];
  while (l.fd >= 0) {
    ssize_t r = ::recv(l.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r > 0) {
      l.last_heard = Clock::now();
      l.inbox.append(buf, static_cast<size_t>(r));
      Parse(l);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    // The connection ended without a goodbye: the neighbour's process is gone.
    const int32_t p = l.peer;
    CloseLink(l, false);
    Learn(p, kLost, kGone, -1, nullptr);
  }
}

void Heartbeats::Parse(Link& l) {
  size_t i = 0;
  while (i < l.inbox.size() && l.fd >= 0) {
    const char tag = l.inbox[i];
    if (tag == kBeat) {
      ++i;
    } else if (tag == kLostRecord) {
      if (l.inbox.size() - i < kLostRecordBytes) break;
      int32_t rank, reporter;
      std::memcpy(&rank, l.inbox.data() + i + 1, sizeof(rank));
      const How how = static_cast<How>(l.inbox[i + 5]);
      std::memcpy(&reporter, l.inbox.data() + i + 6, sizeof(reporter));
      if (rank >= 0 && rank < size_) Learn(rank, kLost, how, reporter, &l);
      i += kLostRecordBytes;
    } else if (tag == kLeftRecord) {
      if (l.inbox.size() - i < kLeftRecordBytes) break;
      int32_t rank;
      std::memcpy(&rank, l.inbox.data() + i + 1, sizeof(rank));
      if (rank >= 0 && rank < size_) Learn(rank, kLeft, kGone, -1, &l);
      i += kLeftRecordBytes;
    } else if (tag == kBye) {
      CloseLink(l, false);  // the neighbour closes this link on purpose (left, or not needed)
      return;
    } else {
      SHVD_LOG(kWarning, "heartbeat") << "rank " << l.peer << " sent byte " << static_cast<int>(tag)
                                      << ", not a heartbeat record; its heartbeats are ignored";
      CloseLink(l, false);
      return;
    }
  }
  l.inbox.erase(0, i);
}

// Step 4: news of `rank` (lost, or left), from link `from` or found here; passed on once.
void Heartbeats::Learn(int32_t rank, State state, How how, int32_t reporter, const Link* from) {
  if (rank == rank_ || rank < 0 || rank >= size_) return;
  Rank& r = ranks_[static_cast<size_t>(rank)];
  if (r.state != kAlive) return;
  r.state = state;
  r.how = how;
  r.reporter = reporter;
  if (state == kLost) {
    if (first_loss_ == Clock::time_point{}) first_loss_ = Clock::now();
    // Silent ranks may be a host cut off: wait out the probes' window (Verdict).
    const double settle = how == kFrozen || how == kUnreachable ? timeout_s_ / 3 + 0.5 : 0.25;
    settle_s_ = std::max(settle_s_, settle);
    SHVD_LOG(kInfo, "heartbeat") << "rank " << rank_ << " lost rank " << rank << ": "
                                 << Why(how, reporter);
    if (!woken_) {
      woken_ = true;
      Signal(wake_fd_);
    }
  }
  const std::string record =
      state == kLost ? LostRecord(rank, how, reporter < 0 ? rank_ : reporter) : LeftRecord(rank);
  for (Link& l : links_) {
    if (&l != from && l.fd >= 0 && !(l.probe && !l.ok)) Send(l, record);
  }
  if (rank == succ_ && state == kLost) {  // step 5: heal the ring past it
    succ_ = -1;
    probed_up_to_ = rank;
  }
  changed_.notify_all();
}

void Heartbeats::Send(Link& l, const std::string& bytes) {
  l.outbox += bytes;
  Flush(l);
}

void Heartbeats::Flush(Link& l) {
  while (!l.outbox.empty() && l.fd >= 0) {
    ssize_t w = ::send(l.fd, l.outbox.data(), l.outbox.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w > 0) {
      l.outbox.erase(0, static_cast<size_t>(w));
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    return;  // full (a frozen neighbour is lost by step 3) or broken (Read sees it)
  }
}

// The ranks the next probe batch would try whose address is not in the book.
std::vector<int32_t> Heartbeats::ProbeCandidates() const {
  std::vector<int32_t> unknown;
  for (const Link& l : links_) {
    if (l.probe) return unknown;  // a batch in flight
  }
  int counted = 0;
  for (int32_t k = 1; k < size_ && counted < kProbeBatch; ++k) {
    const int32_t r = (probed_up_to_ + k) % size_;
    if (r == rank_) break;
    if (ranks_[static_cast<size_t>(r)].state != kAlive) continue;
    ++counted;
    if (!book_.count(r)) unknown.push_back(r);
  }
  return unknown;
}

// Step 5: probes the next ranks after the lost successor, up to kProbeBatch at once.
void Heartbeats::Probe(const Clock::time_point& now) {
  for (const Link& l : links_) {
    if (l.probe) return;  // a batch in flight
  }
  int started = 0;
  for (int32_t k = 1; k < size_ && started < kProbeBatch; ++k) {
    const int32_t r = (probed_up_to_ + k) % size_;
    if (r == rank_) break;  // every other rank is lost or left
    if (ranks_[static_cast<size_t>(r)].state != kAlive) continue;
    auto known = book_.find(r);
    if (known == book_.end() || known->second.empty()) break;  // unreadable: stop healing
    const std::string& address = known->second;
    Link l;
    l.peer = r;
    l.probe = true;
    l.deadline = now + Duration(timeout_s_ / 3);
    l.last_heard = now;
    std::string host, error, token;
    int port = 0;
    std::istringstream in(address);
    in >> host >> port >> token;
    l.fd = tcp::StartConnect(host, port, &error);
    if (l.fd < 0) {
      l.failed = true;
      l.refused = true;
    }
    links_.push_back(std::move(l));
    ++started;
  }
  if (started == 0) probed_up_to_ = rank_;  // nothing left to heal towards
}

// Step 5, once every probe of the batch is settled: the nearest that answered is the
// successor, the others that answered get a goodbye, the ones that did not are lost.
void Heartbeats::SettleProbes() {
  bool any = false;
  for (const Link& l : links_) {
    if (!l.probe) continue;
    any = true;
    if (!l.ok && !l.failed) return;  // still in flight
  }
  if (!any) return;
  auto distance = [&](int32_t r) { return (r - rank_ + size_) % size_; };
  int32_t best = -1;
  for (const Link& l : links_) {
    if (l.probe && l.ok && (best < 0 || distance(l.peer) < distance(best))) best = l.peer;
  }
  std::vector<std::pair<int32_t, How>> lost;
  int32_t farthest = probed_up_to_;
  for (Link& l : links_) {
    if (!l.probe) continue;
    if (distance(l.peer) > distance(farthest)) farthest = l.peer;
    if (l.ok && l.peer == best) {
      l.probe = false;
      l.last_heard = Clock::now();
      tcp::SetNoDelay(l.fd);
      continue;
    }
    // Nearer than the successor found (or none found): lost. Farther: not needed.
    if (!l.ok && (best < 0 || distance(l.peer) < distance(best))) {
      lost.emplace_back(l.peer, l.refused ? kGone : kUnreachable);
    }
    CloseLink(l, l.ok);
  }
  if (best >= 0) {
    succ_ = best;
  } else {
    probed_up_to_ = farthest;  // the next batch starts past these
  }
  for (const auto& p : lost) Learn(p.first, kLost, p.second, -1, nullptr);
  if (best >= 0) {  // what the new successor may not know yet
    for (Link& l : links_) {
      if (l.peer != best || l.fd < 0) continue;
      for (int32_t r = 0; r < size_; ++r) {
        const Rank& x = ranks_[static_cast<size_t>(r)];
        if (x.state == kLost) Send(l, LostRecord(r, x.how, x.reporter < 0 ? rank_ : x.reporter));
      }
    }
  }
}

void Heartbeats::CloseLink(Link& l, bool bye) {
  if (l.fd < 0) return;
  if (bye) {
    const char b = kBye;
    ssize_t w = ::send(l.fd, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    (void)w;
  }
  ::close(l.fd);
  l.fd = -1;
}

std::string Heartbeats::Why(How how, int32_t reporter) const {
  std::string text;
  if (how == kFrozen) {
    text = "it answered no heartbeat for " + Seconds(timeout_s_) +
           " s: stopped by a signal, hung, or its host unreachable "
           "(SPARK_HVD_HEARTBEAT_TIMEOUT_S sets the limit)";
  } else if (how == kGone) {
    text = "its connection closed without a goodbye: the process exited or was killed";
  } else if (how == kUnreachable) {
    text = "it did not answer a heartbeat connection within " + Seconds(timeout_s_ / 3) +
           " s: its host is unreachable or the process hung";
  } else {
    text = "its engine stopped on losing it";
  }
  if (reporter >= 0 && reporter != rank_) {
    text = "rank " + std::to_string(reporter) + " reported: " + text;
  }
  return text;
}

Status Heartbeats::Verdict(const std::string& what, const std::vector<int32_t>& closed,
                           double wait_s) {
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait_for(lock, std::chrono::duration<double>(wait_s), [&] {
    return std::all_of(closed.begin(), closed.end(), [&](int32_t r) {
      return r < 0 || r >= size_ || ranks_[static_cast<size_t>(r)].state != kAlive;
    });
  });
  // One loss often comes with others (a host's ranks): its neighbours' probes name the
  // rest within a third of the timeout (step 5), a killed process's in milliseconds.
  // The verdict waits for them from the first loss this rank heard of, so that every
  // survivor names the same ranks.
  while (first_loss_ != Clock::time_point{} && Clock::now() < first_loss_ + Duration(settle_s_)) {
    changed_.wait_until(lock, first_loss_ + Duration(settle_s_));  // settle_s_ may grow
  }
  std::vector<int32_t> ranks;
  std::string why;
  for (int32_t p = 0; p < size_; ++p) {
    const Rank& x = ranks_[static_cast<size_t>(p)];
    if (p == rank_ || x.state != kLost) continue;
    ranks.push_back(p);
    why +=
        (why.empty() ? "" : "; ") + ("rank " + std::to_string(p) + ": ") + Why(x.how, x.reporter);
  }
  const std::string here = what + " on rank " + std::to_string(rank_);
  if (!ranks.empty()) {
    if (ranks.size() == 1) {
      const Rank& x = ranks_[static_cast<size_t>(ranks[0])];
      return Status::PeerLost(
          here + " lost rank " + std::to_string(ranks[0]) + ": " + Why(x.how, x.reporter), ranks);
    }
    return Status::PeerLost(here + " lost ranks " + JoinRanks(ranks) + " (" + why + ")", ranks);
  }
  std::vector<int32_t> left;
  for (int32_t r : closed) {
    if (r >= 0 && r < size_ && ranks_[static_cast<size_t>(r)].state == kLeft) left.push_back(r);
  }
  if (left.empty()) return Status::OK();
  std::sort(left.begin(), left.end());
  return Status::PeerLost(here + " lost rank" + (left.size() > 1 ? "s " : " ") + JoinRanks(left) +
                              ": it left (its engine stopped, after shutdown() or a failure of "
                              "its own, while this op needed it; its log says why)",
                          left);
}

void Heartbeats::Leave(const std::vector<int32_t>& lost) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (left_) return;
    left_ = true;
  }
  Signal(stop_fd_);
  if (thread_.joinable()) thread_.join();
  // Step 6: the records, then this rank's departure and the goodbye, to every neighbour.
  std::string bye;
  for (int32_t p = 0; p < size_; ++p) {
    const Rank& x = ranks_[static_cast<size_t>(p)];
    if (x.state == kLost) bye += LostRecord(p, x.how, x.reporter < 0 ? rank_ : x.reporter);
  }
  for (int32_t r : lost) {
    if (r >= 0 && r < size_ && r != rank_ && ranks_[static_cast<size_t>(r)].state != kLost) {
      bye += LostRecord(r, kStoppedOn, rank_);
    }
  }
  bye += LeftRecord(rank_);
  bye.push_back(kBye);
  std::vector<pollfd> pfds;
  for (Link& l : links_) {
    if (l.fd < 0) continue;
    if (l.probe && !l.ok) {
      ::close(l.fd);
      l.fd = -1;
      continue;
    }
    l.outbox += bye;
    Flush(l);
    if (l.outbox.empty()) {
      ::shutdown(l.fd, SHUT_WR);
      pfds.push_back(pollfd{l.fd, POLLIN, 0});
    }
  }
  // Closing with unread bytes would reset the connection, and a reset may drop the
  // goodbye before the peer reads it: read until each peer closed its side.
  const auto deadline = After(kLeaveWaitS);
  char buf[256];
  size_t open = pfds.size();
  while (open > 0 && ::poll(pfds.data(), pfds.size(), tcp::MillisUntil(deadline)) > 0) {
    for (auto& pfd : pfds) {
      if (pfd.fd < 0 || pfd.revents == 0) continue;
      ssize_t r = ::recv(pfd.fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        pfd.fd = -1;  // poll ignores it from now on
        --open;
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (Link& l : links_) CloseLink(l, false);
  links_.clear();
}

}  // namespace spark_hvd
