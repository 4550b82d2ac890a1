// TensorQueue: this rank's ops from enqueue until the engine takes them to
// execute. Names are unique while in flight (per process set): a second op
// under a name that is still queued is refused at enqueue, naming the tensor.
//
// API threads add; the engine thread takes new requests each cycle (for the
// controller to negotiate) and, once a response names them, the entries
// themselves (for the executor). Every method locks; none blocks otherwise.
//
// No heap allocation per op in steady state: entries come from a free list
// (EntryPtr gives them back when the engine drops them), the map's nodes taken by
// Take are kept and refilled by Add, and names are looked up without building a key.
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/free_list.h"
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

// Destroys an entry (releasing its buffers' owner at once) and gives its memory back to
// the queue's free list.
class EntryRecycler {
 public:
  EntryRecycler() = default;
  explicit EntryRecycler(std::shared_ptr<FreeList> list) : list_(std::move(list)) {}
  void operator()(TensorEntry* e) const {
    e->~TensorEntry();
    list_->Put(e, sizeof(TensorEntry));
  }

 private:
  std::shared_ptr<FreeList> list_;
};
using EntryPtr = std::unique_ptr<TensorEntry, EntryRecycler>;

// Releases `entries` (their buffers' owners) and only then completes their ops with
// `status`, so that a waiter the completion wakes finds its buffers given back: a GPU
// staging buffer in its pool, a Python owner already queued for release when the waiter
// drains that queue. `states` is the caller's scratch, kept: no allocation once grown.
void ReleaseThenComplete(std::vector<EntryPtr>* entries, const Status& status,
                         Completions* completions, std::vector<std::shared_ptr<OpState>>* states);

class TensorQueue {
 public:
  // Adds every entry or none: throws StatusError (InvalidArgument) naming the
  // tensor when a name is already in flight on this rank, or appears twice.
  void Add(std::vector<TensorEntry> entries);
  // Lock-free (the engine polls it while it spins); sequentially consistent with Add.
  bool HasNew() const { return has_new_.load(std::memory_order_seq_cst); }
  // The requests added since the last call, in order of addition, into *out (emptied
  // first); the queue keeps out's old capacity for the next ones, so neither side
  // allocates a vector per cycle.
  void TakeNew(std::vector<Request>* out);
  // The same for a cycle run on an API thread (Engine::Drive): false, taking nothing,
  // while this rank holds an op that only the engine thread may run (a device tensor's,
  // a join, a process-set change).
  bool TakeNewOffThread(std::vector<Request>* out);
  // The entry for a negotiated tensor (null when this rank holds none: it joined,
  // or is not in the process set).
  EntryPtr Take(int32_t process_set, const std::string& name);
  EntryPtr TakeJoin();
  // Completes every queued op with `status` (engine stop) and empties the queue.
  void FailAll(Completions* completions, const Status& status);
  // Heap allocations of entries and map nodes so far (flat in steady state; tests read it).
  int64_t made() const { return entry_list_->made() + nodes_made_.load(); }

 private:
  // (process set, name): scoped names, compared without building a string.
  struct Key {
    int32_t process_set;
    std::string name;
  };
  struct KeyRef {
    int32_t process_set;
    const std::string& name;
  };
  struct KeyLess {
    using is_transparent = void;
    template <class A, class B>
    bool operator()(const A& a, const B& b) const {
      return a.process_set != b.process_set ? a.process_set < b.process_set : a.name < b.name;
    }
  };
  using Map = std::map<Key, EntryPtr, KeyLess>;
  static constexpr size_t kKeep = 1024;  // free entries and nodes kept for reuse

  std::mutex mu_;
  Map entries_;
  std::vector<Map::node_type> spare_;  // nodes of taken entries, refilled by Add
  std::vector<const Request*> seen_;   // Add's duplicate check, reused
  std::shared_ptr<FreeList> entry_list_ = std::make_shared<FreeList>(kKeep);
  std::atomic<int64_t> nodes_made_{0};
  int64_t thread_bound_ = 0;  // entries held that TakeNewOffThread must not run
  EntryPtr join_;
  std::vector<Request> new_;
  std::atomic<bool> has_new_{false};  // !new_.empty(), stored under mu_
};

}  // namespace spark_hvd
