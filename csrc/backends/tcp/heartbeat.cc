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
#include "backends/tcp/mesh.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/traffic.h"

namespace spark_hvd {
namespace {

using tcp::Clock;
using tcp::SecondsSince;

constexpr char kBeat = 'H';
constexpr char kLostRecord = 'L';
constexpr char kBye = 'B';
constexpr size_t kLostRecordBytes = 1 + 4 + 1;
constexpr double kLeaveWaitS = 0.5;  // step 4: for the peers to close their side

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

}  // namespace

std::unique_ptr<PeerLiveness> StartHeartbeats(const BackendOptions& options) {
  const double timeout_s = env::HeartbeatTimeoutS();
  if (timeout_s <= 0 || options.size <= 1 || !options.store) return nullptr;
  auto store = std::make_shared<PrefixStore>(options.store_prefix + "/live", options.store);
  TcpMesh::LostPeers lost_peers;
  if (options.lost_ranks) {
    lost_peers = [&options] {
      std::vector<int32_t> r = options.lost_ranks();
      return std::vector<int>(r.begin(), r.end());
    };
  }
  std::vector<int> fds = TcpMesh::ConnectSockets(
      options.rank, options.size, store, options.bind_host, options.connect_timeout_s, lost_peers);
  return std::make_unique<Heartbeats>(options.rank, std::move(fds), timeout_s);
}

Heartbeats::Heartbeats(int32_t rank, std::vector<int> fds, double timeout_s)
    : rank_(rank), timeout_s_(timeout_s), interval_s_(timeout_s / 6), peers_(fds.size()) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0 || stop_fd_ < 0) {
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
    if (wake_fd_ >= 0) ::close(wake_fd_);
    if (stop_fd_ >= 0) ::close(stop_fd_);
    throw StatusError(Status::Internal("eventfd: " + tcp::Errno(errno)));
  }
  const auto now = Clock::now();
  for (size_t p = 0; p < fds.size(); ++p) {
    peers_[p].fd = fds[p];
    peers_[p].last_heard = now;
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
  ::close(wake_fd_);
  ::close(stop_fd_);
}

void Heartbeats::Run() {
  auto next_beat = Clock::now();
  std::vector<pollfd> pfds;
  std::vector<int32_t> who;
  while (true) {
    pfds.assign(1, pollfd{stop_fd_, POLLIN, 0});
    who.assign(1, -1);
    auto wake = next_beat;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int32_t p = 0; p < static_cast<int32_t>(peers_.size()); ++p) {
        const Peer& peer = peers_[p];
        if (peer.fd < 0) continue;
        pfds.push_back(pollfd{peer.fd, POLLIN, 0});
        who.push_back(p);
        if (peer.state == kAlive) {
          wake = std::min(wake, peer.last_heard + std::chrono::duration_cast<Clock::duration>(
                                                      std::chrono::duration<double>(timeout_s_)));
        }
      }
    }
    if (::poll(pfds.data(), pfds.size(), tcp::MillisUntil(wake)) < 0 && errno != EINTR) {
      SHVD_LOG(kError, "heartbeat") << "poll: " << tcp::Errno(errno) << "; heartbeats stop";
      return;
    }
    if (pfds[0].revents != 0) return;  // Leave
    for (size_t i = 1; i < pfds.size(); ++i) {
      if (pfds[i].revents != 0) Read(who[i]);
    }
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    if (now >= next_beat) {  // step 2
      for (int32_t p = 0; p < static_cast<int32_t>(peers_.size()); ++p) {
        Peer& peer = peers_[p];
        if (peer.fd < 0 || peer.state != kAlive) continue;
        ssize_t w = ::send(peer.fd, &kBeat, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w == 1) CountMessage(TrafficSender::kHeartbeat, TrafficKind::kLiveness, 1);
        if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          Lose(p, kGone);  // reset by the peer's kernel: its process is gone
        }
      }
      next_beat = now + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(interval_s_));
    }
    for (int32_t p = 0; p < static_cast<int32_t>(peers_.size()); ++p) {  // step 3
      Peer& peer = peers_[p];
      if (peer.fd >= 0 && peer.state == kAlive && SecondsSince(peer.last_heard) > timeout_s_) {
        Lose(p, kFrozen);
      }
    }
  }
}

