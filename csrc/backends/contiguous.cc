#include "backends/contiguous.h"

#include <algorithm>
#include <cstring>

#include "common/env.h"
#include "common/reduce.h"

namespace spark_hvd {

Status FusionBuffer::Allreduce(
    const std::vector<Segment>& segments, DataType dtype, double scale, int64_t direct_min_bytes,
    const std::function<int64_t(int64_t)>& round_up,
    const std::function<Status(void* buf, int64_t count, bool stable)>& reduce) {
  const size_t dsize = DataTypeSize(dtype);
  if (segments.size() == 1 && segments[0].count * static_cast<int64_t>(dsize) >= direct_min_bytes) {
    const Segment& s = segments[0];
    Status st = reduce(s.data, s.count, /*stable=*/false);
    if (st.ok() && scale != 1.0) ScaleBuffer(s.data, static_cast<size_t>(s.count), dtype, scale);
    return st;
  }
  int64_t total = 0;
  for (const auto& s : segments) total += s.count;
  const int64_t padded = std::max(total, round_up ? round_up(total) : total);
  const size_t bytes = static_cast<size_t>(padded) * dsize;
  if (buffer_.size() < bytes) {
    // Allocated once at the fusion threshold, so the address stays put across steps.
    buffer_.resize(std::max(bytes, static_cast<size_t>(env::FusionThresholdBytes())));
  }
  uint8_t* p = buffer_.data();
  for (const auto& s : segments) {
    std::memcpy(p, s.data, static_cast<size_t>(s.count) * dsize);
    p += static_cast<size_t>(s.count) * dsize;
  }
  // Padding: zeros on every rank (never read back, but keeps every op well defined).
  std::memset(p, 0, static_cast<size_t>(padded - total) * dsize);
  Status st = reduce(buffer_.data(), padded, /*stable=*/true);
  if (!st.ok()) return st;
  p = buffer_.data();
  for (const auto& s : segments) {
    const size_t n = static_cast<size_t>(s.count);
    if (scale != 1.0) {
      ScaleCopy(s.data, p, n, dtype, scale);
    } else {
      std::memcpy(s.data, p, n * dsize);
    }
    p += n * dsize;
  }
  return Status::OK();
}

}  // namespace spark_hvd
