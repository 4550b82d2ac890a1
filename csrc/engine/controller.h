// Controller: the negotiation that decides, each cycle, which named tensors are
// ready on every member rank of their process set, and what to do with them.
//
// Protocol, one cycle (every rank runs it in lockstep on the global control
// communicator; nothing here depends on which rank computes it):
//  1. Each rank files its new local requests: a request whose exact twin is in
//     the response cache becomes a bit (its slot); any other becomes "uncached".
//  2. Fixed-size exchange (AllgatherFixed): each rank sends a header
//     {flags: shutdown|joined, bytes of its uncached requests, stall cutoff}
//     followed by its cache bit vector. Every rank now knows every rank's bits.
//  3. Only if some rank has uncached requests: Allgatherv of the serialized
//     requests. Idle and steady-state cycles (every tensor cached) skip this.
//  4. Every rank applies the same data in the same order: a shutdown flag ends
//     the engine everywhere; uncached requests enter the message table (and
//     evict a cached twin of the same name, whose holders resend in full);
//     a cache slot is ready when all active (non-joined) members set its bit;
//     a table entry is ready when all active members submitted it, and is
//     then validated (op, dtype, shape, root, ... must agree: a mismatch is an
//     error response naming the tensor, both ranks and both values) and cached.
//  5. Grouped tensors wait for their whole group; join completes when every
//     rank has joined; rank 0's stall cutoff (SPARK_HVD_STALL_SHUTDOWN_TIME_S)
//     turns tensors pending since that cycle into errors on every rank.
//  6. Adjacent ready allreduces with the same dtype/op/scales/set/device are
//     fused up to SPARK_HVD_FUSION_THRESHOLD bytes.
// The resulting response list is identical on all ranks; each rank executes
// the responses of the process sets it belongs to.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backends/communicator.h"
#include "engine/message.h"
#include "engine/op_state.h"
#include "engine/process_set.h"
#include "engine/response_cache.h"

namespace spark_hvd {

struct TensorEntry {
  Request req;
  const void* input = nullptr;
  void* output = nullptr;
  std::shared_ptr<OpState> state;
  int64_t enqueue_us = 0;
};

struct CycleResult {
  std::vector<Response> responses;
  bool shutdown = false;
  std::vector<int32_t> shutdown_ranks;
  // Nothing pending on any rank (no request, cache bit, join or partial group):
  // the same on every rank, so all may slow their cycles down together.
  bool idle = false;
};

class Controller {
 public:
  Controller(int32_t rank, int32_t size, ProcessSetTable* sets, HandleTable* handles);

  // Runs one negotiation cycle. Throws StatusError when the control plane fails.
  CycleResult Cycle(Communicator* control, std::vector<TensorEntry> incoming, bool shutdown);

  // The local entry for a response tensor (null when this rank joined and holds none).
  std::unique_ptr<TensorEntry> Take(int32_t process_set, const std::string& name);
  // The local join request, once the join response arrives.
  std::unique_ptr<TensorEntry> TakeJoin();
  bool joined() const { return join_entry_ != nullptr; }
  bool HasPending() const { return !pending_.empty() || join_entry_ != nullptr; }
  // Fails every local pending op (engine shutdown or failure).
  void FailAll(const Status& status);

 private:
  struct TableEntry {
    std::map<int32_t, Request> requests;  // by global rank
    int64_t seq = 0;
    int64_t first_cycle = 0;
    int64_t first_us = 0;
    bool reported = false;
  };

  void File(TensorEntry entry);
  Response Build(const std::map<int32_t, Request>& requests, const ProcessSet* set) const;
  std::vector<int32_t> Active(const ProcessSet& set) const;
  // Rank 0 warns about tensors some ranks are missing; every rank fails the
  // tensors pending since rank 0's cutoff cycle (SPARK_HVD_STALL_SHUTDOWN_TIME_S).
  // bit(rank, slot): did that rank set the cache bit of slot this cycle.
  void InspectStalls(int64_t cutoff, const std::function<bool(int32_t, int64_t)>& bit,
                     std::vector<Response>* out);
  static std::vector<Response> Fuse(std::vector<Response> ready);
  void Fail(TensorEntry& e, const Status& s);

  int32_t rank_;
  int32_t size_;
  ProcessSetTable* sets_;
  HandleTable* handles_;
  ResponseCache cache_;
  int64_t cycle_ = 0;
  int64_t seq_ = 0;

  // Identical on every rank.
  std::map<std::string, TableEntry> table_;  // by TensorKey
  std::map<std::string, std::vector<Response>> groups_;
  std::vector<bool> joined_;
  std::vector<int64_t> join_cycle_;

  // This rank only.
  std::map<std::string, std::unique_ptr<TensorEntry>> pending_;  // by TensorKey
  std::deque<std::string> to_send_;                                // TensorKeys
  std::map<int64_t, std::string> cached_local_;                    // slot -> TensorKey
  std::unique_ptr<TensorEntry> join_entry_;
};

}  // namespace spark_hvd
