// InFlight: ops whose device work a backend queued and has not finished. A
// thread of its own (`shvd_inflight`) polls them without blocking the engine,
// completes each op when its work is done and only then releases its entry (and
// the buffers its owner keeps alive). Work older than SPARK_HVD_TIMEOUT_S, or that
// reports a failure, aborts its communicator and fails its ops; the first such
// failure is the engine's reason to stop.
#pragma once

#include <condition_variable>
#include <deque>
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

  void Add(std::unique_ptr<PendingWork> work, std::vector<std::unique_ptr<TensorEntry>> entries);
  // The first failure of any work so far, or OK.
  Status failure();
  // Waits for everything in flight (up to timeout_s, then aborts the rest).
  void Drain(double timeout_s);
  // Aborts everything in flight and fails its ops with `why`.
  void AbortAll(const Status& why);

 private:
  struct Item {
    std::unique_ptr<PendingWork> work;
    std::vector<std::unique_ptr<TensorEntry>> entries;
    int64_t started_us;  // NowMicros()
  };
  void Loop();
  void Finish(Item& item, const Status& status);
  static std::string Describe(const Item& item);

  Completions* completions_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> items_;
  Status failure_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace spark_hvd
