// FusionBuffer: for backends whose allreduce takes one contiguous buffer (Gloo's
// algorithms, MPI). A lone segment of at least direct_min_bytes is reduced where
// it is; anything else is packed into the backend's fusion buffer (kept across
// calls, so its address is stable and set-up-once algorithms keyed on it are
// reused), reduced once and copied back (scaled on the way out).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "backends/communicator.h"

namespace spark_hvd {

class FusionBuffer {
 public:
  // Runs reduce(buffer, count, stable) over the segments' elements; `stable` says
  // the buffer is this fusion buffer. A backend whose set-up is per size may ask
  // for a padded count (round_up, same answer on every rank): the padding is zero.
  Status Allreduce(const std::vector<Segment>& segments, DataType dtype, double scale,
                   int64_t direct_min_bytes, const std::function<int64_t(int64_t)>& round_up,
                   const std::function<Status(void* buf, int64_t count, bool stable)>& reduce);

 private:
  std::vector<uint8_t> buffer_;
};

}  // namespace spark_hvd
