#include "common/reduce.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/half.h"

namespace spark_hvd {
namespace {

// Arithmetic storage types reduce directly.
template <typename T>
struct Plain {
  using Storage = T;
  static T Load(T v) { return v; }
  static T Store(T v) { return v; }
};
// Half types reduce in float32 and round back.
struct Half {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return HalfToFloat(v); }
  static uint16_t Store(float v) { return FloatToHalf(v); }
};
struct BHalf {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return BFloat16ToFloat(v); }
  static uint16_t Store(float v) { return FloatToBFloat16(v); }
};

struct OpSum {
  template <typename V>
  static V Apply(V a, V b) {
    return a + b;
  }
};
struct OpProd {
  template <typename V>
  static V Apply(V a, V b) {
    return a * b;
  }
};
struct OpMin {
  template <typename V>
  static V Apply(V a, V b) {
    return b < a ? b : a;
  }
};
struct OpMax {
  template <typename V>
  static V Apply(V a, V b) {
    return a < b ? b : a;
  }
};

template <typename Conv, typename Op>
void Kernel(void* xv, const void* yv, size_t n) {
  using S = typename Conv::Storage;
  S* x = static_cast<S*>(xv);
  const S* y = static_cast<const S*>(yv);
  for (size_t i = 0; i < n; ++i) {
    x[i] = static_cast<S>(Conv::Store(Op::Apply(Conv::Load(x[i]), Conv::Load(y[i]))));
  }
}

// Op with its operands swapped: Kernel<Conv, Swapped<Op>> computes x = op(y, x).
template <typename Op>
struct Swapped {
  template <typename V>
  static V Apply(V a, V b) {
    return Op::Apply(b, a);
  }
};

// bool: Sum/Max are logical or, Product/Min logical and.
void BoolOr(void* xv, const void* yv, size_t n) {
  auto* x = static_cast<uint8_t*>(xv);
  auto* y = static_cast<const uint8_t*>(yv);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<uint8_t>((x[i] | y[i]) != 0);
}
void BoolAnd(void* xv, const void* yv, size_t n) {
  auto* x = static_cast<uint8_t*>(xv);
  auto* y = static_cast<const uint8_t*>(yv);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<uint8_t>(x[i] != 0 && y[i] != 0);
}

// W<Op> wraps an op (identity, or Swapped for the reversed kernels).
template <typename Op>
struct Same {
  template <typename V>
  static V Apply(V a, V b) {
    return Op::Apply(a, b);
  }
};

template <typename Conv, template <typename> class W = Same>
ReduceFn ForOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage:
    case ReduceOp::kAdasum:
      return &Kernel<Conv, W<OpSum>>;
    case ReduceOp::kProduct:
      return &Kernel<Conv, W<OpProd>>;
    case ReduceOp::kMin:
      return &Kernel<Conv, W<OpMin>>;
    case ReduceOp::kMax:
      return &Kernel<Conv, W<OpMax>>;
  }
  return &Kernel<Conv, W<OpSum>>;
}

template <template <typename> class W>
ReduceFn ForDtype(DataType dtype, ReduceOp op) {
  switch (dtype) {
    case DataType::kUInt8:
      return ForOp<Plain<uint8_t>, W>(op);
    case DataType::kInt8:
      return ForOp<Plain<int8_t>, W>(op);
    case DataType::kInt16:
      return ForOp<Plain<int16_t>, W>(op);
    case DataType::kInt32:
      return ForOp<Plain<int32_t>, W>(op);
    case DataType::kInt64:
      return ForOp<Plain<int64_t>, W>(op);
    case DataType::kFloat16:
      return ForOp<Half, W>(op);
    case DataType::kBFloat16:
      return ForOp<BHalf, W>(op);
    case DataType::kFloat32:
      return ForOp<Plain<float>, W>(op);
    case DataType::kFloat64:
      return ForOp<Plain<double>, W>(op);
    case DataType::kBool:  // symmetric either way round
      return (op == ReduceOp::kProduct || op == ReduceOp::kMin) ? &BoolAnd : &BoolOr;
  }
  return &Kernel<Plain<float>, W<OpSum>>;
}

// Horovod's arithmetic, bit for bit: float32 multiplies by the factor rounded to float32,
// float64 by the factor; integers go through double and are truncated.
template <typename T>
void ScaleTyped(void* xv, size_t n, double factor) {
  T* x = static_cast<T*>(xv);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<T>(static_cast<double>(x[i]) * factor);
}

template <>
void ScaleTyped<float>(void* xv, size_t n, double factor) {
  float* x = static_cast<float*>(xv);
  const float f = static_cast<float>(factor);
  for (size_t i = 0; i < n; ++i) x[i] = f * x[i];
}

template <typename Conv>
void ScaleHalf(void* xv, size_t n, double factor) {
  auto* x = static_cast<uint16_t*>(xv);
  const float f = static_cast<float>(factor);
  for (size_t i = 0; i < n; ++i) x[i] = Conv::Store(Conv::Load(x[i]) * f);
}

}  // namespace

ReduceFn GetReduceFn(DataType dtype, ReduceOp op) { return ForDtype<Same>(dtype, op); }

ReduceFn GetReduceFnReversed(DataType dtype, ReduceOp op) { return ForDtype<Swapped>(dtype, op); }

void ScaleBuffer(void* x, size_t n, DataType dtype, double factor) {
  if (factor == 1.0) return;
  switch (dtype) {
    case DataType::kUInt8:
      ScaleTyped<uint8_t>(x, n, factor);
      return;
    case DataType::kInt8:
      ScaleTyped<int8_t>(x, n, factor);
      return;
    case DataType::kInt16:
      ScaleTyped<int16_t>(x, n, factor);
      return;
    case DataType::kInt32:
      ScaleTyped<int32_t>(x, n, factor);
      return;
    case DataType::kInt64:
      ScaleTyped<int64_t>(x, n, factor);
      return;
    case DataType::kFloat16:
      ScaleHalf<Half>(x, n, factor);
      return;
    case DataType::kBFloat16:
      ScaleHalf<BHalf>(x, n, factor);
      return;
    case DataType::kFloat32:
      ScaleTyped<float>(x, n, factor);
      return;
    case DataType::kFloat64:
      ScaleTyped<double>(x, n, factor);
      return;
    case DataType::kBool:
      return;
  }
}

template <typename T>
void ScaleCopyTyped(void* dv, const void* sv, size_t n, double factor) {
  T* d = static_cast<T*>(dv);
  const T* x = static_cast<const T*>(sv);
  const T f = static_cast<T>(factor);  // as ScaleTyped: float32 scales by a float32 factor
  for (size_t i = 0; i < n; ++i) d[i] = f * x[i];
}

bool ScaleCopy(void* dst, const void* src, size_t n, DataType dtype, double factor) {
  switch (dtype) {
    case DataType::kFloat32:
      ScaleCopyTyped<float>(dst, src, n, factor);
      return true;
    case DataType::kFloat64:
      ScaleCopyTyped<double>(dst, src, n, factor);
      return true;
    default:
      return false;
  }
}

}  // namespace spark_hvd
