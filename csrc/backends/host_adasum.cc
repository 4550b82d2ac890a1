#include "backends/host_adasum.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "common/half.h"
#include "common/reduce.h"

namespace spark_hvd {
namespace {

// A squared norm below this leaves its vector's coefficient at 1 (Horovod's guard
// against dividing by a zero vector).
constexpr double kMinNormSq = 1e-8;

// How a dtype's elements are read and computed: Calc is the type of the combination.
struct F64 {
  using Storage = double;
  using Calc = double;
  static double Load(double v) { return v; }
  static double Store(double v) { return v; }
};
struct F32 {
  using Storage = float;
  using Calc = double;  // the double coefficients times float32 values, as Horovod's
  static float Load(float v) { return v; }
  static float Store(double v) { return static_cast<float>(v); }
};
struct F16 {
  using Storage = uint16_t;
  using Calc = float;
  static float Load(uint16_t v) { return HalfToFloat(v); }
  static uint16_t Store(float v) { return FloatToHalf(v); }
};
struct BF16 {
  using Storage = uint16_t;
  using Calc = float;
  static float Load(uint16_t v) { return BFloat16ToFloat(v); }
  static uint16_t Store(float v) { return FloatToBFloat16(v); }
};

// out[0] += mine.theirs, out[1] += |mine|^2, out[2] += |theirs|^2, over n elements.
template <typename K>
void DotsTyped(const void* mine, const void* theirs, int64_t n, double* out) {
  const auto* a = static_cast<const typename K::Storage*>(mine);
  const auto* b = static_cast<const typename K::Storage*>(theirs);
  double dot = 0, aa = 0, bb = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(K::Load(a[i]));
    const double y = static_cast<double>(K::Load(b[i]));
    dot += x * y;
    aa += x * x;
    bb += y * y;
  }
  out[0] += dot;
  out[1] += aa;
  out[2] += bb;
}

// mine[i] = cm * mine[i] + ct * theirs[i].
template <typename K>
void CombineTyped(void* mine, const void* theirs, int64_t n, double cm, double ct) {
  using C = typename K::Calc;
  auto* a = static_cast<typename K::Storage*>(mine);
  const auto* b = static_cast<const typename K::Storage*>(theirs);
  const C fm = static_cast<C>(cm), ft = static_cast<C>(ct);
  for (int64_t i = 0; i < n; ++i) {
    a[i] = K::Store(fm * static_cast<C>(K::Load(a[i])) + ft * static_cast<C>(K::Load(b[i])));
  }
}

struct Kernels {
  void (*dots)(const void*, const void*, int64_t, double*);
  void (*combine)(void*, const void*, int64_t, double, double);
};

template <typename K>
Kernels KernelsOf() {
  return {&DotsTyped<K>, &CombineTyped<K>};
}

bool KernelsFor(DataType dtype, Kernels* k) {
  switch (dtype) {
    case DataType::kFloat64:
      *k = KernelsOf<F64>();
      return true;
    case DataType::kFloat32:
      *k = KernelsOf<F32>();
      return true;
    case DataType::kFloat16:
      *k = KernelsOf<F16>();
      return true;
    case DataType::kBFloat16:
      *k = KernelsOf<BF16>();
      return true;
    default:
      return false;
  }
}

// Sends send_bytes to peer and receives recv_bytes from it: an Alltoallv in which
// every other rank gets nothing. Every rank calls it at the same step, each with its
// own partner (the pairing is symmetric). tcp moves bytes only between the pair.
Status PairExchange(Communicator* comm, int peer, const void* send, int64_t send_bytes, void* recv,
                    int64_t recv_bytes) {
  std::vector<int64_t> s(static_cast<size_t>(comm->size()), 0);
  std::vector<int64_t> r(s.size(), 0);
  s[static_cast<size_t>(peer)] = send_bytes;
  r[static_cast<size_t>(peer)] = recv_bytes;
  return comm->Alltoallv(send, s, recv, r);
}

struct Range {
  int64_t lo, hi;
  int64_t size() const { return hi - lo; }
};

// The vector-halving, distance-doubling Adasum of w (n elements; tensor i is
// [offsets[i], offsets[i + 1])), in place (steps 2-5 of host_adasum.h).
class Vhdd {
 public:
  Vhdd(Communicator* comm, const Kernels& k, size_t dsize, char* w,
       const std::vector<int64_t>& offsets)
      : comm_(comm), k_(k), dsize_(dsize), w_(w), offsets_(offsets) {}

  Status Run() {
    const int rank = comm_->rank(), size = comm_->size();
    const int64_t n = offsets_.back();
    std::vector<char> theirs(static_cast<size_t>((n + 1) / 2) * dsize_);
    std::vector<Range> held;  // the range held before each level, to undo them
    Range mine{0, n};
    for (int d = 1; d < size; d <<= 1) {
      const bool lower = (rank & d) == 0;
      const int64_t mid = mine.lo + mine.size() / 2;
      const Range keep = lower ? Range{mine.lo, mid} : Range{mid, mine.hi};
      const Range give = lower ? Range{mid, mine.hi} : Range{mine.lo, mid};
      Status s =
          PairExchange(comm_, rank ^ d, At(give.lo), Bytes(give), theirs.data(), Bytes(keep));
      if (!s.ok()) return s;
      held.push_back(mine);
      mine = keep;
      std::vector<double> sums;
      s = BlockSums(mine, theirs.data(), lower, d, &sums);
      if (!s.ok()) return s;
      Combine(mine, theirs.data(), lower, sums);
    }
    for (int d = size / 2; d >= 1; d >>= 1) {
      const Range whole = held.back();
      held.pop_back();
      const Range other = (rank & d) == 0 ? Range{mine.hi, whole.hi} : Range{whole.lo, mine.lo};
      Status s =
          PairExchange(comm_, rank ^ d, At(mine.lo), Bytes(mine), At(other.lo), Bytes(other));
      if (!s.ok()) return s;
      mine = whole;
    }
    return Status::OK();
  }

