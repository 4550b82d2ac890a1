#include "backends/tcp/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "common/status.h"

namespace spark_hvd {
namespace tcp {

std::string Errno(int err) { return std::string(std::strerror(err)); }

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void SetNonBlocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void SetIoTimeout(int fd, double seconds) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>((seconds - static_cast<double>(tv.tv_sec)) * 1e6);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

FdCloser::~FdCloser() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {
[[noreturn]] void Throw(Status s) { throw StatusError(std::move(s)); }
}  // namespace

int Listen(const std::string& host, int backlog, int* port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), "0", &hints, &res);
  if (rc != 0) {
    Throw(Status::InvalidArgument("cannot resolve this rank's address '" + host +
                                  "': " + gai_strerror(rc)));
  }
  std::string last;
  for (addrinfo* a = res; a; a = a->ai_next) {
    FdCloser fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0) {
      last = Errno(errno);
      continue;
    }
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), backlog) != 0) {
      last = Errno(errno);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    *port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    freeaddrinfo(res);
    return fd.release();
  }
  freeaddrinfo(res);
  Throw(Status::InvalidArgument("cannot listen on this rank's address '" + host + "': " + last));
}

int ConnectTo(const std::string& host, int port, Clock::time_point deadline, int peer) {
  std::string last = "no address";
  do {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* res = nullptr;
    const std::string port_s = std::to_string(port);
    int rc = getaddrinfo(host.c_str(), port_s.c_str(), &hints, &res);
    if (rc == 0) {
      for (addrinfo* a = res; a; a = a->ai_next) {
        FdCloser fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
        if (fd.get() < 0) continue;
        if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0) {
          freeaddrinfo(res);
          return fd.release();
        }
        last = Errno(errno);
      }
      freeaddrinfo(res);
    } else {
      last = gai_strerror(rc);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (Clock::now() < deadline);
  Throw(Status::Timeout("could not connect to rank " + std::to_string(peer) + " at " + host +
                        ":" + std::to_string(port) + ": " + last));
}

}  // namespace tcp
}  // namespace spark_hvd
