#include "engine/fusion.h"

namespace spark_hvd {
namespace {

bool Fusable(const Response& r) { return r.op == OpType::kAllreduce && r.error == StatusCode::kOk; }

bool SameKind(const Response& a, const Response& b) {
  return a.dtype == b.dtype && a.reduce_op == b.reduce_op && a.prescale == b.prescale &&
         a.postscale == b.postscale && a.process_set == b.process_set && a.device == b.device &&
         a.active == b.active;
}

}  // namespace

void FuseResponses(const ResponseList& ready, int64_t threshold_bytes, ResponseList* out) {
  out->clear();
  int64_t bytes = 0;  // of out->back()
  for (const auto& r : ready) {
    const int64_t rb = r.TotalElements() * static_cast<int64_t>(DataTypeSize(r.dtype));
    if (!out->empty() && threshold_bytes > 0 && Fusable(r) && Fusable(out->back()) &&
        SameKind(out->back(), r) && bytes + rb <= threshold_bytes) {
      for (const auto& t : r.tensors) out->back().tensors.push_back(t);
      bytes += rb;
      continue;
    }
    bytes = rb;
    out->push_back(r);  // copied into a kept response (moving would hand its buffers away)
  }
}

}  // namespace spark_hvd
