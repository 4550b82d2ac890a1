// OpState and Completions: how an enqueued op's completion reaches the caller.
//
// An op is shared between the caller's handle (the Python Work object) and the
// engine's TensorEntry. Either side may go first: a caller that drops its handle
// before the op completes leaves the engine's entry (and with it the buffers the
// entry owns) alive until the engine is done; an op nobody waits for is freed
// when the engine finishes it. Waiters block on a condition variable at once: spinning
// first was measured slower on a loaded machine (common/spin.h).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/communicator.h"
#include "common/free_list.h"
#include "common/status.h"
#include "common/types.h"

namespace spark_hvd {

struct OpState {
  bool done = false;  // guarded by Completions' mutex
  Status status;
  // Outputs the core allocates (allgather, alltoall, reducescatter), in the memory of
  // the communicator that ran the op (host, or the rank's GPU).
  Buffer output;
  std::vector<int64_t> output_shape;
  std::vector<int64_t> received_splits;  // alltoall
  int64_t value = -1;                    // join: last rank to join; add_process_set: id
  // Called once, right after the op is marked done, on the thread that completes it
  // (the engine's, the InFlight thread holding its lock, or an API thread when the
  // engine stops), with no lock of Completions held. It must not block or call into
  // the engine: the C API (csrc/capi) sets it for framework adapters, which hand the
  // completion to a thread of their own. Set before the op is enqueued.
  std::function<void()> on_done;
};

// Makes op states from a free list: in steady state no op allocates its state
// (free_list.h). A state's memory goes back to the list only when its last reference
// (the caller's handle or the engine's entry) is gone.
class OpStates {
 public:
  std::shared_ptr<OpState> New() {
    return std::allocate_shared<OpState>(FreeListAllocator<OpState>(list_));
  }
  int64_t made() const { return list_->made(); }  // heap allocations so far

 private:
  std::shared_ptr<FreeList> list_ = std::make_shared<FreeList>(1024);
};

// One mutex and condition variable for every op's completion.
class Completions {
 public:
  // Marks the op done with `status` (only the first call counts), wakes waiters, then
  // runs the op's on_done.
  void Complete(OpState& state, Status status);
  // The same (on_done included), dropping this reference to the op before any waiter can
  // run: a waiter that then drops its own frees what the op holds (a GPU output back in its
  // pool) at once, on its own thread, before it can submit the next op.
  void Complete(std::shared_ptr<OpState> state, Status status);
  bool Done(const OpState& state);
  // Waits up to timeout_s (< 0: forever). Returns false on timeout.
  bool Wait(const OpState& state, double timeout_s);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int sleepers_ = 0;  // waiters blocked on cv_ (guarded by mu_): none, no notify
};

}  // namespace spark_hvd
