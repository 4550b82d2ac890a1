// TcpMesh: spark_hvd's own TCP connections among the ranks of one communicator:
// the tcp backend (communicator.h) runs the control plane (the per-cycle allgather)
// and, unless another CPU backend is chosen (SPARK_HVD_CPU_OPERATIONS), every CPU
// collective on it.
//
// Files: connect.cc (set-up on net/links.h's PeerLinks: listen, publish, connect at
// init and on demand), io.cc (non-blocking socket I/O and the errors it reports),
// collectives.cc (allgather, broadcast, alltoall, barrier) and allreduce.cc
// (direct, recursive doubling and ring allreduce); net/socket.h (socket helpers).
//
// Why not Gloo's pairs: every Gloo receive is completed by Gloo's event-loop
// thread and handed to the caller through a condition variable (two thread
// switches per message), and its allreduce algorithms receive a whole piece before
// reducing it. Here the engine thread does its own non-blocking send/recv on one
// socket per peer and reduces each slice of a ring allreduce as it lands, while the
// next slice is still on the wire and the reduced bytes are already forwarded.
//
// All calls come from the engine thread, in the same order on every rank, so the
// byte streams need no framing: each call reads exactly what the peers' matching
// call wrote. After any error the mesh is broken and every later call fails with
// that first error (the streams are no longer in step).
//
// Blocking behaviour: Connect blocks until every peer is connected, up to
// connect_timeout_s. Each collective blocks until this rank's part is done (its
// sends written to the kernel, its receives complete); a peer that moves no byte
// for timeout_s makes it fail with kTimeout, a closed connection with kPeerLost, and
// so does a peer the job's heartbeats (liveness.h) lost, as soon as they lose it.
#pragma once

#include <poll.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/communicator.h"
#include "backends/layout.h"
#include "common/function_ref.h"
#include "common/status.h"
#include "common/types.h"
#include "net/liveness.h"
#include "rendezvous/store.h"

namespace spark_hvd {

class PeerLinks;  // net/links.h: a mesh's connection set-up, at init and on demand

// The peers a rank of `size` connects at init: rank +- 2^k (mod size) for every power of
// two below size, sorted, at most 2 ceil(log2 size) of them (every peer when size <= 4):
// those of the ring, recursive doubling, Bruck's allgather and the binomial broadcast.
std::vector<int> AlgorithmPeers(int rank, int size);
// The descriptors a rank of a job of `size` holds for its connections (tcp mesh,
// heartbeats, rendezvous client), for the error that says the limit is too low.
int DescriptorsPerRank(int size);

class TcpMesh {
 public:
  // Returns the ranks of this mesh the job has lost (their process exited or host
  // vanished), as far as the rendezvous service knows; may be empty.
  using LostPeers = std::function<std::vector<int>()>;

  // Every rank listens on bind_host, publishes "address port token" under
  // "tcp/<rank>" in the store and connects its AlgorithmPeers, within connect_timeout_s;
  // any other peer is connected the first time a collective exchanges with it (the
  // protocol: net/links.cc). Hellos are read concurrently, each with its own
  // deadline: a stray, silent or trickling connection is dropped with a warning and
  // delays no one. A connection is accepted only with the listener's token (which only
  // a holder of the store's secret can read). While it waits, every half second it asks
  // lost_peers (when set) and fails with kPeerLost naming a lost peer. Throws
  // StatusError: kTimeout at the deadline, kPeerLost, kStoreError, kInvalidArgument
  // (bind_host), kInternal (out of file descriptors, naming the limit). `members` are
  // the job ranks of the mesh's ranks (errors name job ranks); with `liveness` (the
  // job's heartbeats, which outlive the mesh) every wait also stops when a peer is
  // lost, and a closed connection is explained by its verdict. The mesh keeps `store`
  // and `lost_peers` for the connections it makes later.
  static std::unique_ptr<TcpMesh> Connect(int rank, int size, std::shared_ptr<Store> store,
                                          const std::string& bind_host, double timeout_s,
                                          double connect_timeout_s, LostPeers lost_peers,
                                          std::vector<int32_t> members, PeerLiveness* liveness);
  // The set-up alone, to every peer: one connected socket per peer (-1 for this rank),
  // for a mesh of another kind (heartbeat.h). Throws as Connect does.
  static std::vector<int> ConnectSockets(int rank, int size, std::shared_ptr<Store> store,
                                         const std::string& bind_host, double connect_timeout_s,
                                         const LostPeers& lost_peers);
  ~TcpMesh();
  TcpMesh(const TcpMesh&) = delete;
  TcpMesh& operator=(const TcpMesh&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Every rank contributes `bytes`; out receives size * bytes in rank order.
  Status AllgatherFixed(const void* in, void* out, int64_t bytes);
  // Every rank's `bytes` folded into inout by `combine` (Communicator::AllreduceFixed):
  // recursive doubling, ceil(log2(size)) rounds or one more, one message per round.
  Status AllreduceFixed(void* inout, int64_t bytes, Communicator::Combine combine);

  // In-place allreduce of the concatenation of `segments` (Average reduces as
  // Sum); scale != 1 multiplies the result. Every element is reduced (and scaled)
  // in the same order on every rank, so all ranks end bit-identical.
  Status Allreduce(const std::vector<Segment>& segments, DataType dtype, ReduceOp op, double scale);

  // Rank r contributes bytes_per_rank[r] bytes; out is their concatenation.
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank);
  // The root sends buf to every other rank.
  Status Broadcast(void* buf, int64_t bytes, int root);
  // send_bytes[r] bytes go to rank r (consecutive in `in`); recv_bytes[r] come from r.
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                   const std::vector<int64_t>& recv_bytes);
  Status Barrier();

