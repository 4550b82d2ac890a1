// OpState and HandleTable: how an enqueued op's completion reaches the caller.
// Waiters block on a condition variable (no spinning); Python polls or waits.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "common/status.h"
#include "common/types.h"

namespace spark_hvd {

struct OpState {
  bool done = false;
  Status status;
  // Outputs the core allocates (allgather, alltoall, reducescatter).
  std::vector<uint8_t> output;
  std::vector<int64_t> output_shape;
  std::vector<int64_t> received_splits;  // alltoall
  int64_t value = -1;                    // join: last rank to join; add_process_set: id
};

class HandleTable {
 public:
  int64_t Add(std::shared_ptr<OpState> state);
  std::shared_ptr<OpState> Get(int64_t handle);
  void Complete(OpState& state, Status status);
  bool Poll(int64_t handle);
  // Waits up to timeout_s (< 0: forever). Returns false on timeout.
  bool Wait(int64_t handle, double timeout_s);
  void Release(int64_t handle);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, std::shared_ptr<OpState>> states_;
  int64_t next_ = 1;
};

}  // namespace spark_hvd
