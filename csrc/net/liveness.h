// Peer liveness: are the other ranks of the job still there? Known without the
// engine thread or the user's Python: net/heartbeat.h keeps it, with heartbeats on
// connections of their own answered by a thread of their own, so a rank that
// computes for minutes without collectives is alive, and one that stopped (SIGSTOP,
// a hung host, a partition) or died is found within SPARK_HVD_HEARTBEAT_TIMEOUT_S.
//
// The engine starts it for the job's ranks (controller "gloo": the rendezvous
// store) before connecting any backend and hands it to them in BackendOptions; a
// backend that waits on peers adds wake_fd() to its polls and asks Verdict() why it
// cannot go on. The engine ends it (Leave) before it destroys its communicators.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace spark_hvd {

class Store;

class PeerLiveness {
 public:
  virtual ~PeerLiveness() = default;

  // Readable, and it stays so, once a peer is lost: a wait that polls it stops then.
  virtual int wake_fd() const = 0;

  // Why a collective (`what`, e.g. "allreduce") on this rank cannot go on, with job
  // ranks. kPeerLost naming the same ranks in .ranks and in its message: the peers
  // lost (their process ended without a goodbye, or no heartbeat within the deadline;
  // as found here, or as a peer reported when it left), else the ranks of `closed`
  // that left (their engine stopped: shutdown() or a failure of their own). Waits up
  // to wait_s for a verdict on each rank of `closed` (peers whose connection closed).
  // OK when it knows nothing that explains it.
  virtual Status Verdict(const std::string& what, const std::vector<int32_t>& closed,
                         double wait_s) = 0;

  // Tells every peer this rank leaves, and which ranks its engine lost (`lost`), then
  // closes. Peers count it as left, not lost. Idempotent.
  virtual void Leave(const std::vector<int32_t>& lost) = 0;
};

// What the heartbeats need of the job (the engine fills it from its BackendOptions).
struct LivenessOptions {
  int32_t rank = 0;
  int32_t size = 1;
  std::shared_ptr<Store> store;  // the job's rendezvous store (null: no heartbeats)
  std::string store_prefix;      // this init's namespace in it
  std::string bind_host = "127.0.0.1";
  double connect_timeout_s = 60.0;
  // Ranks of the job the rendezvous service has seen vanish (asked while connecting).
  std::function<std::vector<int32_t>()> lost_ranks;
};

// Heartbeats among the ranks of the job (net/heartbeat.h), set up through
// options.store; null with one rank, without a store, or with
// SPARK_HVD_HEARTBEAT_TIMEOUT_S = 0. Collective over the job; throws StatusError as a
// connect does.
std::unique_ptr<PeerLiveness> StartHeartbeats(const LivenessOptions& options);

}  // namespace spark_hvd
