// Socket helpers of the TCP mesh: listening, connecting, socket options, and an
// owner for a file descriptor. Internal to csrc/backends/tcp/.
//
// Blocking behaviour: none of these block (sockets are created non-blocking).
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <string>

namespace spark_hvd {
namespace net {

using Clock = std::chrono::steady_clock;

std::string Errno(int err);
double SecondsSince(Clock::time_point t);
Clock::time_point After(double seconds);  // now + seconds
int MillisUntil(Clock::time_point t);     // a poll timeout reaching t (0 once past)
// `n` random hex characters (std::random_device): tokens and names others cannot guess.
std::string RandomHex(size_t n);

void SetNoDelay(int fd);
// "1.2.3.4:5678" or "[::1]:5678".
std::string AddressString(const sockaddr* addr);

// Closes the descriptor it owns unless released.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser();
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// A non-blocking listening socket on host, any port; returns its fd and sets
// *port. Throws StatusError(kInvalidArgument) when host cannot be resolved or bound.
int Listen(const std::string& host, int backlog, int* port);

// Starts a non-blocking connection to host:port and returns its fd (connected or
// in progress: poll it for POLLOUT, then ConnectError), or -1 with *error set
// (*out_of_descriptors too when no socket could be made for lack of descriptors).
int StartConnect(const std::string& host, int port, std::string* error,
                 bool* out_of_descriptors = nullptr);
// What to say when a process runs out of file descriptors: its limits (getrlimit), what
// the job needs per rank (`needed`; <= 0: not said) and how to raise them.
std::string DescriptorLimitAdvice(int needed);
// 0 once a started connection is established, else why it failed (an errno).
int ConnectError(int fd);

}  // namespace net
}  // namespace spark_hvd
