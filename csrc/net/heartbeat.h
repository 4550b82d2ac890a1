// Heartbeats: the job's PeerLiveness (net/liveness.h) on TCP connections of
// their own, kept by a thread of their own (shvd_heartbeat) that takes no lock the
// engine or Python holds. Each rank beats with two peers, its neighbours on a ring of
// the ranks, whatever the job's size, and what one rank learns travels around the ring.
// The protocol:
//  1. Set-up (StartHeartbeats, collective over the job): listen, publish
//     "host port token" under "<prefix>/live/<rank>" and read the addresses of the next
//     kBook ranks in one request (Store::SetAndMultiGet, failing at once on a lost rank),
//     connect to the successor (rank + 1 mod n) and accept the predecessor's
//     connection (the mesh's hello and token: net/hello.h), within the start timeout.
//     Two connections per rank (one pair of them with 2 ranks).
//  2. Every interval (SPARK_HVD_HEARTBEAT_TIMEOUT_S / 6) the thread writes a beat, one
//     byte 'H', on each of its connections, and reads whatever comes. Any byte from a
//     neighbour is news that its process runs.
//  3. A neighbour is lost when its connection ends without a goodbye (its process
//     exited or was killed: its kernel closes its sockets), or when nothing came from
//     it for the timeout (stopped by a signal, hung, its host unreachable). A
//     neighbour met at set-up that has sent nothing yet is given the start timeout on
//     top: it may still be waiting for its other neighbour (a rank that started late)
//     and beats only once its own set-up is done.
//  4. What a rank learns it passes on: a lost rank as a record 'L' <rank: int32>
//     <how: uint8> <reporter: int32> (the rank that found it), a rank that left as 'G'
//     <rank: int32>, to each of its connections but the one it came from, once per
//     rank; so every rank hears of a loss after at most n / 2 hops, each a wake-up of
//     a heartbeat thread. A lost rank stays lost; the first one makes wake_fd()
//     readable, which stops any wait polling it, and Verdict() names it.
//  5. Healing: a rank whose successor is lost connects to the next ranks in ring order
//     not known lost, up to kProbeBatch of them at once, each within a third of the
//     timeout; the nearest that answers is its successor from then on (the others get
//     a goodbye 'B'), and each that does not is lost too (refused: its process is gone;
//     silent: its host is unreachable), so the survivors of a whole host cut off name
//     each of its ranks. Addresses past the kBook read at set-up are read then (one
//     request, the only time this thread calls the store). A connection that arrives
//     from any rank (a predecessor healing) is kept as one more neighbour.
//  6. Leaving (Leave, when the engine stops, before its communicators close): the
//     thread stops; each neighbour gets 'L' records for the ranks this engine lost
//     and every rank known lost, then 'G' for this rank and 'B'; the socket is shut
//     for writing and closed once the neighbour closed its side (or after
//     kLeaveWaitS). A rank that left is not healed around: its job is ending.
//  7. A beat that cannot be written at once is skipped, and records wait in an outbox
//     until the socket takes them: no write ever blocks the thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "net/hello.h"
#include "net/liveness.h"
#include "net/socket.h"
#include "rendezvous/store.h"

namespace spark_hvd {

class Heartbeats : public PeerLiveness {
 public:
  // Step 1 (throws StatusError as a connect does), then starts the thread.
  Heartbeats(const LivenessOptions& options, double timeout_s);
  ~Heartbeats() override;  // Leave({}) unless done

  int wake_fd() const override { return wake_fd_; }
  Status Verdict(const std::string& what, const std::vector<int32_t>& closed,
                 double wait_s) override;
  void Leave(const std::vector<int32_t>& lost) override;
  // Test only (Engine::SimulateStop, for the in-process simulator): the thread stops, as
  // in a process killed (crash: every socket closes with no record and no goodbye, so
  // neighbours find this rank gone, step 3; Leave does nothing after) or stopped by a
  // signal (the sockets stay open and unread: neighbours find it silent; Leave, later,
  // says goodbye and closes them as usual).
  void SimulateStop(bool crash);

  // How a rank was lost, as 'L' records carry it.
  enum How : uint8_t { kGone = 1, kFrozen = 2, kStoppedOn = 3, kUnreachable = 4 };

 private:
  enum State { kAlive, kLeft, kLost };
  struct Rank {
    State state = kAlive;
    How how = kGone;
    int32_t reporter = -1;  // the rank that found it lost (-1: this one)
  };
  // A connection to a neighbour (or a probe of a would-be successor not answered yet).
  struct Link {
    int32_t peer = -1;
    int fd = -1;
    bool probe = false;  // connecting, hello sent or not, acknowledgement not read
    bool connected = false;
    size_t hello_sent = 0;
    uint32_t ack = 0;
    size_t ack_got = 0;
    net::Clock::time_point deadline;    // a probe's
    net::Clock::time_point last_heard;  // any byte
    // A set-up neighbour nothing has come from yet may stay silent until then (step 3).
    net::Clock::time_point grace{};
    std::string inbox;    // bytes of a record not complete yet
    std::string outbox;   // records the socket has not taken yet
    bool ok = false;      // a probe that answered
    bool failed = false;  // a probe that did not (refused, reset, silent)
    bool refused = false;
  };

  void SetUp(const LivenessOptions& options);  // step 1
  void Run();                                  // steps 2-5, the thread
  void Read(Link& l);                          // step 2
  void Parse(Link& l);                         // step 4's records
  void Learn(int32_t rank, State state, How how, int32_t reporter, const Link* from);  // mu_
  void Send(Link& l, const std::string& bytes);                                        // step 7
  void Flush(Link& l);
  void Probe(const net::Clock::time_point& now);  // step 5: start the next batch
  std::vector<int32_t> ProbeCandidates() const;   // its ranks without a known address
  void AdvanceProbe(Link& l);
  void SettleProbes();
  void CloseLink(Link& l, bool bye);
  net::Clock::time_point SilentBy(const Link& l) const;  // step 3: lost if silent past it
  std::string Why(How how, int32_t reporter) const;
  std::string Address(int32_t rank);  // step 5's addresses

  const int32_t rank_;
  const int32_t size_;
  const double timeout_s_;
  const double interval_s_;
  std::shared_ptr<Store> store_;
  int wake_fd_ = -1;  // eventfd, written once when the first rank is lost
  int stop_fd_ = -1;  // eventfd that ends the thread's poll
  int listener_ = -1;
  std::string token_;
  std::unique_ptr<net::HelloDesk> desk_;
  std::map<int32_t, std::string> book_;  // liveness addresses read, by rank
  int32_t succ_ = -1;                    // the successor (-1: none, or healing)
  int32_t probed_up_to_ = -1;            // the farthest rank probed in this healing

  mutable std::mutex mu_;
  std::condition_variable changed_;  // a rank left or was lost
  std::vector<Rank> ranks_;          // what this rank knows of every rank
  std::vector<Link> links_;
  bool woken_ = false;
  net::Clock::time_point first_loss_{};  // when this rank first heard of a lost rank
  double settle_s_ = 0;                  // how long a verdict waits after it (Verdict)
  bool left_ = false;
  std::thread thread_;
};

}  // namespace spark_hvd