 private:
  TcpMesh(int rank, int size, std::vector<int> fds, double timeout_s, std::vector<int32_t> members,
          PeerLiveness* liveness, std::unique_ptr<PeerLinks> links);

  // Small buffers among at most kDirectMaxRanks ranks: everyone sends everything to
  // everyone (one round trip), then each rank reduces the contributions in rank order.
  Status DirectAllreduce(const SegmentLayout& buf, DataType dtype, ReduceOp op, double scale);
  // Small buffers among more ranks: recursive doubling, each round combining the lower
  // rank's operand first (host_reduce.h's pairwise order, the same bits on every rank).
  Status PairwiseAllreduce(const SegmentLayout& buf, DataType dtype, ReduceOp op, double scale);
  // The rounds of recursive doubling over `bytes` at `data` (tmp: as large): ranks past
  // the largest power of two p first hand theirs to rank - p and get the result back;
  // each round swaps with rank ^ mask and calls fold(data, tmp, data_is_lower).
  Status RecursiveDoubling(char* data, char* tmp, size_t bytes,
                           FunctionRef<void(char* mine, const char* theirs, bool mine_lower)> fold,
                           const char* what);
  // Larger buffers among many ranks (host_reduce.h's ReducesByHalving): recursive
  // halving, then doubling, in the pairwise order, 2 log2 n steps.
  Status HalvingAllreduce(const SegmentLayout& buf, DataType dtype, ReduceOp op, double scale);
  Status StreamStep(const SegmentLayout& buf, int to, size_t send_off, size_t send_len, int from,
                    size_t recv_off, size_t recv_len, bool reduce, bool mine_lower, DataType dtype,
                    ReduceOp op);
  // Small broadcasts among more than kDirectMaxRanks ranks: a binomial tree from the root.
  Status TreeBroadcast(char* buf, size_t bytes, int root);
  // Larger buffers: reduce-scatter then allgather around the ring, pipelined.
  Status RingAllreduce(const SegmentLayout& buf, DataType dtype, ReduceOp op, double scale);

  // Sends/receives whole buffers to/from several peers at once. A transfer is one
  // message: `data` then, if any, `data2` (a block range that wraps around the ranks).
  struct Transfer {
    int peer;
    char* data;
    size_t left;
    bool send;
    char* data2 = nullptr;
    size_t left2 = 0;
  };
  Status Exchange(std::vector<Transfer>& transfers, const char* what);
  // Connects the peers of `xs` that have no socket yet (their other ends are in the
  // matching call, so connect them too); the mesh is broken if that fails.
  Status EnsureConnected(const std::vector<Transfer>& xs);

  // One non-blocking send or receive with peer: bytes moved, 0 when the socket
  // would block, -1 with *error set (the mesh is then broken).
  ssize_t Move(int peer, bool send, iovec* iov, int iovcnt, const char* what, Status* error);
  ssize_t Move(int peer, bool send, char* data, size_t len, const char* what, Status* error);
  // Polls until one of (peer, events) is ready; Timeout once timeout_s has passed
  // since last_progress.
  Status Wait(const std::vector<std::pair<int, short>>& waits,
              std::chrono::steady_clock::time_point last_progress, const char* what);
  // Every rank's block to every peer: rank p's block is out[offset[p], offset[p + 1]),
  // this rank's taken from `in` (which may already be that block). Direct among at most
  // kDirectMaxRanks ranks, else Bruck's ceil(log2(size)) rounds.
  Status AllgatherBlocks(const void* in, void* out, const std::vector<size_t>& offset,
                         const char* what);
  // Blocks [first, first + count) of `out` (rank order, wrapping past the last rank) as
  // one transfer with `peer`.
  Transfer BlockRange(int peer, bool send, char* out, const std::vector<size_t>& offset, int first,
                      int count) const;
  // Where each rank's block starts in a concatenation of blocks of these sizes (size + 1
  // entries, the last one the total), into *offset.
  void Offsets(const std::vector<int64_t>& bytes, std::vector<size_t>* offset) const;

  // One send() or recv() moves at most this much, so reducing and forwarding keep
  // pace with the wire instead of waiting for a whole chunk.
  static constexpr size_t kMaxIo = 1 << 20;

  Status Fail(Status s);
  Status PeerError(int peer, const char* what, int err);
  Status PeerClosed(int peer, const char* what);
  Status Timeout(const std::vector<int>& peers, const char* what);
  std::vector<int32_t> JobRanks(const std::vector<int>& peers) const;

  int rank_;
  int size_;
  std::vector<int> fds_;  // by peer rank; -1 for this rank and peers not connected yet
  std::unique_ptr<PeerLinks> links_;
  std::vector<int> need_;  // EnsureConnected's peers to connect
  double timeout_s_;
  std::vector<int32_t> members_;  // the job rank of each mesh rank
  PeerLiveness* liveness_;        // may be null
  Status broken_;
  std::vector<char> scratch_;
  std::vector<char> fixed_tmp_;  // AllreduceFixed's partner record
  // Reused by every op (cleared, never shrunk): no allocation per op in steady state.
  // Block offsets and sizes, the transfers of an exchange, what it waits for, the poll
  // set (and the peers it polls), a segment layout, the barrier's bytes.
  std::vector<size_t> offset_, soff_, roff_;
  std::vector<int64_t> fixed_bytes_;
  std::vector<Transfer> xs_;
  std::vector<std::pair<int, short>> waits_;
  std::vector<pollfd> pfds_;
  std::vector<int> poll_peers_;
  SegmentLayout layout_;
  std::vector<char> barrier_;
};

}  // namespace spark_hvd
