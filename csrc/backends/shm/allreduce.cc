// ShmCommunicator allreduce and reduce-scatter (the protocol: communicator.h). Every
// element is reduced in the order host_reduce.h defines (the one tcp uses), scaled
// once at the end, so results equal tcp's bit for bit.
#include <algorithm>
#include <cstring>

#include "backends/host_reduce.h"
#include "backends/shm/communicator.h"
#include "backends/shm/group.h"
#include "common/reduce.h"

namespace spark_hvd {
namespace {

// Elements are reduced in blocks of this many bytes held in an accumulator on the stack
// (in L1), then written out once: each input is read once, each output written once.
constexpr size_t kBlockBytes = 16 << 10;

// One reduction chain: acc = in[0], then acc = in[k] op acc (ring order, `reversed`) or
// acc op in[k] (direct order), over `n` elements; then scaled by `scale`. With `pairwise`
// (room for PairwiseTemps(m) blocks: a direct buffer among more than kDirectMaxRanks
// ranks) the operands combine in host_reduce.h's pairwise order instead, as tcp's
// recursive doubling combines them.
struct Chain {
  ReduceFn fn;
  DataType dtype;
  double scale;
  char* pairwise = nullptr;

  void Run(char* acc, const char* const* in, int m, size_t n) const {
    if (pairwise != nullptr) {
      PairwiseReduce(in, m, n, DataTypeSize(dtype), fn, pairwise, acc);
    } else {
      std::memcpy(acc, in[0], n * DataTypeSize(dtype));
      for (int k = 1; k < m; ++k) fn(acc, in[k], n);
    }
    if (scale != 1.0) ScaleBuffer(acc, n, dtype, scale);
  }
};

// Room for a pairwise chain among n ranks (null: rank order, n <= kDirectMaxRanks).
char* PairwiseRoom(std::vector<char>* room, int n) {
  if (n <= kDirectMaxRanks) return nullptr;
  const size_t bytes = static_cast<size_t>(PairwiseTemps(n)) * kBlockBytes;
  if (room->size() < bytes) room->resize(bytes);  // once per communicator
  return room->data();
}

// The ring chunk holding element e of a buffer of `count` elements among n ranks.
int ChunkOf(size_t e, size_t count, int n) {
  int c = static_cast<int>(std::min<size_t>(static_cast<size_t>(n - 1), e * n / count));
  while (c + 1 < n && RingChunkStart(count, c + 1, n) <= e) ++c;
  while (c > 0 && RingChunkStart(count, c, n) > e) --c;
  return c;
}

}  // namespace

Status ShmCommunicator::Allreduce(const ReduceArgs& args) {
  return HostAllreduce(
      args,
      [&](const std::vector<Segment>& segments, double scale) {
        return ReduceSegments(segments, args.dtype, args.op, scale);
      },
      &reduce_scratch_);
}

Status ShmCommunicator::ReduceSegments(const std::vector<Segment>& segments, DataType dtype,
                                       ReduceOp op, double scale) {
  if (!group_) {
    if (scale != 1.0) {
      for (const auto& s : segments)
        ScaleBuffer(s.data, static_cast<size_t>(s.count), dtype, scale);
    }
    return Status::OK();
  }
  const size_t elem = DataTypeSize(dtype);
  SegmentLayout& buf = layout_;  // kept: no allocation per op
  buf.Reset(segments, elem);
  const size_t count = buf.bytes() / elem;
  const bool direct = ReducesDirect(buf.bytes(), count, size());
  const size_t per_round = group_->slot_bytes() / elem;
  for (size_t a = 0; a < count; a += per_round) {
    const size_t b = std::min(count, a + per_round);
    Status s = direct ? DirectRound(buf, a, b, dtype, op, scale)
                      : SlicedRound(buf, count, a, b, dtype, op, scale);
    if (!s.ok()) return s;
  }
  return Status::OK();
}

// Elements [a, b): every member reduces all of them from every slot, in rank order.
Status ShmCommunicator::DirectRound(const SegmentLayout& buf, size_t a, size_t b, DataType dtype,
                                    ReduceOp op, double scale) {
  const size_t elem = DataTypeSize(dtype);
  uint64_t g;
  Status s = group_->Next("allreduce", &g);
  if (!s.ok()) return s;
  buf.CopyOut(a * elem, (b - a) * elem, group_->slot(rank_, g));
  group_->Post(shm::Counter::kStarted, g);
  s = group_->Wait(shm::Counter::kStarted, g, "allreduce");
  if (!s.ok()) return s;
  const int n = size();
  const Chain chain{GetReduceFn(dtype, op), dtype, scale, PairwiseRoom(&pairwise_, n)};
  alignas(64) char acc[kBlockBytes];
  std::vector<const char*>& in = in_;  // kept: no allocation per op
  in.resize(static_cast<size_t>(n));
  const size_t block = kBlockBytes / elem;
  for (size_t e = a; e < b; e += block) {
    const size_t len = std::min(block, b - e);
    for (int r = 0; r < n; ++r) in[r] = group_->slot(r, g) + (e - a) * elem;
    chain.Run(acc, in.data(), n, len);
    buf.CopyIn(e * elem, len * elem, acc);
  }
  return Status::OK();
}

// Elements [a, b) of a buffer of `count`: member j reduces the j-th piece in the ring's
// order, then every member copies the other pieces from their reducers' slots.
Status ShmCommunicator::SlicedRound(const SegmentLayout& buf, size_t count, size_t a, size_t b,
                                    DataType dtype, ReduceOp op, double scale) {
  const size_t elem = DataTypeSize(dtype);
  const int n = size();
  uint64_t g;
  Status s = group_->Next("allreduce", &g);
  if (!s.ok()) return s;
  char* mine = group_->slot(rank_, g);
  buf.CopyOut(a * elem, (b - a) * elem, mine);
  group_->Post(shm::Counter::kStarted, g);
  s = group_->Wait(shm::Counter::kStarted, g, "allreduce");
  if (!s.ok()) return s;
  auto piece = [&](int j) { return a + (b - a) * static_cast<size_t>(j) / static_cast<size_t>(n); };
  // Where tcp halves instead of running the ring (host_reduce.h), the pairwise order.
  const bool halving = ReducesByHalving(count * elem, count, n);
  const Chain chain = halving
                          ? Chain{GetReduceFn(dtype, op), dtype, scale, PairwiseRoom(&pairwise_, n)}
                          : Chain{GetReduceFnReversed(dtype, op), dtype, scale};
  alignas(64) char acc[kBlockBytes];
  std::vector<const char*>& in = in_;  // kept: no allocation per op
  in.resize(static_cast<size_t>(n));
  const size_t block = kBlockBytes / elem;
  for (size_t e = piece(rank_), end = piece(rank_ + 1); e < end;) {
    // Within one ring chunk: from its first rank around the ring (halving: rank order).
    const int c = halving ? 0 : ChunkOf(e, count, n);
    const size_t len = halving ? std::min(block, end - e)
                               : std::min({block, end - e, RingChunkStart(count, c + 1, n) - e});
    for (int k = 0; k < n; ++k) in[k] = group_->slot((c + k) % n, g) + (e - a) * elem;
    chain.Run(acc, in.data(), n, len);
    std::memcpy(mine + (e - a) * elem, acc, len * elem);
    buf.CopyIn(e * elem, len * elem, acc);
    e += len;
  }
  group_->Post(shm::Counter::kReduced, g);
  s = group_->Wait(shm::Counter::kReduced, g, "allreduce");
  if (!s.ok()) return s;
  for (int j = 0; j < n; ++j) {
    if (j == rank_ || piece(j + 1) == piece(j)) continue;
    buf.CopyIn(piece(j) * elem, (piece(j + 1) - piece(j)) * elem,
               group_->slot(j, g) + (piece(j) - a) * elem);
  }
  return Status::OK();
}

bool ShmCommunicator::ReducescatterBlocks(const ReduceArgs& args, int64_t block, void* out,
                                          Status* status) {
  if (!group_ || args.tensors.size() != 1) return false;
  const ReduceTensor& t = args.tensors[0];
  const size_t elem = DataTypeSize(args.dtype);
  const int n = size();
  const size_t count = static_cast<size_t>(t.count);
  // Direct and halving sizes reduce in rank (or pairwise) order, the ring's from the chunk.
  const bool direct =
      ReducesDirect(count * elem, count, n) || ReducesByHalving(count * elem, count, n);
  // The arithmetic of HostAllreduce: prescaled inputs (zeros for a joined rank),
  // float32/float64 scaled in the reduction's pass, the other dtypes after.
  const double post = PostFactor(args);
  const bool scale_in_pass = args.dtype == DataType::kFloat32 || args.dtype == DataType::kFloat64;
  const Chain chain{
      direct ? GetReduceFn(args.dtype, args.op) : GetReduceFnReversed(args.dtype, args.op),
      args.dtype, scale_in_pass ? post : 1.0, direct ? PairwiseRoom(&pairwise_, n) : nullptr};
  const size_t first = static_cast<size_t>(block) * static_cast<size_t>(rank_);
  const size_t last = first + static_cast<size_t>(block);
  const size_t per_round = group_->slot_bytes() / elem;
  alignas(64) char acc[kBlockBytes];
  std::vector<const char*>& in = in_;  // kept: no allocation per op
  in.resize(static_cast<size_t>(n));
  for (size_t a = 0; a < count; a += per_round) {
    const size_t b = std::min(count, a + per_round);
    uint64_t g;
    *status = group_->Next("reducescatter", &g);
    if (!status->ok()) return true;
    char* mine = group_->slot(rank_, g);
    if (t.input == nullptr) {
      std::memset(mine, 0, (b - a) * elem);
    } else {
      std::memcpy(mine, static_cast<const char*>(t.input) + a * elem, (b - a) * elem);
      ScaleBuffer(mine, b - a, args.dtype, args.prescale);
    }
    group_->Post(shm::Counter::kStarted, g);
    *status = group_->Wait(shm::Counter::kStarted, g, "reducescatter");
    if (!status->ok()) return true;
    // This rank's block is ring chunk rank_ (count = n * block), reduced from rank_ on.
    for (size_t e = std::max(a, first), end = std::min(b, last); e < end;) {
      const size_t len = std::min(kBlockBytes / elem, end - e);
      for (int k = 0; k < n; ++k) {
        in[k] = group_->slot(direct ? k : (rank_ + k) % n, g) + (e - a) * elem;
      }
      chain.Run(acc, in.data(), n, len);
      if (!scale_in_pass) ScaleBuffer(acc, len, args.dtype, post);
      std::memcpy(static_cast<char*>(out) + (e - first) * elem, acc, len * elem);
      e += len;
    }
  }
  *status = Status::OK();
  return true;
}

Status ShmCommunicator::ReduceScatterPieces(const SegmentLayout& buf, size_t count, DataType dtype,
                                            ReduceOp op) {
  return PieceRounds(buf, count, dtype, op, true);
}

Status ShmCommunicator::AllgatherPieces(const SegmentLayout& buf, size_t count, DataType dtype) {
  return PieceRounds(buf, count, dtype, ReduceOp::kSum, false);
}

Status ShmCommunicator::PieceRounds(const SegmentLayout& buf, size_t count, DataType dtype,
                                    ReduceOp op, bool reduce) {
  if (!group_) return Status::OK();  // one member: its piece is the whole buffer
  const size_t elem = DataTypeSize(dtype);
  const int n = size();
  const size_t sub = group_->slot_bytes() / elem / static_cast<size_t>(n);
  if (sub == 0) {
    return Status::InvalidArgument(
        "SPARK_HVD_SHM_SLOT_BYTES=" + std::to_string(group_->slot_bytes()) + " is too small for " +
        std::to_string(n) + " ranks on a host: raise it");
  }
  auto piece = [&](int j) { return count * static_cast<size_t>(j) / static_cast<size_t>(n); };
  auto part = [&](int j, size_t r0) {  // piece j's elements in the round starting at r0
    const size_t len = piece(j + 1) - piece(j);
    return r0 < len ? std::min(sub, len - r0) : 0;
  };
  size_t longest = 0;
  for (int j = 0; j < n; ++j) longest = std::max(longest, piece(j + 1) - piece(j));
  const char* what = reduce ? "allreduce (within the host)" : "allgather (within the host)";
  const Chain chain{GetReduceFn(dtype, op), dtype, 1.0};
  alignas(64) char acc[kBlockBytes];
  std::vector<const char*>& in = in_;  // kept: no allocation per op
  in.resize(static_cast<size_t>(n));
  for (size_t r0 = 0; r0 < longest; r0 += sub) {
    uint64_t g;
    Status s = group_->Next(what, &g);
    if (!s.ok()) return s;
    char* mine = group_->slot(rank_, g);
    for (int j = 0; j < n; ++j) {
      if ((reduce || j == rank_) && part(j, r0) > 0) {
        buf.CopyOut((piece(j) + r0) * elem, part(j, r0) * elem, mine + j * sub * elem);
      }
    }
    group_->Post(shm::Counter::kStarted, g);
    s = group_->Wait(shm::Counter::kStarted, g, what);
    if (!s.ok()) return s;
    if (reduce) {
      const size_t len = part(rank_, r0), block = kBlockBytes / elem;
      for (size_t off = 0; off < len; off += block) {
        const size_t m = std::min(block, len - off);
        for (int k = 0; k < n; ++k) in[k] = group_->slot(k, g) + (rank_ * sub + off) * elem;
        chain.Run(acc, in.data(), n, m);
        buf.CopyIn((piece(rank_) + r0 + off) * elem, m * elem, acc);
      }
      continue;
    }
    for (int j = 0; j < n; ++j) {
      if (j != rank_ && part(j, r0) > 0) {
        buf.CopyIn((piece(j) + r0) * elem, part(j, r0) * elem, group_->slot(j, g) + j * sub * elem);
      }
    }
  }
  return Status::OK();
}

}  // namespace spark_hvd
