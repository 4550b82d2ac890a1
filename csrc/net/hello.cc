#include "net/hello.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "common/logging.h"
#include "common/traffic.h"

namespace spark_hvd {
namespace net {
namespace {

// After an accept failure (out of descriptors or memory), accepting pauses this
// long: half-open connections time out meanwhile and free theirs.
constexpr double kAcceptPauseS = 0.1;

std::string Hex(const void* p, size_t n) {
  std::string s = "0x";
  char b[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof(b), "%02x", static_cast<const unsigned char*>(p)[i]);
    s += b;
  }
  return s;
}

}  // namespace

Hello MakeHello(int rank, const std::string& token) {
  Hello h{kHelloMagic, static_cast<uint32_t>(rank), {}};
  std::memcpy(h.token, token.data(), std::min(token.size(), kTokenBytes));
  return h;
}

HelloDesk::HelloDesk(int rank, int size, std::string token, double hello_timeout_s, bool any_rank)
    : rank_(rank),
      size_(size),
      token_(std::move(token)),
      hello_timeout_s_(hello_timeout_s),
      fds_(static_cast<size_t>(size), -1),
      taken_(static_cast<size_t>(size), false),
      any_rank_(any_rank) {}

HelloDesk::~HelloDesk() {
  for (const auto& c : half_open_) ::close(c.fd);
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

void HelloDesk::AddPolls(int listener, std::vector<pollfd>* pfds, Clock::time_point* wake) {
  listener_polled_ = Clock::now() >= paused_until_;
  if (listener_polled_) {
    pfds->push_back(pollfd{listener, POLLIN, 0});
  } else {
    *wake = std::min(*wake, paused_until_);
  }
  for (const auto& c : half_open_) {
    pfds->push_back(pollfd{c.fd, POLLIN, 0});
    *wake = std::min(*wake, c.deadline);
  }
}

void HelloDesk::Handle(int listener, const std::vector<pollfd>& pfds, size_t first) {
  size_t i = first;
  const bool accept = listener_polled_ && pfds[i++].revents != 0;
  const auto now = Clock::now();
  for (auto& c : half_open_) {
    if (pfds[i++].revents != 0) Read(c);
    if (c.fd < 0 || now < c.deadline) continue;
    std::ostringstream os;
    os << "sent no complete hello in " << hello_timeout_s_ << " s (" << c.got << " of "
       << sizeof(Hello) << " bytes)";
    Drop(c, os.str());
  }
  half_open_.erase(std::remove_if(half_open_.begin(), half_open_.end(),
                                  [](const HalfOpen& c) { return c.fd < 0; }),
                   half_open_.end());
  if (accept) Accept(listener);
}

void HelloDesk::Accept(int listener) {
  while (true) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd =
        ::accept4(listener, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      half_open_.push_back(HalfOpen{fd, AddressString(reinterpret_cast<sockaddr*>(&ss)),
                                    After(hello_timeout_s_), Hello{}, 0});
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return;
    if (errno == EMFILE || errno == ENFILE) out_of_descriptors_ = true;
    SHVD_LOG(kWarning, "tcp") << "rank " << rank_ << " cannot accept connections: " << Errno(errno)
                              << " (" << half_open_.size()
                              << " connections without a complete hello); retrying in "
                              << kAcceptPauseS << " s";
    paused_until_ = After(kAcceptPauseS);
    return;
  }
}

void HelloDesk::Read(HalfOpen& c) {
  char* h = reinterpret_cast<char*>(&c.hello);
  ssize_t r = ::recv(c.fd, h + c.got, sizeof(Hello) - c.got, 0);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (r <= 0) {
    const std::string how = r == 0 ? "closed the connection" : "failed (" + Errno(errno) + ")";
    return Drop(c, how + " after " + std::to_string(c.got) + " of " +
                       std::to_string(sizeof(Hello)) + " hello bytes");
  }
  c.got += static_cast<size_t>(r);
  if (c.got >= sizeof(c.hello.magic) && c.hello.magic != kHelloMagic) {
    return Drop(c, "is not a spark_hvd mesh hello (it starts with " +
                       Hex(&c.hello.magic, sizeof(c.hello.magic)) + ")");
  }
  if (c.got == sizeof(Hello)) Check(c);
}

// A complete hello: keep and acknowledge the connection, or drop it.
void HelloDesk::Check(HalfOpen& c) {
  const uint32_t peer = c.hello.rank;
  if (std::memcmp(c.hello.token, token_.data(), kTokenBytes) != 0) {
    return Drop(c, "(claiming rank " + std::to_string(peer) +
                       ") presented a wrong token: a rank of another job or of an earlier "
                       "init, or a stray client");
  }
  const bool rank_ok =
      any_rank_ ? peer != static_cast<uint32_t>(rank_) : peer > static_cast<uint32_t>(rank_);
  if (!rank_ok || peer >= static_cast<uint32_t>(size_)) {
    return Drop(c, "sent a hello from rank " + std::to_string(peer) +
                       ", which is not expected (rank " + std::to_string(rank_) + " of " +
                       std::to_string(size_) + " accepts ranks " + std::to_string(rank_ + 1) +
                       ".." + std::to_string(size_ - 1) + ")");
  }
  if (fds_[peer] >= 0 || (taken_[peer] && !any_rank_)) {
    return Drop(c,
                "sent a hello from rank " + std::to_string(peer) + ", which is already connected");
  }
  const uint32_t me = static_cast<uint32_t>(rank_);
  if (::send(c.fd, &me, sizeof(me), MSG_NOSIGNAL | MSG_DONTWAIT) != sizeof(me)) {
    return Drop(c,
                "(rank " + std::to_string(peer) + ") could not be acknowledged: " + Errno(errno));
  }
  fds_[peer] = c.fd;
  ready_.push_back(static_cast<int>(peer));
  c.fd = -1;
  Connections().accepted.fetch_add(1, std::memory_order_relaxed);
}

void HelloDesk::Drop(HalfOpen& c, const std::string& why) {
  SHVD_LOG(kWarning, "tcp") << "rank " << rank_ << ": connection from " << c.from << " " << why
                            << "; dropped";
  Connections().dropped.fetch_add(1, std::memory_order_relaxed);
  ::close(c.fd);
  c.fd = -1;
}

std::vector<int> HelloDesk::Missing() const {
  std::vector<int> missing;
  for (int p = rank_ + 1; p < size_; ++p) {
    if (fds_[p] < 0) missing.push_back(p);
  }
  return missing;
}

std::vector<int> HelloDesk::Ready() const { return ready_; }

int HelloDesk::Take(int peer) {
  const int fd = fds_[peer];
  fds_[peer] = -1;
  taken_[peer] = fd >= 0;
  ready_.erase(std::remove(ready_.begin(), ready_.end(), peer), ready_.end());
  return fd;
}

}  // namespace net
}  // namespace spark_hvd
