#include "net/socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "common/status.h"

namespace spark_hvd {
namespace net {

std::string Errno(int err) { return std::string(std::strerror(err)); }

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

Clock::time_point After(double seconds) {
  return Clock::now() + std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
}

int MillisUntil(Clock::time_point t) {
  const double ms = std::chrono::duration<double, std::milli>(t - Clock::now()).count();
  return ms <= 0 ? 0 : static_cast<int>(ms) + 1;
}

std::string RandomHex(size_t n) {
  std::random_device rd;
  static const char* hex = "0123456789abcdef";
  std::string t(n, '0');
  for (auto& c : t) c = hex[rd() & 15];
  return t;
}

void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::string AddressString(const sockaddr* addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr->sa_family == AF_UNIX) return "a local process (Unix socket)";
  if (addr->sa_family == AF_INET6) {
    const auto* a6 = reinterpret_cast<const sockaddr_in6*>(addr);
    inet_ntop(AF_INET6, &a6->sin6_addr, host, sizeof(host));
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(a6->sin6_port));
  }
  if (addr->sa_family == AF_INET) {
    const auto* a4 = reinterpret_cast<const sockaddr_in*>(addr);
    inet_ntop(AF_INET, &a4->sin_addr, host, sizeof(host));
    port = ntohs(a4->sin_port);
  }
  return std::string(host) + ":" + std::to_string(port);
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
    FdCloser fd(
        ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (fd.get() < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        freeaddrinfo(res);
        Throw(Status::Internal("ran out of file descriptors listening on '" + host +
                               "': " + DescriptorLimitAdvice(0)));
      }
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

std::string DescriptorLimitAdvice(int needed) {
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  std::string s = "this process may open " + std::to_string(lim.rlim_cur) +
                  " files (ulimit -n; hard limit " + std::to_string(lim.rlim_max) + ")";
  if (needed > 0) {
    s += " and the job needs about " + std::to_string(needed) +
         " per rank for its connections, besides what the process opens itself";
  }
  return s +
         ": raise the soft limit (ulimit -n 65536 in the shell that starts the ranks, "
         "LimitNOFILE= for a systemd service, or the cluster manager's limit for executors)";
}

int StartConnect(const std::string& host, int port, std::string* error, bool* out_of_descriptors) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port_s = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), port_s.c_str(), &hints, &res);
  if (rc != 0) {
    *error = gai_strerror(rc);
    return -1;
  }
  *error = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    FdCloser fd(
        ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (fd.get() < 0) {
      if ((errno == EMFILE || errno == ENFILE) && out_of_descriptors != nullptr) {
        *out_of_descriptors = true;
      }
      *error = Errno(errno);
      continue;
    }
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0 || errno == EINPROGRESS) {
      freeaddrinfo(res);
      return fd.release();
    }
    *error = Errno(errno);
  }
  freeaddrinfo(res);
  return -1;
}

int ConnectError(int fd) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
  return err;
}

}  // namespace net
}  // namespace spark_hvd
