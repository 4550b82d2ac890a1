#include "backends/host_reduce.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "common/reduce.h"

namespace spark_hvd {
namespace {

// Do any two tensors' inputs/outputs share memory?
bool Overlap(const ReduceArgs& a, std::vector<HostReduceScratch::Span>* scratch) {
  using Span = HostReduceScratch::Span;
  std::vector<Span>& spans = *scratch;
  spans.clear();
  const size_t dsize = DataTypeSize(a.dtype);
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const ReduceTensor& t = a.tensors[i];
    const size_t bytes = static_cast<size_t>(t.count) * dsize;
    if (t.output == nullptr || bytes == 0) continue;
    const auto out = reinterpret_cast<uintptr_t>(t.output);
    spans.push_back({out, out + bytes, i});
    const auto in = reinterpret_cast<uintptr_t>(t.input);
    if (in != out) spans.push_back({in, in + bytes, i});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& x, const Span& y) { return x.begin < y.begin; });
  // Sweep keeping the span reaching furthest: any two spans of different tensors
  // that overlap are caught when the later-starting one is visited.
  const Span* reach = nullptr;
  for (const auto& sp : spans) {
    if (reach && sp.begin < reach->end && sp.tensor != reach->tensor) return true;
    if (!reach || sp.end > reach->end) reach = &sp;
  }
  return false;
}

// float32/float64: the backend applies the factor as it finishes each element; the
// other dtypes get it after the reduction.
bool BackendScales(DataType dtype) {
  return dtype == DataType::kFloat32 || dtype == DataType::kFloat64;
}

// Reduces prepared segments (inputs prescaled, neutral values in place) and applies
// the post factor.
Status ReducePrepared(const ReduceArgs& a, const std::vector<Segment>& segments,
                      const SegmentReduce& reduce) {
  const double post = PostFactor(a);
  const bool in_backend = BackendScales(a.dtype);
  Status s = reduce(segments, in_backend ? post : 1.0);
  if (!s.ok()) return s;
  if (!in_backend && post != 1.0) {
    for (const auto& seg : segments)
      ScaleBuffer(seg.data, static_cast<size_t>(seg.count), a.dtype, post);
  }
  return Status::OK();
}

// Puts tensor t's contribution at dst: its input prescaled, or, for a rank that has
// joined, zeros (Horovod's join tensor, whatever the op).
void Prepare(const ReduceArgs& a, const ReduceTensor& t, void* dst) {
  const size_t n = static_cast<size_t>(t.count);
  if (t.input == nullptr) {
    std::memset(dst, 0, n * DataTypeSize(a.dtype));
    return;
  }
  if (t.input != dst) std::memmove(dst, t.input, n * DataTypeSize(a.dtype));
  ScaleBuffer(dst, n, a.dtype, a.prescale);
}

// The overlapping case: every input read into one packed buffer, reduced, copied out.
Status Packed(const ReduceArgs& a, const SegmentReduce& reduce, HostReduceScratch* scratch) {
  const size_t dsize = DataTypeSize(a.dtype);
  int64_t total = 0;
  for (const auto& t : a.tensors) total += t.count;
  std::vector<uint8_t>& packed = scratch->packed;
  if (packed.size() < static_cast<size_t>(total) * dsize) {
    packed.resize(static_cast<size_t>(total) * dsize);
  }
  size_t offset = 0;
  for (const auto& t : a.tensors) {
    Prepare(a, t, packed.data() + offset);
    offset += static_cast<size_t>(t.count) * dsize;
  }
  scratch->segments.assign(1, Segment{packed.data(), total});
  Status s = ReducePrepared(a, scratch->segments, reduce);
  if (!s.ok()) return s;
  offset = 0;
  for (const auto& t : a.tensors) {
    const size_t bytes = static_cast<size_t>(t.count) * dsize;
    if (t.output) std::memcpy(t.output, packed.data() + offset, bytes);
    offset += bytes;
  }
  return Status::OK();
}

}  // namespace

double PostFactor(const ReduceArgs& a) {
  return a.op == ReduceOp::kAverage
             ? a.postscale / static_cast<double>(std::max<int64_t>(1, a.ranks))
             : a.postscale;
}

Status HostAllreduce(const ReduceArgs& a, const SegmentReduce& reduce, HostReduceScratch* kept) {
  std::optional<HostReduceScratch> local;  // a one-off's (made only then: it reserves)
  HostReduceScratch* scratch = kept != nullptr ? kept : &local.emplace();
  if (Overlap(a, &scratch->spans)) return Packed(a, reduce, scratch);
  std::vector<Segment>& segments = scratch->segments;
  segments.clear();
  size_t joined = 0;  // tensors of a rank that has joined, each in its own scratch
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const ReduceTensor& t = a.tensors[i];
    void* dst = t.output;
    if (dst == nullptr) {
      if (scratch->neutral.size() <= joined) scratch->neutral.resize(joined + 1);
      std::vector<uint8_t>& neutral = scratch->neutral[joined++];
      neutral.resize(static_cast<size_t>(t.count) * DataTypeSize(a.dtype));
      dst = neutral.data();
    }
    Prepare(a, t, dst);
    segments.push_back(Segment{dst, t.count});
  }
  return ReducePrepared(a, segments, reduce);
}

}  // namespace spark_hvd

namespace spark_hvd {

int PairwiseTemps(int n) {
  int levels = 1;
  for (int p = PowerOfTwoFloor(std::max(n, 1)); p > 1; p /= 2) ++levels;
  return levels;
}

// y_i (the fold of x_i and x_(i+p)) is pushed on a stack of partial results, each at
// its level of the tree; two of one level combine into the lower one's place, the lower
// operand first: the same pairs, in the same order, as recursive doubling's rounds.
void PairwiseReduce(const char* const* operands, int n, size_t count, size_t elem, ReduceFn fn,
                    char* temps, char* out) {
  const size_t bytes = count * elem;
  const int p = PowerOfTwoFloor(n);
  struct Entry {
    const char* data;
    int level;
  };
  Entry stack[32];
  int depth = 0;
  auto temp = [&](int d) { return temps + static_cast<size_t>(d) * bytes; };
  for (int i = 0; i < p; ++i) {
    const char* y = operands[i];
    if (i + p < n) {
      std::memcpy(temp(depth), operands[i], bytes);
      fn(temp(depth), operands[i + p], count);
      y = temp(depth);
    }
    stack[depth++] = Entry{y, 0};
    while (depth >= 2 && stack[depth - 1].level == stack[depth - 2].level) {
      Entry& lower = stack[depth - 2];
      char* acc = temp(depth - 2);
      if (lower.data != acc) std::memcpy(acc, lower.data, bytes);
      fn(acc, stack[depth - 1].data, count);
      lower = Entry{acc, lower.level + 1};
      --depth;
    }
  }
  if (out != stack[0].data) std::memcpy(out, stack[0].data, bytes);
}

}  // namespace spark_hvd
