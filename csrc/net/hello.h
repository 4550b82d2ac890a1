// The hello of a connection set-up (see links.cc) and the accepting
// side's desk: every connection a rank's listener accepts, read concurrently until
// its hello is complete, then acknowledged (a higher rank of this mesh presenting
// this listener's token) or dropped with a warning that says why. Internal to
// csrc/backends/tcp/.
//
// Blocking behaviour: none; the caller polls what AddPolls lists, then Handle moves
// whatever is ready.
#pragma once

#include <poll.h>

#include <cstdint>
#include <string>
#include <vector>

#include "net/socket.h"

namespace spark_hvd {
namespace net {

constexpr uint32_t kHelloMagic = 0x73687664;  // "shvd"
constexpr size_t kTokenBytes = 32;            // hex characters

// What a connecting rank sends first; answered with the listener's rank (uint32).
struct Hello {
  uint32_t magic;
  uint32_t rank;            // the connecting rank
  char token[kTokenBytes];  // the listener's, as published in the store
};
static_assert(sizeof(Hello) == 8 + kTokenBytes, "the hello has no padding");

Hello MakeHello(int rank, const std::string& token);

class HelloDesk {
 public:
  // Accepts higher ranks, each once (a mesh's rule), or with `any_rank` every rank but
  // this one, again after Take (the heartbeats' neighbours, which change).
  HelloDesk(int rank, int size, std::string token, double hello_timeout_s, bool any_rank = false);
  ~HelloDesk();  // closes every connection not taken
  HelloDesk(const HelloDesk&) = delete;
  HelloDesk& operator=(const HelloDesk&) = delete;

  // Appends the listener (unless accepting is paused) and every connection whose
  // hello is incomplete to pfds; lowers *wake to the next deadline.
  void AddPolls(int listener, std::vector<pollfd>* pfds, Clock::time_point* wake);
  // After poll: pfds[first...] are what AddPolls appended. Reads hellos, drops the
  // invalid and the expired, acknowledges the valid, accepts new connections.
  void Handle(int listener, const std::vector<pollfd>& pfds, size_t first);

  // Higher ranks not connected yet.
  std::vector<int> Missing() const;
  // The ranks whose connection is acknowledged and not taken yet.
  std::vector<int> Ready() const;
  // Has higher rank `peer`'s connection been acknowledged (and not taken yet)?
  bool Has(int peer) const { return fds_[static_cast<size_t>(peer)] >= 0; }
  // The acknowledged connection of higher rank `peer` (the caller owns it now). A later
  // hello from a peer taken is refused.
  int Take(int peer);
  // Did accept() fail for lack of file descriptors (EMFILE, ENFILE)?
  bool out_of_descriptors() const { return out_of_descriptors_; }

 private:
  struct HalfOpen {
    int fd;
    std::string from;  // the peer's address
    Clock::time_point deadline;
    Hello hello;
    size_t got;
  };
  void Accept(int listener);
  void Read(HalfOpen& c);
  void Check(HalfOpen& c);
  void Drop(HalfOpen& c, const std::string& why);

  int rank_;
  int size_;
  std::string token_;
  double hello_timeout_s_;
  std::vector<HalfOpen> half_open_;
  std::vector<int> fds_;     // acknowledged connections by rank; -1 where none
  std::vector<bool> taken_;  // by rank: connected, and handed to the caller
  bool out_of_descriptors_ = false;
  bool any_rank_ = false;
  std::vector<int> ready_;  // ranks acknowledged and not taken
  bool listener_polled_ = false;
  Clock::time_point paused_until_{};
};

}  // namespace net
}  // namespace spark_hvd
