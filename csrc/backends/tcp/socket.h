// Socket helpers of the TCP mesh: listening, connecting, socket options, and an
// owner for a file descriptor. Internal to csrc/backends/tcp/.
//
// Blocking behaviour: Listen never blocks; ConnectTo blocks until a connection is
// made or the deadline passes (retrying every 20 ms while the peer does not listen
// yet); WriteAll / ReadAll block on a blocking socket up to its SetIoTimeout.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace spark_hvd {
namespace tcp {

using Clock = std::chrono::steady_clock;

std::string Errno(int err);
double SecondsSince(Clock::time_point t);

void SetNoDelay(int fd);
void SetNonBlocking(int fd, bool on);
// Receive and send timeouts of a blocking socket (0: none).
void SetIoTimeout(int fd, double seconds);
// Whole buffers on a blocking socket; false on error, timeout or a closed peer.
bool WriteAll(int fd, const void* p, size_t n);
bool ReadAll(int fd, void* p, size_t n);

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

// A listening socket on host, any port; returns its fd and sets *port. Throws
// StatusError(kInvalidArgument) when host cannot be resolved or bound.
int Listen(const std::string& host, int backlog, int* port);

// Connects to host:port, retrying until the deadline (the peer may not listen
// yet); throws StatusError(kTimeout) naming `peer` then.
int ConnectTo(const std::string& host, int port, Clock::time_point deadline, int peer);

}  // namespace tcp
}  // namespace spark_hvd
