// HostAllreduce: the arithmetic around an allreduce of host-memory tensors, shared
// by the CPU backends. Inputs are copied into their outputs and prescaled; a joined
// rank's tensors become scratch holding the op's neutral value; then `reduce`
// reduces the segments in place, applying `scale` to float32/float64 in the same pass
// (PostFactor: the postscale, divided by the ranks for Average); other dtypes are
// multiplied by it afterwards. Tensors that share memory (in-place views of one
// buffer) are first packed into one scratch buffer, so each element is reduced once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backends/communicator.h"
#include "common/function_ref.h"
#include "common/reduce.h"

namespace spark_hvd {

// The backend's reduction of prepared segments: a reference to the caller's callable
// (valid for the call it is passed to), so that passing a lambda allocates nothing.
using SegmentReduce = FunctionRef<Status(const std::vector<Segment>& segments, double scale)>;

// What HostAllreduce works in, kept by its caller (a communicator) from op to op so
// that steady state allocates nothing: cleared, never shrunk.
struct HostReduceScratch {
  HostReduceScratch() {  // room for a fusion of 64 tensors from the start
    segments.reserve(64);
    spans.reserve(128);
  }
  std::vector<Segment> segments;
  std::vector<std::vector<uint8_t>> neutral;  // a joined rank's tensors
  std::vector<uint8_t> packed;                // tensors that share memory, packed
  struct Span {
    uintptr_t begin, end;
    size_t tensor;
  };
  std::vector<Span> spans;  // the overlap check's
};

// `scratch` may be null (a one-off: local buffers).
Status HostAllreduce(const ReduceArgs& args, const SegmentReduce& reduce,
                     HostReduceScratch* scratch = nullptr);

// What multiplies a reduced sum, as Horovod computes it: the postscale, divided by the
// contributing ranks for Average (for every dtype: integers go through double and are
// truncated, float32 multiplies by the factor rounded to float32).
double PostFactor(const ReduceArgs& args);

// The order of the reduction, shared by the backends that give the same bits (tcp and
// shm: a job's results do not depend on which of them ran it):
// - direct: a buffer of at most kDirectReduceBytes, or of fewer elements than ranks, is
//   reduced among at most kDirectMaxRanks ranks in rank order, accumulator first:
//   ((x0 op x1) op x2) ...; among more ranks in the pairwise order of recursive
//   doubling (tcp sends log2 of the ranks' messages instead of all of them): with p the
//   largest power of two <= n, y_i = x_i op x_(i+p) for i < n - p (else y_i = x_i), then
//   neighbours pairwise, the lower operand first, level by level: for n = 4,
//   (y0 op y1) op (y2 op y3) (PairwiseReduce);
// - halving: a larger buffer among more than kRingMinRanks ranks whose ring steps would
//   move less than kRingStepBytes each (ReducesByHalving) is reduced in the same
//   pairwise order, every element: tcp runs reduce-scatter by recursive halving and
//   allgather by recursive doubling (2 log2 n steps instead of the ring's 2 (n - 1));
// - ring: otherwise chunk c (elements [RingChunkStart(c), RingChunkStart(c + 1))) is
//   reduced around the ring from rank c, the arriving partial result as the right
//   operand: x(c+2) op (x(c+1) op x(c)) ... (GetReduceFnReversed, common/reduce.h).
// The postscale factor (float32/float64, see above) multiplies each final element.
constexpr size_t kDirectReduceBytes = 64 * 1024;
constexpr int kDirectMaxRanks = 4;
constexpr int kRingMinRanks = 8;            // up to this many ranks the ring runs any size
constexpr size_t kRingStepBytes = 1 << 20;  // a ring step moving less waits more than it moves
inline bool ReducesDirect(size_t bytes, size_t count, int ranks) {
  return bytes <= kDirectReduceBytes || count < static_cast<size_t>(ranks);
}
inline bool ReducesByHalving(size_t bytes, size_t count, int ranks) {
  return !ReducesDirect(bytes, count, ranks) && ranks > kRingMinRanks &&
         bytes / static_cast<size_t>(ranks) < kRingStepBytes;
}
inline size_t RingChunkStart(size_t count, int chunk, int ranks) {
  return count * static_cast<size_t>(chunk) / static_cast<size_t>(ranks);
}
// The largest power of two <= n (n >= 1): where recursive doubling folds the rest in.
inline int PowerOfTwoFloor(int n) {
  int p = 1;
  while (p <= n / 2) p *= 2;
  return p;
}

// Reduces operands[0..n) (each `count` elements) into `out` in the pairwise order above;
// `temps` has room for PairwiseTemps(n) buffers of `count` elements, one after another.
void PairwiseReduce(const char* const* operands, int n, size_t count, size_t elem, ReduceFn fn,
                    char* temps, char* out);
int PairwiseTemps(int n);

}  // namespace spark_hvd
