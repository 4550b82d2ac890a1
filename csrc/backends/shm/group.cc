#include "backends/shm/group.h"

#include <linux/futex.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <sstream>

#include "common/spin.h"
#include "common/traffic.h"
#include "common/types.h"

namespace spark_hvd {
namespace shm {
namespace {

using Clock = std::chrono::steady_clock;

// Spinning this long (common/spin.h) catches a peer that is in step without a system
// call; beyond it the waiter sleeps, so no core burns while a peer computes.
constexpr double kSpinUs = 30.0;
// A sleeping waiter wakes this often to check its peers' sockets (a lost peer is
// reported within this, well inside the second the tests allow).
constexpr double kLiveCheckS = 0.05;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t value, double seconds) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(seconds);
  ts.tv_nsec = static_cast<long>((seconds - static_cast<double>(ts.tv_sec)) * 1e9);
  // Not FUTEX_PRIVATE: the word is in memory shared with other processes.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, value, &ts, nullptr, 0);
}

// A pidfd (readable once the process exits) of the process at the other end of a
// connected Unix socket, its pid as the kernel sees it from here; -1 where the kernel has
// no pidfd_open or the peer is in another pid namespace.
int PeerPidfd(int sock) {
#ifdef SYS_pidfd_open
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) return -1;
  return static_cast<int>(::syscall(SYS_pidfd_open, cred.pid, 0));
#else
  (void)sock;
  return -1;
#endif
}

void FutexWake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

Group::Group(int rank, std::vector<int32_t> job_ranks, std::vector<Mapping> maps,
             std::vector<int> socks, double timeout_s, PeerLiveness* liveness)
    : rank_(rank),
      job_ranks_(std::move(job_ranks)),
      maps_(std::move(maps)),
      socks_(std::move(socks)),
      pidfds_(socks_.size(), -1),
      timeout_s_(timeout_s),
      liveness_(liveness) {
  for (size_t r = 0; r < socks_.size(); ++r) {
    if (socks_[r] >= 0) pidfds_[r] = PeerPidfd(socks_[r]);
  }
  // Whole at once: the first long wait (maybe long after warm-up) allocates nothing.
  pfds_.reserve(2 * socks_.size() + 1);
  peers_.reserve(socks_.size());
}

Group::~Group() {
  for (int fd : socks_) {
    if (fd >= 0) ::close(fd);
  }
  for (int fd : pidfds_) {
    if (fd >= 0) ::close(fd);
  }
}

uint64_t Group::Load(int r, Counter c) const {
  const Header* h = maps_[static_cast<size_t>(r)].header();
  return (c == Counter::kStarted ? h->started : h->reduced).load(std::memory_order_acquire);
}

bool Group::Reached(Counter c, uint64_t round, int peer) const {
  if (peer >= 0) return Load(peer, c) >= round;
  for (int r = 0; r < size(); ++r) {
    if (r != rank_ && Load(r, c) < round) return false;
  }
  return true;
}

Status Group::Next(const char* what, uint64_t* round) {
  if (!broken_.ok()) return broken_;
  *round = ++round_;
  if (all_seen_ + 1 < *round) {
    Status s = Wait(Counter::kStarted, *round - 1, what);
    if (!s.ok()) return s;
  }
  return Status::OK();
}

void Group::Post(Counter c, uint64_t round) {
  CountMessage(TrafficSender::kShm, 0);  // a round posted; its bytes go through memory
  Header* me = maps_[static_cast<size_t>(rank_)].header();
  (c == Counter::kStarted ? me->started : me->reduced).store(round, std::memory_order_seq_cst);
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    Header* h = maps_[static_cast<size_t>(r)].header();
    if (h->sleeping.load(std::memory_order_seq_cst) != 0) {
      h->bell.fetch_add(1, std::memory_order_seq_cst);
      FutexWake(&h->bell);
    }
  }
}

Status Group::Wait(Counter c, uint64_t round, const char* what, int peer) {
  if (!broken_.ok()) return broken_;
  auto done = [&] {
    if (peer < 0 && c == Counter::kStarted) all_seen_ = std::max(all_seen_, round);
    return Status::OK();
  };
  if (Reached(c, round, peer)) return done();
  const auto start = Clock::now();
  if (SpinUntil([&] { return Reached(c, round, peer); }, kSpinUs)) return done();
  Header* me = maps_[static_cast<size_t>(rank_)].header();
  auto checked = start;
  while (true) {
    me->sleeping.store(1, std::memory_order_seq_cst);
    const uint32_t bell = me->bell.load(std::memory_order_seq_cst);
    if (Reached(c, round, peer)) {
      me->sleeping.store(0, std::memory_order_relaxed);
      return done();
    }
    const double left = timeout_s_ - Since(start);
    FutexWait(&me->bell, bell, std::max(1e-4, std::min(kLiveCheckS, left)));
    me->sleeping.store(0, std::memory_order_relaxed);
    if (Reached(c, round, peer)) return done();
    if (Since(checked) >= kLiveCheckS) {
      Status s = CheckPeers(what);
      if (!s.ok()) return s;
      checked = Clock::now();
    }
    if (Since(start) >= timeout_s_) {
      std::vector<int32_t> missing;
      for (int r = 0; r < size(); ++r) {
        if (r != rank_ && (peer < 0 || r == peer) && Load(r, c) < round) {
          missing.push_back(job_ranks_[static_cast<size_t>(r)]);
        }
      }
      std::ostringstream os;
      os << "shm " << what << " on rank " << job_ranks_[static_cast<size_t>(rank_)] << " waited "
         << timeout_s_ << " s (SPARK_HVD_TIMEOUT_S) for rank(s) " << JoinRanks(missing, ", ")
         << " to reach round " << round
         << ": they are alive (their connections are open) but silent";
      return Fail(Status(StatusCode::kTimeout, os.str(), missing));
    }
  }
}

