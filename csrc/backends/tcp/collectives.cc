// TcpMesh collectives other than allreduce: allgather (fixed and variable blocks),
// broadcast (direct, a binomial tree or a chain), alltoall, barrier, and the control
// plane's AllreduceFixed.
//
// Among more than kDirectMaxRanks ranks (host_reduce.h) every collective but alltoall
// takes log2(size) rounds with one message per rank per round, and talks only to the
// peers at a power-of-two distance (rank +- 2^k), so a rank's cost grows with log2 of
// the ranks, not with their number:
//   allgather: Bruck's algorithm; round k sends the blocks held so far (at most 2^k)
//     to rank - 2^k and receives as many from rank + 2^k;
//   broadcast: a binomial tree rooted at the root (a chain for large buffers);
//   barrier and AllreduceFixed: recursive doubling (allreduce.cc).
#include <poll.h>

#include <algorithm>
#include <cstring>

#include "backends/host_reduce.h"
#include "backends/tcp/mesh.h"
#include "common/traffic.h"
#include "net/socket.h"

namespace spark_hvd {
namespace {

using net::Clock;

// Broadcasts of at least this many bytes among more than two ranks use a chain.
constexpr int64_t kChainBytes = 1 << 20;

}  // namespace

// Where each rank's block starts in a concatenation of blocks of these sizes
// (size + 1 entries, the last one the total).
void TcpMesh::Offsets(const std::vector<int64_t>& bytes, std::vector<size_t>* offset) const {
  offset->assign(static_cast<size_t>(size_) + 1, 0);
  for (int p = 0; p < size_; ++p) (*offset)[p + 1] = (*offset)[p] + static_cast<size_t>(bytes[p]);
}

Status TcpMesh::AllgatherFixed(const void* in, void* out, int64_t bytes) {
  fixed_bytes_.assign(static_cast<size_t>(size_), bytes);
  Offsets(fixed_bytes_, &offset_);
  return AllgatherBlocks(in, out, offset_, "control allgather");
}

Status TcpMesh::Allgatherv(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank) {
  Offsets(bytes_per_rank, &offset_);
  return AllgatherBlocks(in, out, offset_, "allgather");
}

TcpMesh::Transfer TcpMesh::BlockRange(int peer, bool send, char* out,
                                      const std::vector<size_t>& offset, int first,
                                      int count) const {
  const int end = first + count;  // may pass size_: the range wraps to rank 0
  Transfer x{peer, out + offset[first], offset[std::min(end, size_)] - offset[first], send};
  if (end > size_) {
    x.data2 = out;
    x.left2 = offset[end - size_];
  }
  return x;
}

Status TcpMesh::AllgatherBlocks(const void* in, void* out, const std::vector<size_t>& offset,
                                const char* what) {
  if (!broken_.ok()) return broken_;
  char* o = static_cast<char*>(out);
  char* mine = o + offset[rank_];
  const size_t n = offset[rank_ + 1] - offset[rank_];
  if (n > 0 && mine != in) std::memmove(mine, in, n);
  std::vector<Transfer>& xs = xs_;
  if (size_ > kDirectMaxRanks) {  // Bruck: this rank holds blocks rank .. rank + dist - 1
    for (int dist = 1; dist < size_; dist *= 2) {
      const int count = std::min(dist, size_ - dist);
      xs.clear();
      xs.push_back(BlockRange((rank_ - dist + size_) % size_, true, o, offset, rank_, count));
      const int from = (rank_ + dist) % size_;
      xs.push_back(BlockRange(from, false, o, offset, from, count));
      Status s = Exchange(xs, what);
      if (!s.ok()) return s;
    }
    return Status::OK();
  }
  xs.clear();
  for (int k = 1; k < size_; ++k) {
    if (n > 0) xs.push_back({(rank_ + k) % size_, mine, n, true});
  }
  for (int k = 1; k < size_; ++k) {
    const int p = (rank_ + size_ - k) % size_;
    const size_t theirs = offset[p + 1] - offset[p];
    if (theirs > 0) xs.push_back({p, o + offset[p], theirs, false});
  }
  return Exchange(xs, what);
}

// Large broadcasts among more than two ranks go down a chain (root, root + 1, ...),
// each rank forwarding what it has received while the rest arrives: the root
// sends the payload once instead of size - 1 times.
Status TcpMesh::Broadcast(void* buf, int64_t bytes, int root) {
  if (!broken_.ok()) return broken_;
  if (bytes == 0) return Status::OK();
  char* b = static_cast<char*>(buf);
  if (size_ > 2 && bytes >= kChainBytes) {
    const size_t total = static_cast<size_t>(bytes);
    const int pos = (rank_ - root + size_) % size_;
    const int prev = (rank_ + size_ - 1) % size_, next = (rank_ + 1) % size_;
    const bool forward = pos < size_ - 1;
    if (forward) CountMessage(TrafficSender::kTcp, bytes);
    size_t got = pos == 0 ? total : 0, sent = 0;
    auto last_progress = Clock::now();
    Status error;
    while (got < total || (forward && sent < total)) {
      bool progress = false;
      while (got < total) {
        ssize_t r = Move(prev, false, b + got, total - got, "broadcast", &error);
        if (r < 0) return error;
        if (r == 0) break;
        got += static_cast<size_t>(r);
        progress = true;
      }
      while (forward && sent < got) {
        ssize_t w = Move(next, true, b + sent, got - sent, "broadcast", &error);
        if (w < 0) return error;
        if (w == 0) break;
        sent += static_cast<size_t>(w);
        progress = true;
      }
      if (progress) {
        last_progress = Clock::now();
        continue;
      }
      std::vector<std::pair<int, short>>& waits = waits_;
      waits.clear();
      if (got < total) waits.emplace_back(prev, POLLIN);
      if (forward && sent < got) waits.emplace_back(next, POLLOUT);
      Status s = Wait(waits, last_progress, "broadcast");
      if (!s.ok()) return s;
    }
    return Status::OK();
  }
  if (size_ > kDirectMaxRanks) return TreeBroadcast(b, static_cast<size_t>(bytes), root);
  std::vector<Transfer>& xs = xs_;
  xs.clear();
  if (rank_ == root) {
    for (int k = 1; k < size_; ++k)
      xs.push_back({(rank_ + k) % size_, b, static_cast<size_t>(bytes), true});
  } else {
    xs.push_back({root, b, static_cast<size_t>(bytes), false});
  }
  return Exchange(xs, "broadcast");
}

Status TcpMesh::Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                          const std::vector<int64_t>& recv_bytes) {
  if (!broken_.ok()) return broken_;
  std::vector<size_t>&soff = soff_, &roff = roff_;
  Offsets(send_bytes, &soff);
  Offsets(recv_bytes, &roff);
  const char* i = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  if (send_bytes[rank_] > 0) {
    std::memcpy(o + roff[rank_], i + soff[rank_], static_cast<size_t>(send_bytes[rank_]));
  }
  std::vector<Transfer>& xs = xs_;
  xs.clear();
  for (int k = 1; k < size_; ++k) {
    const int p = (rank_ + k) % size_;
    if (send_bytes[p] > 0) {
      xs.push_back({p, const_cast<char*>(i + soff[p]), static_cast<size_t>(send_bytes[p]), true});
    }
  }
  for (int k = 1; k < size_; ++k) {
    const int p = (rank_ + size_ - k) % size_;
    if (recv_bytes[p] > 0)
      xs.push_back({p, o + roff[p], static_cast<size_t>(recv_bytes[p]), false});
  }
  return Exchange(xs, "alltoall");
}

