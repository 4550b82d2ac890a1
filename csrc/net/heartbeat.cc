#include "net/heartbeat.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

#include "common/env.h"
#include "common/logging.h"
#include "common/traffic.h"
#include "common/types.h"
#include "net/heartbeat_wire.h"

namespace spark_hvd {

using namespace heartbeat;  // NOLINT: this file's own records and limits

std::unique_ptr<PeerLiveness> StartHeartbeats(const LivenessOptions& options) {
  const double timeout_s = env::HeartbeatTimeoutS();
  if (timeout_s <= 0 || options.size <= 1 || !options.store) return nullptr;
  return std::make_unique<Heartbeats>(options, timeout_s);
}

Heartbeats::Heartbeats(const LivenessOptions& options, double timeout_s)
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
    throw StatusError(Status::Internal("eventfd: " + net::Errno(errno)));
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
          events = l.connected && l.hello_sent >= sizeof(net::Hello) ? POLLIN : POLLOUT;
          wake = std::min(wake, l.deadline);
        } else if (!l.outbox.empty()) {
          events |= POLLOUT;
        }
        if (!l.probe) wake = std::min(wake, SilentBy(l));
        pfds.push_back(pollfd{l.fd, events, 0});
        who.push_back(static_cast<int>(i));
      }
    }
    const size_t first_desk = pfds.size();
    desk_->AddPolls(listener_, &pfds, &wake);
    if (::poll(pfds.data(), pfds.size(), net::MillisUntil(wake)) < 0 && errno != EINTR) {
      SHVD_LOG(kError, "heartbeat") << "poll: " << net::Errno(errno) << "; heartbeats stop";
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
      net::SetNoDelay(in.fd);
      in.last_heard = Clock::now();
      links_.push_back(std::move(in));
    }
    const auto now = Clock::now();
    for (Link& l : links_) {  // step 3 (and probes that ran out of time)
      if (l.fd < 0) continue;
      if (l.probe && !l.ok && !l.failed && now >= l.deadline) {
        l.failed = true;
      } else if (!l.probe && now > SilentBy(l)) {
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
      l.grace = {};
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
  while (open > 0 && ::poll(pfds.data(), pfds.size(), net::MillisUntil(deadline)) > 0) {
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

void Heartbeats::SimulateStop(bool crash) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (left_) return;
    left_ = crash;
  }
  Signal(stop_fd_);
  if (thread_.joinable()) thread_.join();
  if (!crash) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (Link& l : links_) CloseLink(l, false);
  links_.clear();
  desk_.reset();  // half-open connections
  if (listener_ >= 0) ::close(listener_);
  listener_ = -1;
}

}  // namespace spark_hvd
