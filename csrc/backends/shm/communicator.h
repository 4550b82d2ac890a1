// The CPU communicator of backend "shm": ranks on one host move tensors through
// shared memory instead of loopback TCP. Each member has its own segment (segment.h:
// a header and two slots), shared with the other members only, after the authenticated
// hello of the set-up (connect.cc); group.h has the rounds' counters and waits.
//
// The protocol. Collectives run in rounds of at most one slot of data per member;
// round g (1, 2, ... alike on every member) uses slot g % 2. In each round a member:
//  1. Waits until every peer has started round g - 1 (Group::Next), so none still reads
//     its slot g % 2 from round g - 2; then writes its data for round g into that slot.
//  2. Posts started = g (this also says it has finished reading every earlier round).
//  3. Waits for the peers it reads from to have started round g, and reads their slots:
//     - allreduce, direct (small buffers, host_reduce.h's order): every member reduces
//       the whole round from every slot, in rank order, into its tensors;
//     - allreduce, sliced (larger): member j reduces the j-th of n equal pieces of the
//       round straight from the n slots, in the tcp ring's order for each element (so
//       the bits equal tcp's), scales it, and writes it into its tensors and over its
//       own slot's piece; posts reduced = g; waits for every peer's reduced = g; copies
//       the other pieces from their owners' slots into its tensors. No member reduces
//       more than its share, and none is a root;
//     - reduce-scatter in equal blocks: member j reduces only block j's part of the
//       round, into its output;
//     - allgather, alltoall: each member copies what it receives from the senders' slots;
//     - broadcast: the non-roots copy from the root's slot;
//     - barrier: nothing (a round without data).
// Members reach the same rounds in the same order because every call comes from the
// engine thread in the same order on every member with the same sizes.
//
// Memory: each segment is set once at its size, 4 KiB + 2 x SPARK_HVD_SHM_SLOT_BYTES
// (pages are touched as rounds use them); a larger op streams through it in rounds,
// which keeps the slots in cache. Nothing is allocated per op but the executor's own.
//
// Sets: a communicator among members on one host (ShmCommunicator) runs every op; one
// whose members span hosts (HierarchicalCommunicator, hierarchical.h) runs allreduce and
// allgather in steps within and across hosts where asked to, declines the rest (Runs:
// they go to the next backend, tcp), and splits, so a process set within one host still
// gets shared memory.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/communicator.h"
#include "backends/host_reduce.h"
#include "backends/layout.h"

namespace spark_hvd {
namespace shm {
class Group;
}

// This host as the shm backend tells hosts apart: the launcher's host identity
// (BackendOptions::host), the kernel's boot id and the network namespace (the abstract
// Unix sockets of the set-up are per network namespace). Ranks with equal keys share
// memory.
std::string ShmHostKey(const std::string& host);

// Every job rank's host key, by rank.
using HostKeys = std::shared_ptr<const std::vector<std::string>>;

// The shm backend's communicator among every rank of the job: exchanges host keys through
// the store (under "<store_prefix>/shm/hosts"), then ConnectShmSet (hierarchical.h).
std::unique_ptr<Communicator> ConnectShmAll(const BackendOptions& options);

// Among members that all share this host.
class ShmCommunicator : public Communicator {
 public:
  // Connects `members` (job ranks, sorted, this rank among them, all on this host) under
  // "<store_prefix>/shm/<group>" in the store. Collective over the members.
  ShmCommunicator(const BackendOptions& options, std::vector<int32_t> members, HostKeys hosts,
                  const std::string& group);
  ~ShmCommunicator() override;

  const char* name() const override { return "shm"; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  // Every member shares this host: the engine's per-cycle exchange runs here too.
  bool CarriesControl() const override { return true; }

  Status AllgatherFixed(const void* in, void* out, int64_t bytes) override;
  Status Allreduce(const ReduceArgs& args) override;
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank) override;
  Status Broadcast(void* buf, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                   const std::vector<int64_t>& recv_bytes) override;
  Status Barrier() override;
  bool ReducescatterBlocks(const ReduceArgs& args, int64_t block, void* out,
                           Status* status) override;
  std::unique_ptr<Communicator> Split(const std::vector<int32_t>& ranks, int32_t set_id) override;

  // The steps a hierarchical allreduce takes within a host, over `buf` (count elements,
  // in place), cut into size() pieces: piece j = [count * j / size, count * (j+1) / size).
  // ReduceScatterPieces: member j ends with piece j reduced over the members (rank order,
  // no scaling); the other pieces of its buffer are left as they were.
  Status ReduceScatterPieces(const SegmentLayout& buf, size_t count, DataType dtype, ReduceOp op);
  // AllgatherPieces: every member's piece j is copied from member j.
  Status AllgatherPieces(const SegmentLayout& buf, size_t count, DataType dtype);

 private:
  // Allgatherv, its waits named `what`.
  Status Gather(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank,
                const char* what);
  // allreduce.cc
  Status ReduceSegments(const std::vector<Segment>& segments, DataType dtype, ReduceOp op,
                        double scale);
  Status DirectRound(const SegmentLayout& buf, size_t a, size_t b, DataType dtype, ReduceOp op,
                     double scale);
  Status SlicedRound(const SegmentLayout& buf, size_t count, size_t a, size_t b, DataType dtype,
                     ReduceOp op, double scale);
  // ReduceScatterPieces (reduce) or AllgatherPieces: in rounds, each slot holds for every
  // piece j a sub-range of it (reduce: the member's data for every piece; else its own
  // piece's result) at j x (slot / size).
  Status PieceRounds(const SegmentLayout& buf, size_t count, DataType dtype, ReduceOp op,
                     bool reduce);

  BackendOptions options_;
  std::vector<int32_t> members_;  // job ranks
  int rank_;
  HostKeys hosts_;
  std::unique_ptr<shm::Group> group_;  // more than one member
  // Reused by every op (cleared or resized, never shrunk): no allocation per op in steady
  // state. Offsets and byte counts, the slots a reduction reads, HostAllreduce's scratch.
  std::vector<size_t> offset_, soff_, roff_;
  std::vector<int64_t> fixed_bytes_, most_;
  std::vector<const char*> in_;
  std::vector<char> pairwise_;  // PairwiseReduce's partial results, one block each
  SegmentLayout layout_;
  HostReduceScratch reduce_scratch_;
};

}  // namespace spark_hvd