// The binomial tree of the ranks numbered from the root (v = rank - root): v receives
// from v minus its lowest set bit, then sends to v + m for each power of two m below
// that bit (and v + m < size), all at once.
Status TcpMesh::TreeBroadcast(char* buf, size_t bytes, int root) {
  const int v = (rank_ - root + size_) % size_;
  int mask = 1;
  while (mask < size_ && (v & mask) == 0) mask *= 2;
  std::vector<Transfer>& xs = xs_;
  if (v != 0) {
    xs.clear();
    xs.push_back({(v - mask + root) % size_, buf, bytes, false});
    Status s = Exchange(xs, "broadcast");
    if (!s.ok()) return s;
  }
  xs.clear();
  for (int m = mask / 2; m >= 1; m /= 2) {
    if (v + m < size_) xs.push_back({(v + m + root) % size_, buf, bytes, true});
  }
  return xs.empty() ? Status::OK() : Exchange(xs, "broadcast");
}

Status TcpMesh::Barrier() {
  if (size_ > kDirectMaxRanks) {
    char mine = 1;
    return AllreduceFixed(&mine, 1, [](void*, const void*) {});
  }
  char mine = 1;
  barrier_.resize(static_cast<size_t>(size_));
  fixed_bytes_.assign(static_cast<size_t>(size_), 1);
  Offsets(fixed_bytes_, &offset_);
  return AllgatherBlocks(&mine, barrier_.data(), offset_, "barrier");
}

}  // namespace spark_hvd
