// HostAllreduce: the arithmetic around an allreduce of host-memory tensors, shared
// by the CPU backends. Inputs are copied into their outputs and prescaled; a joined
// rank's tensors become scratch holding the op's neutral value; then `reduce`
// reduces the segments in place, applying `scale` (1 / ranks for a float Average
// without postscale, done in the same pass; else 1); then integer Average divides
// and the postscale multiplies. Tensors that share memory (in-place views of one
// buffer) are first packed into one scratch buffer, so each element is reduced once.
#pragma once

#include <functional>
#include <vector>

#include "backends/communicator.h"

namespace spark_hvd {

using SegmentReduce = std::function<Status(const std::vector<Segment>& segments, double scale)>;

Status HostAllreduce(const ReduceArgs& args, const SegmentReduce& reduce);

}  // namespace spark_hvd
