// HostAllreduce: the arithmetic around an allreduce of host-memory tensors, shared
// by the CPU backends. Inputs are copied into their outputs and prescaled; a joined
// rank's tensors become scratch holding the op's neutral value; then `reduce`
// reduces the segments in place, applying `scale` to float32/float64 in the same pass
// (PostFactor: the postscale, divided by the ranks for Average); other dtypes are
// multiplied by it afterwards. Tensors that share memory (in-place views of one
// buffer) are first packed into one scratch buffer, so each element is reduced once.
#pragma once

#include <functional>
#include <vector>

#include "backends/communicator.h"

namespace spark_hvd {

using SegmentReduce = std::function<Status(const std::vector<Segment>& segments, double scale)>;

Status HostAllreduce(const ReduceArgs& args, const SegmentReduce& reduce);

// What multiplies a reduced sum, as Horovod computes it: the postscale, divided by the
// contributing ranks for Average (for every dtype: integers go through double and are
// truncated, float32 multiplies by the factor rounded to float32).
double PostFactor(const ReduceArgs& args);

}  // namespace spark_hvd
