// What this process sends, counted so that a benchmark or a test reads exact numbers
// (messages, bytes, connections) instead of estimating them from times: how the cost
// of the job's protocols grows with the number of ranks (docs/scaling.md).
//
// A message is one logical send to one peer: a block of a collective to a peer, a step
// of a ring, a heartbeat, an shm round's publication. Its kind is what it serves:
// kControl (the engine's per-cycle negotiation), kData (the user's collectives),
// kLiveness (heartbeats). Each sender counts under its backend's slot (tcp, shm...);
// the kind is the calling thread's, which the controller sets around its exchange
// (ScopedTrafficKind), so a communicator need not know who calls it.
//
// Counters are process-wide relaxed atomics: one add per message, no lock.
#pragma once

#include <atomic>
#include <cstdint>

namespace spark_hvd {

enum class TrafficKind : int { kControl = 0, kData = 1, kLiveness = 2 };
constexpr int kTrafficKinds = 3;
const char* TrafficKindName(TrafficKind kind);  // "control", "data", "liveness"

// The senders counted apart.
enum class TrafficSender : int { kTcp = 0, kShm = 1, kGloo = 2, kMpi = 3, kHeartbeat = 4 };
constexpr int kTrafficSenders = 5;
const char* TrafficSenderName(TrafficSender sender);  // "tcp", "shm", ...

struct TrafficCount {
  std::atomic<int64_t> messages{0};
  std::atomic<int64_t> bytes{0};
};

// Connection set-up, over every sender: connections this process started and got
// established, accepted and kept, attempts that failed (refused, reset, timed out:
// each retry counts), and accepted connections dropped as invalid (a stray client,
// a bad hello).
struct ConnectionCount {
  std::atomic<int64_t> opened{0};
  std::atomic<int64_t> accepted{0};
  std::atomic<int64_t> failed{0};
  std::atomic<int64_t> dropped{0};
};

// The calling thread's kind while alive (nests; default kData).
class ScopedTrafficKind {
 public:
  explicit ScopedTrafficKind(TrafficKind kind);
  ~ScopedTrafficKind();
  ScopedTrafficKind(const ScopedTrafficKind&) = delete;
  ScopedTrafficKind& operator=(const ScopedTrafficKind&) = delete;

 private:
  TrafficKind saved_;
};

TrafficKind CurrentTrafficKind();

// One message of `bytes` from `sender`, of the calling thread's kind (or `kind`).
void CountMessage(TrafficSender sender, int64_t bytes);
void CountMessage(TrafficSender sender, TrafficKind kind, int64_t bytes);

const TrafficCount& Traffic(TrafficSender sender, TrafficKind kind);
ConnectionCount& Connections();

}  // namespace spark_hvd
