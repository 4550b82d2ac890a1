// The fake NCCL's arithmetic: reductions in every ncclDataType_t (see Reduce in
// fake_nccl_wire.h), with float16/bfloat16 converted by hand (round to nearest even).
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "fake_nccl_wire.h"

namespace shvd_fake {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t exp = (x >> 23) & 0xFFu, mant = x & 0x7FFFFFu;
  if (exp == 0xFF) return sign | 0x7C00u | (mant ? 0x200u : 0u);  // inf, quiet NaN
  const int e = int(exp) - 127 + 15;                              // the half's exponent
  if (e >= 0x1F) return sign | 0x7C00u;                           // overflow: inf
  if (e <= 0) {                                                   // subnormal or zero
    if (e < -10) return sign;
    const uint32_t m = mant | 0x800000u;
    const int shift = 14 - e;
    uint32_t h = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1u))) ++h;
    return uint16_t(sign | h);
  }
  uint32_t h = (uint32_t(e) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into inf: right
  return uint16_t(sign | h);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0) {
    float v = std::ldexp(float(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 0x1F) return BitsFloat(sign | 0x7F800000u | (mant << 13));
  return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t FloatToBfloat16(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((x >> 16) | 0x40u);  // quiet NaN
  return uint16_t((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

float Bfloat16ToFloat(uint16_t b) { return BitsFloat(uint32_t(b) << 16); }

// Per dtype: how an element is stored, the type arithmetic happens in, and the
// rounding back to the dtype after each step.
template <typename T>
struct Plain {
  using Stored = T;
  using Math = T;
  static Math Load(Stored s) { return s; }
  static Stored Store(Math m) { return m; }
};
template <uint16_t (*ToBits)(float), float (*FromBits)(uint16_t)>
struct Narrow {
  using Stored = uint16_t;
  using Math = float;
  static Math Load(Stored s) { return FromBits(s); }
  static Stored Store(Math m) { return ToBits(m); }
};
using Half = Narrow<FloatToHalf, HalfToFloat>;
using Bfloat16 = Narrow<FloatToBfloat16, Bfloat16ToFloat>;

template <typename Tr>
struct Arith {
  using M = typename Tr::Math;
  static M Round(M v) { return Tr::Load(Tr::Store(v)); }
  static M Add(M a, M b) {
    if constexpr (std::is_integral<M>::value)
      return M(uint64_t(a) + uint64_t(b));  // wraps
    else
      return Round(a + b);
  }
  static M Mul(M a, M b) {
    if constexpr (std::is_integral<M>::value)
      return M(uint64_t(a) * uint64_t(b));
    else
      return Round(a * b);
  }
};

template <typename Tr>
std::string ReduceAs(const OpDesc& d, const std::vector<const char*>& inputs,
                     const std::vector<uint64_t>& scalars) {
  using S = typename Tr::Stored;
  using M = typename Tr::Math;
  using A = Arith<Tr>;
  const size_t n = inputs.size();
  int red = d.red;
  std::vector<M> scale(n);
  if (red == kPreMulSum) {
    for (size_t r = 0; r < n; ++r) {
      S s;
      std::memcpy(&s, &scalars[r], sizeof s);
      scale[r] = Tr::Load(s);
    }
  } else if (red == ncclAvg && !std::is_integral<M>::value) {
    red = kPreMulSum;  // real NCCL: premultiply by (dtype)(1/n), then sum
    std::fill(scale.begin(), scale.end(), A::Round(M(1.0 / double(n))));
  }
  std::string out(d.count * sizeof(S), '\0');
  for (size_t i = 0; i < d.count; ++i) {
    M acc{};
    for (size_t r = 0; r < n; ++r) {
      S s;
      std::memcpy(&s, inputs[r] + i * sizeof(S), sizeof s);
      M x = Tr::Load(s);
      if (red == kPreMulSum) x = A::Mul(x, scale[r]);
      if (r == 0)
        acc = x;
      else if (red == ncclProd)
        acc = A::Mul(acc, x);
      else if (red == ncclMax)
        acc = std::max(acc, x);
      else if (red == ncclMin)
        acc = std::min(acc, x);
      else
        acc = A::Add(acc, x);  // ncclSum, ncclAvg, PreMulSum
    }
    if constexpr (std::is_integral<M>::value) {
      if (red == ncclAvg) acc = M(acc / M(n));
    }
    S s = Tr::Store(acc);
    std::memcpy(&out[i * sizeof(S)], &s, sizeof s);
  }
  return out;
}

}  // namespace

std::string Reduce(const OpDesc& d, const std::vector<const char*>& inputs,
                   const std::vector<uint64_t>& scalars) {
  switch (d.dtype) {
    case ncclInt8:
      return ReduceAs<Plain<int8_t>>(d, inputs, scalars);
    case ncclUint8:
      return ReduceAs<Plain<uint8_t>>(d, inputs, scalars);
    case ncclInt32:
      return ReduceAs<Plain<int32_t>>(d, inputs, scalars);
    case ncclUint32:
      return ReduceAs<Plain<uint32_t>>(d, inputs, scalars);
    case ncclInt64:
      return ReduceAs<Plain<int64_t>>(d, inputs, scalars);
    case ncclUint64:
      return ReduceAs<Plain<uint64_t>>(d, inputs, scalars);
    case ncclFloat16:
      return ReduceAs<Half>(d, inputs, scalars);
    case ncclFloat32:
      return ReduceAs<Plain<float>>(d, inputs, scalars);
    case ncclFloat64:
      return ReduceAs<Plain<double>>(d, inputs, scalars);
    case ncclBfloat16:
      return ReduceAs<Bfloat16>(d, inputs, scalars);
    default:
      return std::string();
  }
}

}  // namespace shvd_fake
