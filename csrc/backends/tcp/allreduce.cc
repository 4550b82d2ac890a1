// TcpMesh allreduce: for small buffers direct (one round trip) among a few ranks and
// recursive doubling among more, a pipelined ring for larger ones, all over the tensors'
// own memory (no fusion buffer); and the control plane's AllreduceFixed.
#include <poll.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>

#include "backends/host_reduce.h"
#include "backends/layout.h"
#include "backends/tcp/mesh.h"
#include "common/reduce.h"
#include "common/traffic.h"
#include "net/socket.h"

namespace spark_hvd {
namespace {

using net::Clock;

// The reduce-scatter receives into a scratch ring of this size and reduces slices
// of at least kReduceSlice bytes (or what is left of a step) as they arrive.
constexpr size_t kScratchBytes = 4 << 20;
constexpr size_t kReduceSlice = 64 << 10;

}  // namespace

Status TcpMesh::Allreduce(const std::vector<Segment>& segments, DataType dtype, ReduceOp op,
                          double scale) {
  if (!broken_.ok()) return broken_;
  const size_t elem = DataTypeSize(dtype);
  SegmentLayout& buf = layout_;  // kept: no allocation per op
  buf.Reset(segments, elem);
  if (buf.bytes() == 0) return Status::OK();
  const size_t count = buf.bytes() / elem;
  // Small buffers go direct (one round trip, every rank receives everything); larger
  // ones take the ring (2 (n - 1) steps, each moving 1/n of the buffer). Both reduce
  // in the order host_reduce.h defines.
  if (ReducesDirect(buf.bytes(), count, size_)) {
    return size_ > kDirectMaxRanks ? PairwiseAllreduce(buf, dtype, op, scale)
                                   : DirectAllreduce(buf, dtype, op, scale);
  }
  if (ReducesByHalving(buf.bytes(), count, size_)) return HalvingAllreduce(buf, dtype, op, scale);
  return RingAllreduce(buf, dtype, op, scale);
}

// One step of the halving allreduce, streamed: sends buf[send_off, + send_len) to `to`
// while receiving recv_len bytes from `from` for buf[recv_off, ...): reduced into it
// slice by slice as they land in the scratch ring (the lower rank's operand first), or,
// without `reduce`, received straight into it. The two ranges never overlap.
Status TcpMesh::StreamStep(const SegmentLayout& buf, int to, size_t send_off, size_t send_len,
                           int from, size_t recv_off, size_t recv_len, bool reduce, bool mine_lower,
                           DataType dtype, ReduceOp op) {
  const size_t elem = DataTypeSize(dtype);
  const size_t ring = std::min(kScratchBytes, std::max(recv_len, elem));
  if (reduce) scratch_.resize(std::max(scratch_.size(), ring));
  char* scratch = scratch_.data();
  ReduceFn fn = mine_lower ? GetReduceFn(dtype, op) : GetReduceFnReversed(dtype, op);
  if (send_len > 0) CountMessage(TrafficSender::kTcp, static_cast<int64_t>(send_len));
  size_t sent = 0, got = 0, done = 0;
  auto last_progress = Clock::now();
  iovec iov[SegmentLayout::kMaxIov];
  Status error;
  auto reduce_ready = [&](bool force) {
    size_t avail = (got - done) / elem * elem;
    if (avail == 0 || (!force && avail < kReduceSlice && got < recv_len)) return;
    while (avail > 0) {
      const size_t at = done % ring;
      const size_t len = std::min(avail, ring - at);
      const char* in = scratch + at;
      buf.Pieces(recv_off + done, len, [&](char* p, size_t m) {
        fn(p, in, m / elem);
        in += m;
      });
      done += len;
      avail -= len;
    }
  };
  while (sent < send_len || done < recv_len) {
    bool progress = false;
    while (sent < send_len) {
      const int k = buf.Iov(send_off + sent, std::min(send_len - sent, kMaxIo), iov);
      ssize_t w = Move(to, true, iov, k, "allreduce", &error);
      if (w < 0) return error;
      if (w == 0) break;
      sent += static_cast<size_t>(w);
      progress = true;
    }
    while (got < recv_len) {
      ssize_t r;
      if (reduce) {
        const size_t at = got % ring;
        const size_t room = std::min({ring - at, ring - (got - done), recv_len - got});
        if (room == 0) {
          reduce_ready(true);
          continue;
        }
        r = Move(from, false, scratch + at, room, "allreduce", &error);
      } else {
        const int k = buf.Iov(recv_off + got, std::min(recv_len - got, kMaxIo), iov);
        r = Move(from, false, iov, k, "allreduce", &error);
      }
      if (r < 0) return error;
      if (r == 0) break;
      got += static_cast<size_t>(r);
      if (reduce) {
        reduce_ready(false);
      } else {
        done = got;
      }
      progress = true;
    }
    if (reduce && got == recv_len) reduce_ready(true);
    if (sent >= send_len && done >= recv_len) break;
    if (progress) {
      last_progress = Clock::now();
      continue;
    }
    std::vector<std::pair<int, short>>& waits = waits_;
    waits.clear();
    if (got < recv_len) waits.emplace_back(from, POLLIN);
    if (sent < send_len) waits.emplace_back(to, POLLOUT);
    Status s = Wait(waits, last_progress, "allreduce");
    if (!s.ok()) return s;
  }
  return Status::OK();
}

// Reduce-scatter by recursive halving, allgather by recursive doubling, in the tensors'
// own memory (a scratch ring of at most kScratchBytes for what arrives to be reduced).
// With p the largest power of two <= n, rank p + i first hands its data to rank i, which
// folds it in; among ranks 0..p-1, step k pairs rank with rank ^ 2^k: the pair splits the
// part each still reduces in halves, the lower rank keeping the lower half, and each
// sends the half it gives up and reduces the other's into the half it keeps (the lower
// rank's operand first: host_reduce.h's pairwise order). After log2 p steps each holds
// 1/p of the buffer reduced, scales it, and the steps run backwards as an allgather;
// last, rank i sends the result to p + i. Messages per rank: 2 log2 p (+ 2 past p).
Status TcpMesh::HalvingAllreduce(const SegmentLayout& buf, DataType dtype, ReduceOp op,
                                 double scale) {
  const int p = PowerOfTwoFloor(size_);
  const size_t elem = DataTypeSize(dtype);
  const size_t count = buf.bytes() / elem;
  if (rank_ >= p) {  // folded into rank - p, which hands the result back
    Status s = StreamStep(buf, rank_ - p, 0, buf.bytes(), rank_ - p, 0, 0, false, false, dtype, op);
    if (!s.ok()) return s;
    return StreamStep(buf, rank_ - p, 0, 0, rank_ - p, 0, buf.bytes(), false, false, dtype, op);
  }
  if (rank_ + p < size_) {
    Status s = StreamStep(buf, rank_ + p, 0, 0, rank_ + p, 0, buf.bytes(), true, true, dtype, op);
    if (!s.ok()) return s;
  }
  // The part this rank reduces, in elements: [lo, hi); each step's halves, kept to undo.
  size_t lo = 0, hi = count;
  size_t los[32], his[32];
  int steps = 0;
  for (int mask = 1; mask < p; mask *= 2, ++steps) {
    const int peer = rank_ ^ mask;
    const bool lower = rank_ < peer;
    const size_t mid = lo + (hi - lo) / 2;
    los[steps] = lo;
    his[steps] = hi;
    const size_t keep_lo = lower ? lo : mid, keep_hi = lower ? mid : hi;
    const size_t give_lo = lower ? mid : lo, give_hi = lower ? hi : mid;
    Status s = StreamStep(buf, peer, give_lo * elem, (give_hi - give_lo) * elem, peer,
                          keep_lo * elem, (keep_hi - keep_lo) * elem, true, lower, dtype, op);
    if (!s.ok()) return s;
    lo = keep_lo;
    hi = keep_hi;
  }
  if (scale != 1.0) {
    buf.Pieces(lo * elem, (hi - lo) * elem,
               [&](char* q, size_t m) { ScaleBuffer(q, m / elem, dtype, scale); });
  }
  for (int k = steps - 1; k >= 0; --k) {  // allgather: the steps backwards
    const int peer = rank_ ^ (1 << k);
    const size_t plo = los[k], phi = his[k];
    const size_t mid = plo + (phi - plo) / 2;
    // This rank holds its half of [plo, phi) (the lower one if it is the lower rank),
    // the partner the other.
    const bool lower = rank_ < peer;
    const size_t other_lo = lower ? mid : plo, other_hi = lower ? phi : mid;
    Status s = StreamStep(buf, peer, lo * elem, (hi - lo) * elem, peer, other_lo * elem,
                          (other_hi - other_lo) * elem, false, false, dtype, op);
    if (!s.ok()) return s;
    lo = plo;
    hi = phi;
  }
  if (rank_ + p < size_) {
    return StreamStep(buf, rank_ + p, 0, buf.bytes(), rank_ + p, 0, 0, false, false, dtype, op);
  }
  return Status::OK();
}

// Recursive doubling. With p the largest power of two <= size, rank p + i (i < size - p)
// first sends its data to rank i, which folds it in; then ranks 0..p-1 run log2(p) rounds,
// round k swapping with rank ^ 2^k and folding; last, rank i sends the result to p + i.
// Every rank sends at most log2(p) + 1 messages.
Status TcpMesh::RecursiveDoubling(
    char* data, char* tmp, size_t bytes,
    FunctionRef<void(char* mine, const char* theirs, bool mine_lower)> fold, const char* what) {
  const int p = PowerOfTwoFloor(size_);
  std::vector<Transfer>& xs = xs_;
  auto move = [&](int peer, char* buf, bool send) {
    xs.clear();
    xs.push_back({peer, buf, bytes, send});
    return Exchange(xs, what);
  };
  if (rank_ >= p) {  // folded into rank - p, which hands the result back
    Status s = move(rank_ - p, data, true);
    return s.ok() ? move(rank_ - p, data, false) : s;
  }
  if (rank_ + p < size_) {
    Status s = move(rank_ + p, tmp, false);
    if (!s.ok()) return s;
    fold(data, tmp, true);
  }
  for (int mask = 1; mask < p; mask *= 2) {
    const int peer = rank_ ^ mask;
    xs.clear();
    xs.push_back({peer, data, bytes, true});
    xs.push_back({peer, tmp, bytes, false});
    Status s = Exchange(xs, what);
    if (!s.ok()) return s;
    fold(data, tmp, rank_ < peer);
  }
  return rank_ + p < size_ ? move(rank_ + p, data, true) : Status::OK();
}

Status TcpMesh::AllreduceFixed(void* inout, int64_t bytes, Communicator::Combine combine) {
  if (!broken_.ok()) return broken_;
  if (size_ == 1 || bytes == 0) return Status::OK();
  const size_t b = static_cast<size_t>(bytes);
  if (fixed_tmp_.size() < b) fixed_tmp_.resize(b);
  return RecursiveDoubling(
      static_cast<char*>(inout), fixed_tmp_.data(), b,
      [&](char* mine, const char* theirs, bool) { combine(mine, theirs); }, "control allreduce");
}

// Recursive doubling whose every fold puts the lower rank's operand first, which is
// host_reduce.h's pairwise order: both partners compute the same expression, so every
// rank ends with the same bits, and shm's PairwiseReduce computes them too.
Status TcpMesh::PairwiseAllreduce(const SegmentLayout& buf, DataType dtype, ReduceOp op,
                                  double scale) {
  const size_t n = buf.bytes();
  const size_t elem = DataTypeSize(dtype);
  scratch_.resize(std::max(scratch_.size(), 2 * n));
  char* data = scratch_.data();
  char* tmp = data + n;
  buf.CopyOut(data);
  ReduceFn fn = GetReduceFn(dtype, op);
  ReduceFn reversed = GetReduceFnReversed(dtype, op);
  Status s = RecursiveDoubling(
      data, tmp, n,
      [&](char* mine, const char* theirs, bool mine_lower) {
        (mine_lower ? fn : reversed)(mine, theirs, n / elem);
      },
      "allreduce");
  if (!s.ok()) return s;
  if (scale != 1.0) ScaleBuffer(data, n / elem, dtype, scale);
  buf.CopyIn(data);
  return Status::OK();
}

Status TcpMesh::DirectAllreduce(const SegmentLayout& buf, DataType dtype, ReduceOp op,
                                double scale) {
  const size_t n = buf.bytes();
  const size_t elem = DataTypeSize(dtype);
  // Slots 0..size-1: each rank's contribution (this rank's packed here); slot size:
  // the result, reduced in rank order on every rank: ((x0 op x1) op x2) ...
  scratch_.resize(std::max(scratch_.size(), n * static_cast<size_t>(size_ + 1)));
  char* slots = scratch_.data();
  char* mine = slots + n * rank_;
  buf.CopyOut(mine);
  fixed_bytes_.assign(static_cast<size_t>(size_), static_cast<int64_t>(n));
  Offsets(fixed_bytes_, &offset_);
  Status s = AllgatherBlocks(mine, slots, offset_, "allreduce");
  if (!s.ok()) return s;
  ReduceFn fn = GetReduceFn(dtype, op);
  char* acc = slots + n * size_;
  std::memcpy(acc, slots, n);
  for (int p = 1; p < size_; ++p) fn(acc, slots + n * p, n / elem);
  if (scale != 1.0) ScaleBuffer(acc, n / elem, dtype, scale);
  buf.CopyIn(acc);
  return Status::OK();
}

// Ring allreduce as one pipelined stream per direction. Chunk c of the buffer is
// elements [c * count / n, (c + 1) * count / n). Step k (0 <= k < 2n - 2) sends
// chunk S(k) to the next rank and receives chunk R(k) from the previous one:
//   reduce-scatter (k < n - 1):  S(k) = rank - k,        R(k) = rank - k - 1 (reduced in)
//   allgather (k = n - 1 + j):   S(k) = rank + 1 - j,    R(k) = rank - j     (copied in)
// S(k + 1) == R(k): what a step receives is what the next step forwards, so a byte
// of step k + 1 may go out as soon as that byte of step k is received (and reduced).
// The reduce-scatter lands in a scratch ring and is reduced into buf slice by slice;
// the last reduce-scatter step also applies `scale` (this rank's chunk is final then).
// Each chunk is reduced along the ring in one order, then copied to every rank,
// so all ranks hold the same bits. Sends and allgather receives go straight from
// and into the segments (sendmsg/recvmsg over iovecs).
Status TcpMesh::RingAllreduce(const SegmentLayout& buf, DataType dtype, ReduceOp op, double scale) {
  const int n = size_;
  const size_t elem = DataTypeSize(dtype);
  const size_t count = buf.bytes() / elem;
  auto chunk_begin = [&](int c) {
    c = ((c % n) + n) % n;
    return RingChunkStart(count, c, n) * elem;
  };
  auto chunk_bytes = [&](int c) {
    c = ((c % n) + n) % n;
    return (RingChunkStart(count, c + 1, n) - RingChunkStart(count, c, n)) * elem;
  };
  const int steps = 2 * n - 2;
  auto send_chunk = [&](int k) { return k < n - 1 ? rank_ - k : rank_ + 1 - (k - (n - 1)); };
  auto recv_chunk = [&](int k) { return k < n - 1 ? rank_ - k - 1 : rank_ - (k - (n - 1)); };

  size_t largest = 0;
  for (int c = 0; c < n; ++c) largest = std::max(largest, chunk_bytes(c));
  const size_t ring = std::min(kScratchBytes, (largest + elem - 1) / elem * elem);
  scratch_.resize(std::max(scratch_.size(), ring));
  char* scratch = scratch_.data();
  ReduceFn fn = GetReduceFn(dtype, op);

  const int next = (rank_ + 1) % n, prev = (rank_ + n - 1) % n;
  Status error;
  int sk = 0, rk = 0;  // current send / receive step
  size_t sent = 0;     // bytes of step sk sent
  size_t got = 0;      // bytes of step rk received
  size_t done = 0;     // bytes of step rk reduced (reduce-scatter) or received (allgather)
  auto last_progress = Clock::now();
  iovec iov[SegmentLayout::kMaxIov];

  // Reduces received scratch bytes of step rk into buf, whole elements only.
  auto reduce_ready = [&](bool force) {
    size_t avail = (got - done) / elem * elem;
    if (avail == 0 || (!force && avail < kReduceSlice && got < chunk_bytes(recv_chunk(rk)))) {
      return;
    }
    const size_t base = chunk_begin(recv_chunk(rk));
    const bool last = rk == n - 2;
    while (avail > 0) {
      const size_t at = done % ring;
      const size_t len = std::min(avail, ring - at);
      const char* from = scratch + at;
      buf.Pieces(base + done, len, [&](char* p, size_t m) {
        fn(p, from, m / elem);
        if (last && scale != 1.0) ScaleBuffer(p, m / elem, dtype, scale);
        from += m;
      });
      done += len;
      avail -= len;
    }
  };
  // Bytes of send step sk that may go now.
  auto send_ready = [&]() -> size_t {
    if (sk == 0 || sk - 1 < rk) return chunk_bytes(send_chunk(sk));
    return sk - 1 == rk ? done : 0;
  };

  while (sk < steps || rk < steps) {
    bool progress = false;
    // Receive what has arrived for step rk.
    while (rk < steps) {
      const size_t total = chunk_bytes(recv_chunk(rk));
      if (got == total) {
        if (rk < n - 1) reduce_ready(true);
        ++rk;
        got = done = 0;
        progress = true;
        continue;
      }
      ssize_t r;
      if (rk < n - 1) {
        const size_t at = got % ring;
        // Never overrun bytes not reduced yet.
        const size_t room = std::min({ring - at, ring - (got - done), total - got});
        if (room == 0) {
          reduce_ready(true);
          continue;
        }
        r = Move(prev, false, scratch + at, room, "allreduce", &error);
      } else {
        const int k =
            buf.Iov(chunk_begin(recv_chunk(rk)) + got, std::min(total - got, kMaxIo), iov);
        r = Move(prev, false, iov, k, "allreduce", &error);
      }
      if (r < 0) return error;
      if (r == 0) break;
      got += static_cast<size_t>(r);
      if (rk < n - 1) {
        reduce_ready(false);
      } else {
        done = got;
      }
      progress = true;
    }
    // Send what may go: step 0 all of it, step sk > 0 what step sk - 1 has finished.
    while (sk < steps) {
      const size_t total = chunk_bytes(send_chunk(sk));
      if (sent == total) {
        if (total > 0) CountMessage(TrafficSender::kTcp, static_cast<int64_t>(total));
        ++sk;
        sent = 0;
        continue;
      }
      const size_t ready = send_ready();
      if (ready <= sent) break;
      const int k =
          buf.Iov(chunk_begin(send_chunk(sk)) + sent, std::min(ready - sent, kMaxIo), iov);
      ssize_t w = Move(next, true, iov, k, "allreduce", &error);
      if (w < 0) return error;
      if (w == 0) break;
      sent += static_cast<size_t>(w);
      progress = true;
    }
    if (sk >= steps && rk >= steps) break;
    if (progress) {
      last_progress = Clock::now();
      continue;
    }
    // Nothing moved: wait for the wire.
    std::vector<std::pair<int, short>>& waits = waits_;
    waits.clear();
    if (rk < steps) waits.emplace_back(prev, POLLIN);
    if (sk < steps && send_ready() > sent) waits.emplace_back(next, POLLOUT);
    Status s = Wait(waits, last_progress, "allreduce");
    if (!s.ok()) return s;
  }
  return Status::OK();
}

}  // namespace spark_hvd
