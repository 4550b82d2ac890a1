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

std::vector<Response> FuseResponses(std::vector<Response> ready, int64_t threshold_bytes) {
  std::vector<Response> out;
  int64_t bytes = 0;  // of out.back()
  for (auto& r : ready) {
    const int64_t rb = r.TotalElements() * static_cast<int64_t>(DataTypeSize(r.dtype));
    if (!out.empty() && threshold_bytes > 0 && Fusable(r) && Fusable(out.back()) &&
        SameKind(out.back(), r) && bytes + rb <= threshold_bytes) {
      for (auto& t : r.tensors) out.back().tensors.push_back(std::move(t));
      bytes += rb;
      continue;
    }
    bytes = rb;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace spark_hvd
