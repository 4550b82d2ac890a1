// TensorQueue: this rank's ops from enqueue until the engine takes them to
// execute. Names are unique while in flight (per process set): a second op
// under a name that is still queued is refused at enqueue, naming the tensor.
//
// API threads add; the engine thread takes new requests each cycle (for the
// controller to negotiate) and, once a response names them, the entries
// themselves (for the executor). Every method locks; none blocks otherwise.
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/message.h"
#include "engine/op_state.h"

namespace spark_hvd {

struct TensorEntry {
  Request req;
  const void* input = nullptr;
  void* output = nullptr;
  std::shared_ptr<OpState> state;
  // Whatever keeps input and output alive (the caller's tensors): held until the
  // engine has finished with this entry, whatever happens to the caller's handle.
  std::shared_ptr<void> owner;
  void* stream = nullptr;  // device tensors: the stream that produced the input
  // Device tensors: an event recorded on `stream` at submit (a cudaEvent_t of the GPU
  // backends' pool, opaque here); the op's work waits for it alone.
  std::shared_ptr<void> ready;
  int64_t enqueue_us = 0;
};

class TensorQueue {
 public:
  // Adds every entry or none: throws StatusError (InvalidArgument) naming the
  // tensor when a name is already in flight on this rank, or appears twice.
  void Add(std::vector<TensorEntry> entries);
  // Lock-free (the engine polls it while it spins); sequentially consistent with Add.
  bool HasNew() const { return has_new_.load(std::memory_order_seq_cst); }
  // The requests added since the last call, in order of addition.
  std::vector<Request> TakeNew();
  // The entry for a negotiated tensor (null when this rank holds none: it joined,
  // or is not in the process set).
  std::unique_ptr<TensorEntry> Take(int32_t process_set, const std::string& name);
  std::unique_ptr<TensorEntry> TakeJoin();
  // Completes every queued op with `status` (engine stop) and empties the queue.
  void FailAll(Completions* completions, const Status& status);

 private:
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<TensorEntry>> entries_;  // by TensorKey
  std::unique_ptr<TensorEntry> join_;
  std::vector<Request> new_;
  std::atomic<bool> has_new_{false};  // !new_.empty(), stored under mu_
};

}  // namespace spark_hvd