 private:
  char* At(int64_t element) const { return w_ + static_cast<size_t>(element) * dsize_; }
  int64_t Bytes(const Range& r) const { return r.size() * static_cast<int64_t>(dsize_); }

  // The part of tensor i inside r (empty: lo >= hi).
  Range Part(size_t i, const Range& r) const {
    return {std::max(r.lo, offsets_[i]), std::min(r.hi, offsets_[i + 1])};
  }

  // Step 3: per tensor (a.b, |a|^2, |b|^2) over the 2d ranks of this rank's block.
  Status BlockSums(const Range& mine, const char* theirs, bool lower, int d,
                   std::vector<double>* sums) {
    const size_t tensors = offsets_.size() - 1;
    std::vector<double> own(3 * tensors, 0.0);
    for (size_t i = 0; i < tensors; ++i) {
      const Range p = Part(i, mine);
      if (p.lo >= p.hi) continue;
      // dots: mine.theirs, |mine|^2, |theirs|^2; the block sums a (lower) and b (upper).
      double dots[3] = {0, 0, 0};
      k_.dots(At(p.lo), theirs + static_cast<size_t>(p.lo - mine.lo) * dsize_, p.size(), dots);
      own[3 * i] = dots[0];
      own[3 * i + 1] = lower ? dots[1] : dots[2];
      own[3 * i + 2] = lower ? dots[2] : dots[1];
    }
    std::vector<double> peer(own.size());
    const int64_t bytes = static_cast<int64_t>(own.size() * sizeof(double));
    for (int k = 1; k <= d; k <<= 1) {
      Status s = PairExchange(comm_, comm_->rank() ^ k, own.data(), bytes, peer.data(), bytes);
      if (!s.ok()) return s;
      for (size_t j = 0; j < own.size(); ++j) own[j] += peer[j];
    }
    *sums = std::move(own);
    return Status::OK();
  }

  // Step 4: W = ca a + cb b on this rank's part, tensor by tensor.
  void Combine(const Range& mine, const char* theirs, bool lower, const std::vector<double>& sums) {
    for (size_t i = 0; i + 1 < offsets_.size(); ++i) {
      const Range p = Part(i, mine);
      if (p.lo >= p.hi) continue;
      const double dot = sums[3 * i], aa = sums[3 * i + 1], bb = sums[3 * i + 2];
      const double ca = aa >= kMinNormSq ? 1.0 - dot / (2.0 * aa) : 1.0;
      const double cb = bb >= kMinNormSq ? 1.0 - dot / (2.0 * bb) : 1.0;
      k_.combine(At(p.lo), theirs + static_cast<size_t>(p.lo - mine.lo) * dsize_, p.size(),
                 lower ? ca : cb, lower ? cb : ca);
    }
  }

  Communicator* comm_;
  Kernels k_;
  size_t dsize_;
  char* w_;
  const std::vector<int64_t>& offsets_;
};

}  // namespace

bool AdasumDataType(DataType dtype) {
  Kernels k;
  return KernelsFor(dtype, &k);
}

Status HostAdasum(const ReduceArgs& a, Communicator* comm) {
  Kernels k;
  if (!KernelsFor(a.dtype, &k)) {
    return Status::InvalidArgument(std::string("op=Adasum needs a floating-point tensor, got ") +
                                   DataTypeName(a.dtype));
  }
  const int size = comm->size();
  if ((size & (size - 1)) != 0) {
    return Status::InvalidArgument("op=Adasum needs a power-of-two number of ranks, got " +
                                   std::to_string(size));
  }
  const size_t dsize = DataTypeSize(a.dtype);
  std::vector<int64_t> offsets{0};
  for (const auto& t : a.tensors) offsets.push_back(offsets.back() + t.count);
  const int64_t n = offsets.back();
  // Step 1: W is the lone tensor's output, else a packed copy (read in full before
  // any output is written, so tensors that share memory are safe).
  const bool lone = a.tensors.size() == 1 && a.tensors[0].output != nullptr;
  std::vector<char> packed(lone ? 0 : static_cast<size_t>(n) * dsize);
  char* w = lone ? static_cast<char*>(a.tensors[0].output) : packed.data();
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const ReduceTensor& t = a.tensors[i];
    char* dst = w + static_cast<size_t>(offsets[i]) * dsize;
    const size_t bytes = static_cast<size_t>(t.count) * dsize;
    if (t.input == nullptr) {
      std::memset(dst, 0, bytes);
    } else {
      if (t.input != dst && bytes > 0) std::memmove(dst, t.input, bytes);
      ScaleBuffer(dst, static_cast<size_t>(t.count), a.dtype, a.prescale);
    }
  }
  if (size > 1 && n > 0) {
    Status s = Vhdd(comm, k, dsize, w, offsets).Run();
    if (!s.ok()) return s;
  }
  // Step 6.
  ScaleBuffer(w, static_cast<size_t>(n), a.dtype, a.postscale);
  if (!lone) {
    for (size_t i = 0; i < a.tensors.size(); ++i) {
      const ReduceTensor& t = a.tensors[i];
      if (t.output != nullptr && t.count > 0) {
        std::memcpy(t.output, w + static_cast<size_t>(offsets[i]) * dsize,
                    static_cast<size_t>(t.count) * dsize);
      }
    }
  }
  return Status::OK();
}

}  // namespace spark_hvd
