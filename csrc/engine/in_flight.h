// InFlight: ops whose device work a backend queued and has not finished. A
// thread of its own (`shvd_inflight`) polls them without blocking the engine,
// completes each op when its work is done and only then releases its entry (and
// the buffers its owner keeps alive). Work older than SPARK_HVD_TIMEOUT_S, or that
// reports a failure, aborts its communicator and fails its ops (a timeout names them and
// the peers the backend knows never reached the work: PendingWork::NoteWaiting after a
// second, WhoIsMissing at the timeout); the first such
// failure is the engine's reason to stop. A failed item's buffers (the caller's
// tensors among them) are kept until its queued work can no longer touch them
// (PendingWork::Quiesced), or, if that never comes within SPARK_HVD_TIMEOUT_S, never
// released at all: a leak rather than a late copy into memory reused meanwhile.
#pragma once

#include <condition_variable>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/communicator.h"
#include "engine/op_state.h"
#include "engine/tensor_queue.h"

namespace spark_hvd {

class InFlight {
 public:
  explicit InFlight(Completions* completions);
  ~InFlight();

  // Takes `work` and the entries of its ops (*entries is left empty, with the capacity of
  // a vector an earlier item used: no allocation per op in steady state).
  void Add(std::unique_ptr<PendingWork> work, std::vector<EntryPtr>* entries);
  // Entries of ops already failed whose buffers `work`, queued before the failure, may
  // still use: kept (draining) until it quiesces.
  void Retain(std::unique_ptr<PendingWork> work, std::vector<EntryPtr>* entries);
  // The first failure of any work so far, or OK.
  Status failure();
  // Waits for everything in flight (up to timeout_s, then aborts the rest).
  void Drain(double timeout_s);
  // Aborts everything in flight and fails its ops with `why` (its code and ranks; the
  // message says which collective was aborted).
  void AbortAll(const Status& why);

 private:
  struct Item {
    std::unique_ptr<PendingWork> work;
    std::vector<EntryPtr> entries;
    int64_t started_us;  // NowMicros(); for a draining item, when it failed
    bool noted = false;  // PendingWork::NoteWaiting was called
  };
  void Loop();
  // Completes the item's ops with `status`; a failed item then drains (draining_).
  void Finish(Item& item, const Status& status);
  // Releases `item`'s entries now if its work has quiesced, else puts it in draining_.
  void KeepUntilQuiesced(Item item);
  // Releases the draining items whose work has quiesced; leaks those past `deadline_s`.
  void Sweep(double deadline_s);
  static std::string Describe(const Item& item);

  Completions* completions_;
  std::mutex mu_;
  std::condition_variable cv_;
  // In flight, oldest first. A finished item's node (and its entries vector's capacity)
  // goes to spare_ for the next Add: a list, so that nodes move without allocating.
  std::list<Item> items_;
  std::list<Item> spare_;
  std::deque<Item> draining_;  // failed: ops completed, buffers kept until Quiesced
  Status failure_;
  bool stop_ = false;
  std::vector<std::shared_ptr<OpState>> done_;  // Finish's scratch (guarded by mu_)
  std::thread thread_;
};

}  // namespace spark_hvd