Status Group::CheckPeers(const char* what) {
  std::vector<pollfd>& pfds = pfds_;  // each peer's socket (closed), then its pidfd (exited)
  std::vector<int>& peers = peers_;
  pfds.clear();
  peers.clear();
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    pfds.push_back(pollfd{socks_[static_cast<size_t>(r)], POLLRDHUP, 0});
    pfds.push_back(pollfd{pidfds_[static_cast<size_t>(r)], POLLIN, 0});  // -1: ignored
    peers.push_back(r);
  }
  // The heartbeats lost a peer (stopped, hung, gone): no need to wait out the timeout.
  if (liveness_ != nullptr) pfds.push_back(pollfd{liveness_->wake_fd(), POLLIN, 0});
  if (pfds.empty() || ::poll(pfds.data(), pfds.size(), 0) <= 0) return Status::OK();
  if (liveness_ != nullptr && pfds.back().revents != 0) {
    Status verdict = liveness_->Verdict(std::string("shm ") + what, {}, 0.0);
    if (!verdict.ok()) return Fail(verdict);
  }
  if (liveness_ != nullptr) pfds.pop_back();
  // A closed connection whose owner marked its segment failed is a bystander that
  // stopped on a failure of its own; the others died (or shut down) without a word.
  std::vector<int32_t> lost, stopped;
  std::string pids;
  for (size_t i = 0; i < peers.size(); ++i) {
    const bool closed = pfds[2 * i].revents & (POLLRDHUP | POLLHUP | POLLERR);
    if (!closed && pfds[2 * i + 1].revents == 0) continue;
    const Header* h = maps_[static_cast<size_t>(peers[i])].header();
    const int32_t job_rank = job_ranks_[static_cast<size_t>(peers[i])];
    if (h->failed.load(std::memory_order_acquire) != 0) {
      stopped.push_back(job_rank);
      continue;
    }
    lost.push_back(job_rank);
    pids += (pids.empty() ? "" : ", ") + std::to_string(h->pid);
  }
  if (lost.empty() && stopped.empty()) return Status::OK();  // nothing is sent after set-up
  std::string me = std::to_string(job_ranks_[static_cast<size_t>(rank_)]);
  if (lost.empty()) {  // pass on the first bystander's failure: its code and its culprits
    const Header* h = maps_[static_cast<size_t>(rank_of(stopped[0]))].header();
    std::vector<int32_t> blamed(h->blamed, h->blamed + std::min(h->blamed_count, 16));
    const auto code = static_cast<StatusCode>(h->failed_code);
    return Fail(Status(code,
                       std::string("shm ") + what + " on rank " + me + ": rank " +
                           std::to_string(stopped[0]) + " stopped after it " +
                           (code == StatusCode::kTimeout ? "timed out waiting for" : "lost") +
                           " rank(s) " + JoinRanks(blamed),
                       blamed));
  }
  return Fail(Status::PeerLost(
      std::string("shm ") + what + " on rank " + me + " lost rank" +
          (lost.size() > 1 ? "s " : " ") + JoinRanks(lost) + " (pid " + pids +
          "): it exited, or its connection closed, without a failure of its own (the process "
          "was killed, or ended)",
      lost));
}

Status Group::Fail(Status s) {
  if (broken_.ok()) {
    broken_ = s;
    Header* h = maps_[static_cast<size_t>(rank_)].header();
    h->failed_code = static_cast<int32_t>(s.code());
    h->blamed_count = static_cast<int32_t>(std::min<size_t>(s.ranks().size(), 16));
    std::copy_n(s.ranks().begin(), h->blamed_count, h->blamed);
    h->failed.store(1, std::memory_order_release);
  }
  return s;
}

int Group::rank_of(int32_t job_rank) const {
  return static_cast<int>(std::lower_bound(job_ranks_.begin(), job_ranks_.end(), job_rank) -
                          job_ranks_.begin());
}

}  // namespace shm
}  // namespace spark_hvd