void Heartbeats::Read(int32_t p) {
  char buf[256];
  std::lock_guard<std::mutex> lock(mu_);
  Peer& peer = peers_[p];
  while (peer.fd >= 0) {
    ssize_t r = ::recv(peer.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r > 0) {
      if (peer.state == kAlive) peer.last_heard = Clock::now();
      peer.inbox.append(buf, static_cast<size_t>(r));
      Parse(p);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    // The connection ended: a goodbye came first (left), or the process is gone.
    if (peer.state == kAlive) Lose(p, kGone);
    Close(p);
  }
}

void Heartbeats::Parse(int32_t p) {
  Peer& peer = peers_[p];
  size_t i = 0;
  while (i < peer.inbox.size()) {
    const char tag = peer.inbox[i];
    if (tag == kBeat) {
      ++i;
    } else if (tag == kLostRecord) {
      if (peer.inbox.size() - i < kLostRecordBytes) break;
      int32_t rank;
      std::memcpy(&rank, peer.inbox.data() + i + 1, sizeof(rank));
      const How how = static_cast<How>(peer.inbox[i + 5]);
      if (rank >= 0 && rank < static_cast<int32_t>(peers_.size())) {
        peer.reported.emplace_back(rank, how);
      }
      i += kLostRecordBytes;
    } else if (tag == kBye) {
      if (peer.state == kAlive) {
        peer.state = kLeft;
        // What it lost is lost for this rank too: stop any wait on it.
        if (!peer.reported.empty() && !woken_) {
          woken_ = true;
          Signal(wake_fd_);
        }
        changed_.notify_all();
      }
      Close(p);  // the leaver waits for this (step 4)
      return;
    } else {
      SHVD_LOG(kWarning, "heartbeat") << "rank " << p << " sent byte " << static_cast<int>(tag)
                                      << ", not a heartbeat record; its heartbeats are ignored";
      Close(p);
      return;
    }
  }
  peer.inbox.erase(0, i);
}

void Heartbeats::Lose(int32_t p, How how) {
  Peer& peer = peers_[p];
  if (peer.state != kAlive) return;
  peer.state = kLost;
  peer.how = how;
  SHVD_LOG(kInfo, "heartbeat") << "rank " << rank_ << " lost rank " << p << ": " << Why(how, -1);
  if (!woken_) {
    woken_ = true;
    Signal(wake_fd_);
  }
  changed_.notify_all();
}

void Heartbeats::Close(int32_t p) {
  Peer& peer = peers_[p];
  if (peer.fd >= 0) ::close(peer.fd);
  peer.fd = -1;
}

std::string Heartbeats::Why(How how, int32_t reporter) const {
  std::string text;
  if (how == kFrozen) {
    text = "it answered no heartbeat for " + Seconds(timeout_s_) +
           " s: stopped by a signal, hung, or its host unreachable "
           "(SPARK_HVD_HEARTBEAT_TIMEOUT_S sets the limit)";
  } else if (how == kGone) {
    text = "its connection closed without a goodbye: the process exited or was killed";
  } else {
    text = "its engine stopped on losing it";
  }
  if (reporter >= 0) text = "rank " + std::to_string(reporter) + " reported, leaving: " + text;
  return text;
}

Status Heartbeats::Verdict(const std::string& what, const std::vector<int32_t>& closed,
                           double wait_s) {
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait_for(lock, std::chrono::duration<double>(wait_s), [&] {
    return std::all_of(closed.begin(), closed.end(), [&](int32_t r) {
      return r < 0 || r >= static_cast<int32_t>(peers_.size()) || peers_[r].state != kAlive;
    });
  });
  // The lost ranks, each with the first explanation: this rank's own, else a leaver's.
  std::vector<std::pair<int32_t, std::string>> lost;
  auto add = [&](int32_t r, How how, int32_t reporter) {
    for (const auto& l : lost) {
      if (l.first == r) return;
    }
    lost.emplace_back(r, Why(how, reporter));
  };
  for (int32_t p = 0; p < static_cast<int32_t>(peers_.size()); ++p) {
    if (p != rank_ && peers_[p].state == kLost) add(p, peers_[p].how, -1);
  }
  for (int32_t p = 0; p < static_cast<int32_t>(peers_.size()); ++p) {
    if (peers_[p].state != kLeft) continue;
    for (const auto& rep : peers_[p].reported) add(rep.first, rep.second, p);
  }
  const std::string here = what + " on rank " + std::to_string(rank_);
  if (!lost.empty()) {
    std::sort(lost.begin(), lost.end());
    std::vector<int32_t> ranks;
    std::string why;
    for (const auto& l : lost) {
      ranks.push_back(l.first);
      why += (why.empty() ? "" : "; ") + ("rank " + std::to_string(l.first) + ": ") + l.second;
    }
    if (ranks.size() == 1) {
      return Status::PeerLost(
          here + " lost rank " + std::to_string(ranks[0]) + ": " + lost[0].second, ranks);
    }
    return Status::PeerLost(here + " lost ranks " + JoinRanks(ranks) + " (" + why + ")", ranks);
  }
  std::vector<int32_t> left;
  for (int32_t r : closed) {
    if (r >= 0 && r < static_cast<int32_t>(peers_.size()) && peers_[r].state == kLeft) {
      left.push_back(r);
    }
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
  // Step 4: the records, then the goodbye, to every peer still connected.
  std::string bye;
  auto record = [&](int32_t r, How how) {
    bye.push_back(kLostRecord);
    bye.append(reinterpret_cast<const char*>(&r), sizeof(r));
    bye.push_back(static_cast<char>(how));
  };
  for (int32_t p = 0; p < static_cast<int32_t>(peers_.size()); ++p) {
    if (peers_[p].state == kLost) record(p, peers_[p].how);
  }
  for (int32_t r : lost) {
    if (r >= 0 && r < static_cast<int32_t>(peers_.size()) && r != rank_ &&
        peers_[r].state != kLost) {
      record(r, kStoppedOn);
    }
  }
  bye.push_back(kBye);
  std::vector<pollfd> pfds;
  for (Peer& peer : peers_) {
    if (peer.fd < 0) continue;
    if (::send(peer.fd, bye.data(), bye.size(), MSG_DONTWAIT | MSG_NOSIGNAL) ==
        static_cast<ssize_t>(bye.size())) {
      ::shutdown(peer.fd, SHUT_WR);
      pfds.push_back(pollfd{peer.fd, POLLIN, 0});
    }
  }
  // Closing with unread bytes would reset the connection, and a reset may drop the
  // goodbye before the peer reads it: read until each peer closed its side.
  const auto deadline = tcp::After(kLeaveWaitS);
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
  for (int32_t p = 0; p < static_cast<int32_t>(peers_.size()); ++p) Close(p);
}

}  // namespace spark_hvd
