// Fusion planning (protocol step 6): adjacent ready allreduces that agree on
// everything but their tensors become one response, up to a byte threshold.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/message.h"

namespace spark_hvd {

// Merges runs of compatible allreduce responses (same dtype, op, scale factors,
// process set, device and contributing ranks; no error) while their total stays
// within threshold_bytes (<= 0: no fusion). Order is kept. Fused Adasum tensors keep
// their own coefficients (host_adasum.h). *out is refilled: its kept responses take copies
// (no allocation once they have held as many tensors, as large).
void FuseResponses(const ResponseList& ready, int64_t threshold_bytes, ResponseList* out);

}  // namespace spark_hvd
