// TcpMesh socket I/O: one non-blocking send or receive (Move), waiting for the
// wire (Wait), whole buffers with several peers at once (Exchange), and the errors
// they report (after which the mesh is broken).
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <sstream>

#include "backends/tcp/mesh.h"
#include "common/logging.h"
#include "common/traffic.h"
#include "net/socket.h"

namespace spark_hvd {

using net::Clock;
using net::Errno;
using net::SecondsSince;

namespace {
// How long a closed connection waits for the heartbeats' verdict on its peer: its
// goodbye, or its heartbeat connection closing too, follows within milliseconds.
constexpr double kVerdictWaitS = 1.0;
}  // namespace

Status TcpMesh::Fail(Status s) {
  if (broken_.ok()) broken_ = s;
  return s;
}

std::vector<int32_t> TcpMesh::JobRanks(const std::vector<int>& peers) const {
  std::vector<int32_t> ranks;
  for (int p : peers) ranks.push_back(members_[static_cast<size_t>(p)]);
  return ranks;
}

Status TcpMesh::PeerError(int peer, const char* what, int err) {
  if (err == ECONNRESET || err == EPIPE) return PeerClosed(peer, what);
  return Fail(Status::PeerLost(std::string(what) + " on rank " + std::to_string(members_[rank_]) +
                                   " lost rank " + std::to_string(members_[peer]) + ": " +
                                   Errno(err),
                               {members_[peer]}));
}

Status TcpMesh::PeerClosed(int peer, const char* what) {
  // A rank that lost a peer stops and closes its connections too, so the first
  // closed connection seen here may be a bystander's: every peer whose connection
  // is closed by now is a suspect (a killed process's are closed by its kernel).
  std::vector<pollfd> pfds;
  std::vector<int> peers;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || p == peer) continue;
    pfds.push_back(pollfd{fds_[p], POLLRDHUP, 0});
    peers.push_back(p);
  }
  std::vector<int> closed{peer};
  if (!pfds.empty() && ::poll(pfds.data(), pfds.size(), 0) > 0) {
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) closed.push_back(peers[i]);
    }
  }
  std::sort(closed.begin(), closed.end());
  const std::vector<int32_t> suspects = JobRanks(closed);
  // The heartbeats tell which suspects died (or were lost) and which only left.
  if (liveness_ != nullptr) {
    Status verdict = liveness_->Verdict(what, suspects, kVerdictWaitS);
    if (!verdict.ok()) return Fail(verdict);
  }
  // Without them the suspects are evidence, not a verdict: explain_failure (Python)
  // asks the rendezvous service which ranks are lost and names those.
  return Fail(Status::PeerLost(
      std::string(what) + " on rank " + std::to_string(members_[rank_]) + ": the connection" +
      (suspects.size() > 1 ? "s of ranks " : " of rank ") + JoinRanks(suspects) +
      " closed (a process exited or was killed, or stopped after "
      "losing another rank)"));
}

Status TcpMesh::Timeout(const std::vector<int>& peers, const char* what) {
  const std::vector<int32_t> silent = JobRanks(peers);
  std::ostringstream os;
  os << what << " on rank " << members_[rank_] << " heard nothing from rank"
     << (silent.size() > 1 ? "s " : " ") << JoinRanks(silent, ", ") << " for " << timeout_s_
     << " s (SPARK_HVD_TIMEOUT_S)";
  return Fail(Status(StatusCode::kTimeout, os.str(), silent));
}

ssize_t TcpMesh::Move(int peer, bool send, iovec* iov, int iovcnt, const char* what,
                      Status* error) {
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = static_cast<size_t>(iovcnt);
  while (true) {
    ssize_t r = send ? ::sendmsg(fds_[peer], &msg, MSG_NOSIGNAL | MSG_DONTWAIT)
                     : ::recvmsg(fds_[peer], &msg, MSG_DONTWAIT);
    if (r > 0) return r;
    if (r == 0 && !send) {
      *error = PeerClosed(peer, what);
      return -1;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    *error = PeerError(peer, what, r < 0 ? errno : EPIPE);
    return -1;
  }
}

ssize_t TcpMesh::Move(int peer, bool send, char* data, size_t len, const char* what,
                      Status* error) {
  iovec iov{data, std::min(len, kMaxIo)};
  return Move(peer, send, &iov, 1, what, error);
}

Status TcpMesh::Wait(const std::vector<std::pair<int, short>>& waits,
                     Clock::time_point last_progress, const char* what) {
  std::vector<pollfd>& pfds = pfds_;
  std::vector<int>& peers = poll_peers_;
  pfds.clear();
  peers.clear();
  for (const auto& w : waits) {
    auto it = std::find(peers.begin(), peers.end(), w.first);
    if (it != peers.end()) {
      pfds[static_cast<size_t>(it - peers.begin())].events |= w.second;
      continue;
    }
    pfds.push_back(pollfd{fds_[w.first], w.second, 0});
    peers.push_back(w.first);
  }
  SHVD_CHECK(!pfds.empty());
  const double left = timeout_s_ - SecondsSince(last_progress);
  if (left <= 0) return Timeout(peers, what);
  // The heartbeats' descriptor last: readable once they lost a peer (one more
  // descriptor per poll is all liveness costs here).
  if (liveness_ != nullptr) pfds.push_back(pollfd{liveness_->wake_fd(), POLLIN, 0});
  int rc = ::poll(pfds.data(), pfds.size(), static_cast<int>(left * 1000) + 1);
  if (rc < 0 && errno != EINTR) return Fail(Status::Internal(std::string("poll: ") + Errno(errno)));
  if (liveness_ != nullptr && rc > 0 && pfds.back().revents != 0) {
    Status verdict = liveness_->Verdict(what, {}, 0.0);
    if (!verdict.ok()) return Fail(verdict);
  }
  return Status::OK();
}

Status TcpMesh::Exchange(std::vector<Transfer>& xs, const char* what) {
  Status connected = EnsureConnected(xs);
  if (!connected.ok()) return connected;
  for (const auto& x : xs) {
    if (x.send && x.left + x.left2 > 0) {
      CountMessage(TrafficSender::kTcp, static_cast<int64_t>(x.left + x.left2));
    }
  }
  auto last_progress = Clock::now();
  std::vector<std::pair<int, short>>& waits = waits_;
  Status error;
  while (true) {
    bool progress = false;
    waits.clear();
    for (auto& x : xs) {
      while (x.left + x.left2 > 0) {
        if (x.left == 0) {  // the second piece, once the first has gone
          x.data = x.data2;
          x.left = x.left2;
          x.left2 = 0;
        }
        iovec iov[2] = {{x.data, std::min(x.left, kMaxIo)}, {x.data2, x.left2}};
        const int pieces = x.left2 > 0 && x.left <= kMaxIo ? 2 : 1;
        ssize_t r = Move(x.peer, x.send, iov, pieces, what, &error);
        if (r < 0) return error;
        if (r == 0) break;
        size_t moved = static_cast<size_t>(r);
        const size_t first = std::min(moved, x.left);
        x.data += first;
        x.left -= first;
        moved -= first;
        x.data2 += moved;
        x.left2 -= moved;
        progress = true;
      }
      if (x.left + x.left2 > 0) waits.emplace_back(x.peer, x.send ? POLLOUT : POLLIN);
    }
    if (waits.empty()) return Status::OK();
    if (progress) last_progress = Clock::now();
    Status s = Wait(waits, last_progress, what);
    if (!s.ok()) return s;
  }
}

}  // namespace spark_hvd
