// PeerLinks: one rank's connections to the other ranks of a group (a tcp mesh), made
// through the rendezvous store and the authenticated hello (hello.h): at set-up for the
// peers named, later on demand for others. The protocol is links.cc's numbered comment.
//
// Blocking behaviour: Connect blocks until the peers named are connected (or throws:
// kTimeout at connect_timeout_s, kPeerLost, kStoreError, kInvalidArgument when out of
// file descriptors); nothing else blocks.
#pragma once

#include <poll.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "net/hello.h"
#include "net/socket.h"
#include "rendezvous/store.h"

namespace spark_hvd {

class PeerLinks {
 public:
  using LostPeers = std::function<std::vector<int>()>;

  // rank of size (the group's numbering), publishing under "<key_prefix><rank>" in
  // `store`; lost_peers (may be empty) names the group's ranks the rendezvous service has
  // lost; descriptors_per_rank is what an error for running out of them says the job needs.
  PeerLinks(int rank, int size, std::shared_ptr<Store> store, double connect_timeout_s,
            LostPeers lost_peers, int descriptors_per_rank, std::string key_prefix = "tcp/");

  ~PeerLinks();

  // Step 1.
  void Listen(const std::string& bind_host);

  // Steps 2 to 5 for `peers`: on return each has its socket in (*fds)[peer].
  void Connect(const std::vector<int>& peers, std::vector<int>* fds);

 private:
  struct Lower {
    bool wanted = false;
    std::string host;
    int port = 0;
    std::string token;
    int fd = -1;
    bool connected = false;
    net::Clock::time_point retry_at{};
    net::Hello hello{};
    size_t sent = 0;
    uint32_t ack = 0;
    size_t got = 0;
    bool acked = false;
    std::string last_error = "not tried yet";
  };

  bool Done() const;

  // Step 3, one request: the addresses of `keys` ("<key_prefix><p>").
  void ReadAddresses(const std::vector<std::string>& keys);

  // Step 5: throws kPeerLost when the rendezvous service has lost a peer.
  void CheckLost(bool now);

  [[noreturn]] void OutOfDescriptors(const char* doing);

  // One round of step 4: poll everything pending, then move what is ready.
  void Step();

  void Start(int p);

  void Retry(int p, int err);

  // Moves the connection to lower peer p on: connected, hello sent, ack read.
  void Advance(int p);

  [[noreturn]] void ThrowTimeout();

  int rank_;
  int size_;
  std::shared_ptr<Store> store_;
  double timeout_s_;
  LostPeers lost_peers_;
  int listener_;
  std::unique_ptr<net::FdCloser> closer_;  // the listener's
  int descriptors_per_rank_;
  std::string key_prefix_;
  std::string token_;
  std::string unpublished_;  // this rank's address until the first Connect publishes it
  std::unique_ptr<net::HelloDesk> desk_;
  net::Clock::time_point deadline_{};
  net::Clock::time_point next_lost_check_{};
  std::map<int, Lower> lower_;  // lower peers: addresses read, connections in progress
  std::vector<int> higher_;     // higher peers this round waits for
  std::vector<pollfd> pfds_;
  std::vector<int> owner_;  // lower peer of each of the first pfds_
};

}  // namespace spark_hvd
