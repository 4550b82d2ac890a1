// Heartbeats: the job's PeerLiveness (backends/liveness.h) on TCP connections of
// their own, one per pair of ranks, kept by a thread of their own (shvd_heartbeat)
// that takes no lock the engine or Python holds. The protocol:
//  1. Set-up (StartHeartbeats, collective over the job): the same steps as the tcp
//     mesh's (mesh_connect.cc: listen, publish under "<prefix>/live", connect with the
//     listener's token), giving one socket per peer.
//  2. Every interval (SPARK_HVD_HEARTBEAT_TIMEOUT_S / 6) the thread writes a beat,
//     one byte 'H', to every peer it still hears, and reads whatever its peers wrote.
//     Any byte from a peer is news that its process runs.
//  3. A peer is lost when its connection ends without a goodbye (its process exited
//     or was killed: its kernel closes its sockets), or when nothing came from it for
//     the timeout (stopped by a signal, hung kernel or host, a partition). A lost peer
//     stays lost; the thread then makes wake_fd() readable, which stops any wait
//     polling it (the tcp mesh's), and Verdict() names it.
//  4. Leaving (Leave, when the engine stops, before its communicators close): the
//     thread stops; each peer gets one record 'L' <rank: int32> <how: uint8> per
//     rank this engine lost, then 'B' (goodbye); the socket is shut for writing and
//     closed once the peer closed its side (or after kLeaveWaitS). A peer that reads
//     'B' counts this rank as left, not lost, and remembers the 'L' ranks as lost
//     (how it learns of a loss it may not see itself: a rank frozen only for others).
//  5. A beat that cannot be written at once is skipped: a peer that does not read
//     (frozen) fills its buffer and is then lost by step 3, and no write ever blocks.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/liveness.h"
#include "backends/tcp/socket.h"

namespace spark_hvd {

class Heartbeats : public PeerLiveness {
 public:
  // Takes the connected sockets (fds[peer], -1 for this rank) and starts the thread.
  Heartbeats(int32_t rank, std::vector<int> fds, double timeout_s);
  ~Heartbeats() override;  // Leave({}) unless done

  int wake_fd() const override { return wake_fd_; }
  Status Verdict(const std::string& what, const std::vector<int32_t>& closed,
                 double wait_s) override;
  void Leave(const std::vector<int32_t>& lost) override;

  // How a peer was lost, as 'L' records carry it.
  enum How : uint8_t { kGone = 1, kFrozen = 2, kStoppedOn = 3 };

 private:
  enum State { kAlive, kLeft, kLost };
  struct Peer {
    int fd = -1;  // closed (-1) once the peer ended or was lost
    State state = kAlive;
    How how = kGone;
    tcp::Clock::time_point last_heard;
    std::string inbox;                              // bytes of a record not complete yet
    std::vector<std::pair<int32_t, How>> reported;  // its 'L' records
  };

  void Run();                                        // step 2-3, the thread
  void Read(int32_t p);                              // step 2: what peer p wrote
  void Parse(int32_t p);                             // records of peer p's inbox
  void Lose(int32_t p, How how);                     // step 3 (under mu_)
  void Close(int32_t p);                             // (under mu_)
  std::string Why(How how, int32_t reporter) const;  // reporter: a leaver, or -1

  const int32_t rank_;
  const double timeout_s_;
  const double interval_s_;
  int wake_fd_ = -1;  // eventfd, written once when the first peer is lost
  int stop_fd_ = -1;  // eventfd that ends the thread's poll

  mutable std::mutex mu_;
  std::condition_variable changed_;  // a peer left or was lost
  std::vector<Peer> peers_;          // by job rank; peers_[rank_] unused
  bool woken_ = false;
  bool left_ = false;
  std::thread thread_;
};

}  // namespace spark_hvd
