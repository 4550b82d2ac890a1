// Controller: the negotiation that decides, each cycle, which named tensors are
// ready on every member rank of their process set, and what to do with them.
// It sees requests only; the entries (buffers, completion) stay in the
// TensorQueue until the executor takes them.
//
// Protocol, one cycle (every rank runs it in lockstep on the global control
// communicator; nothing here depends on which rank computes it):
//  1. File: each rank files its new local requests: a request whose exact twin
//     is in the response cache becomes a bit (its slot); any other becomes
//     "uncached".
//  2. Summary (every cycle): one AllreduceFixed of a fixed record (negotiation.h's
//     CycleRecords): a header {flags ORed: shutdown|joined|full|autotune's; rank 0's
//     stall cutoff and autotune parameters}, the cache bits ANDed (a rank sets a slot's
//     bit when its request is there, or when the slot's set does not include it, or
//     while it has joined) and the cache bits ORed (some rank has it). tcp runs it as
//     recursive doubling: each rank sends ceil(log2 n) messages (one more for the ranks
//     past a power of two) of 24 + 2 * cache_capacity / 8 bytes, whatever n is. A
//     steady training loop (every tensor cached) and an idle job stop here.
//  3. Full records, only when some rank raised kFlagFull (it has requests to send in
//     full, shuts down, joined or stopped being joined, or rank 0 will report a stalled
//     cached tensor): AllgatherFixed of every rank's own header and cache bits (tcp:
//     Bruck's log2 n rounds), then, if any rank has uncached requests, an Allgatherv of
//     the serialized requests.
//  4. Apply, in the same order on every rank: a shutdown flag ends the engine
//     everywhere; joined flags update (full cycles); uncached requests enter the message
//     table (and evict a cached twin of the same name, whose holders resend in
//     full); a cache slot is ready when its ANDed bit is set and its set has a member
//     that has not joined; a table entry is ready when all active members submitted it, and is
//     then validated (op, dtype, shape, root, ... must agree: a mismatch is an
//     error response naming the tensor, both ranks and both values) and cached.
//  5. Groups (groups.h): the members of a group become ready in the same cycle;
//     a group runs when all its members are ready and valid, else every member
//     fails with one error (its members still in the table too). Join completes
//     when every rank has joined; stall inspection (stall_inspector.h): rank 0's
//     cutoff turns tensors pending since that cycle into errors on every rank,
//     a grouped one's into its whole group's.
//  6. Fusion (fusion.h): adjacent ready allreduces with the same
//     dtype/op/scales/set/device are fused up to SPARK_HVD_FUSION_THRESHOLD bytes,
//     or the threshold rank 0's header carries (autotune.h, which then measures).
// The resulting response list is identical on all ranks; each rank executes
// the responses of the process sets it belongs to.
#pragma once

#include <deque>
#include <map>
#include <string>
#include <vector>

#include "backends/communicator.h"
#include "engine/autotune.h"
#include "engine/message.h"
#include "engine/negotiation.h"
#include "engine/process_set.h"
#include "engine/response_cache.h"
#include "engine/stall_inspector.h"

namespace spark_hvd {

struct CycleResult {
  ResponseList responses;
  bool shutdown = false;
  std::vector<int32_t> shutdown_ranks;
  // Nothing pending on any rank (no request, cache bit, join or partial group):
  // the same on every rank, so all may slow their cycles down together.
  bool idle = false;
  // Ops of the global set ran this cycle and nothing is left pending on any rank: every
  // rank had work, and a training loop's ranks come back with more, each starting a cycle
  // at once when it does; the next cycle on the timer can wait. (After a smaller set's op
  // the others pace as usual: they may have nothing to do while that set goes on.)
  bool quiet = false;
};

class Controller {
 public:
  // `tuner` and `stats` (the engine's) outlive the controller.
  Controller(int32_t rank, int32_t size, ProcessSetTable* sets, Autotuner* tuner,
             CacheStats* stats);

  // Runs one negotiation cycle over this rank's new requests, moved out of *incoming
  // (left empty, its capacity kept), into *result (refilled: a result kept from cycle
  // to cycle, like the controller's own buffers, allocates nothing in steady state).
  // Throws StatusError when the control plane fails.
  void Cycle(Communicator* control, std::vector<Request>* incoming, bool shutdown,
             CycleResult* result);

  // Has this rank requests (or a join) not yet answered by a response?
  bool HasPending() const { return !local_.empty() || join_pending_; }

 private:
  void File(Request&& req);                             // step 1
  void Exchange(Communicator* control, bool shutdown);  // steps 2-3, into records_
  void ApplyJoins(const CycleRecords& records);         // step 4
  void ApplyRequests(const CycleRecords& records);      // step 4
  // Whether a slot is set by some ranks, not every one (pending somewhere).
  bool ReadyCached(const CycleRecords& records, ResponseList* ready);
  void ReadyTable(ResponseList* ready);  // steps 4-5 (groups)
  void ReadyJoin(ResponseList* ready);   // step 5
  // Forgets this rank's record of every tensor a response answers.
  void Answered(const ResponseList& responses);

  // Fills *r (every field: it may be a kept one) with the response to `requests`.
  void Build(const std::map<int32_t, Request>& requests, const ProcessSet* set, Response* r) const;
  // The set's ranks that have not joined.
  void Active(const ProcessSet& set, std::vector<int32_t>* out) const;
  // With members of the set joined: *r fails unless its op goes on without them (as in
  // Horovod, allreduce and barrier). Whether it failed.
  bool RefuseJoined(const ProcessSet& set, Response* r) const;

  int32_t rank_;
  int32_t size_;
  ProcessSetTable* sets_;
  Autotuner* tuner_;
  CacheStats* stats_;
  ResponseCache cache_;
  StallInspector stalls_;
  int64_t cycle_ = 0;
  int64_t seq_ = 0;

  // Identical on every rank.
  MessageTable table_;
  std::vector<bool> joined_;
  int32_t joined_count_ = 0;
  std::vector<int64_t> join_cycle_;

  // This rank only.
  using LocalMap = std::map<std::string, Request>;
  LocalMap local_;                   // unanswered requests, by TensorKey
  std::deque<std::string> to_send_;  // TensorKeys to send in full
  // By cache slot: the TensorKey of this rank's request sent as that slot's bit, or "".
  std::vector<std::string> cached_key_;
  bool join_pending_ = false;

  // Reused every cycle, so that a steady cycle allocates nothing: nodes of answered
  // requests (refilled by File), a key being looked up, the exchange's buffers and
  // records, the ready responses before fusion.
  static constexpr size_t kKeepNodes = 1024;
  std::vector<LocalMap::node_type> spare_local_;
  std::string key_;
  Writer payload_;
  std::vector<char> mine_;
  CycleRecords records_;
  ResponseList ready_;
};

}  // namespace spark_hvd
