// Elementwise kernels used by every CPU backend: reductions, scaling, neutral fill.
#pragma once

#include <cstddef>

#include "common/types.h"

namespace spark_hvd {

// x[i] = op(x[i], y[i]). Average reduces as Sum (the division happens once, after).
using ReduceFn = void (*)(void* x, const void* y, size_t n);

// The kernel for (dtype, op); never null for a valid pair (Adasum -> Sum kernel).
ReduceFn GetReduceFn(DataType dtype, ReduceOp op);

inline void ReduceInto(void* x, const void* y, size_t n, DataType dtype, ReduceOp op) {
  GetReduceFn(dtype, op)(x, y, n);
}

// x[i] *= factor (integers: truncated toward zero). No-op for factor == 1.
void ScaleBuffer(void* x, size_t n, DataType dtype, double factor);

// x[i] /= divisor: exact integer division for integer types, 1/divisor multiply for floats.
void DivideBuffer(void* x, size_t n, DataType dtype, int64_t divisor);
// dst = src * factor for float32/float64, element for element as ScaleBuffer
// computes it (one pass instead of a copy plus a scale). Other dtypes: false, and
// nothing is written.
bool ScaleCopy(void* dst, const void* src, size_t n, DataType dtype, double factor);

// Fill with op's identity (Sum/Average: 0, Product: 1, Min: max value, Max: lowest value).
void FillNeutral(void* x, size_t n, DataType dtype, ReduceOp op);

}  // namespace spark_hvd
