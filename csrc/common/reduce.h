// Elementwise kernels used by every CPU backend: reductions, scaling, neutral fill.
#pragma once

#include <cstddef>

#include "common/types.h"

namespace spark_hvd {

// x[i] = op(x[i], y[i]). Average reduces as Sum (the division happens once, after).
using ReduceFn = void (*)(void* x, const void* y, size_t n);

// The kernel for (dtype, op); never null for a valid pair (Adasum -> Sum kernel).
ReduceFn GetReduceFn(DataType dtype, ReduceOp op);

// x[i] = op(y[i], x[i]): the operands the other way round, which differs from
// GetReduceFn for Min/Max on signed zeros and NaNs (and NaN payloads of the others).
// The tcp ring's order, where the partial result arriving is the right operand.
ReduceFn GetReduceFnReversed(DataType dtype, ReduceOp op);

// x[i] *= factor, as Horovod computes it: float32 by the factor rounded to float32,
// float16/bfloat16 in float32, integers through double, truncated toward zero.
// No-op for factor == 1.
void ScaleBuffer(void* x, size_t n, DataType dtype, double factor);

// dst = src * factor for float32/float64, element for element as ScaleBuffer
// computes it (one pass instead of a copy plus a scale). Other dtypes: false, and
// nothing is written.
bool ScaleCopy(void* dst, const void* src, size_t n, DataType dtype, double factor);

}  // namespace spark_hvd
