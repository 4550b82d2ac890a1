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
// Sets: a communicator among members on one host runs every op; one whose members
// span hosts runs none (Runs() is false: the set's ops go to the next backend, tcp)
// and only splits, so a process set within one host still gets shared memory.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/communicator.h"
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

class ShmCommunicator : public Communicator {
 public:
  // The communicator among every rank of the job: exchanges host keys through the store
  // (under "<store_prefix>/shm/hosts"), then connects if every rank is on this host.
  static std::unique_ptr<ShmCommunicator> ConnectAll(const BackendOptions& options);
  ~ShmCommunicator() override;

  const char* name() const override { return "shm"; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  bool Runs(OpType op) const override;
  // Whether every member is on this host.
  bool one_host() const { return one_host_; }

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

 private:
  // hosts: every job rank's host key.
  ShmCommunicator(const BackendOptions& options, std::vector<int32_t> members,
                  std::shared_ptr<const std::vector<std::string>> hosts, int32_t set_id);

  // allreduce.cc
  Status ReduceSegments(const std::vector<Segment>& segments, DataType dtype, ReduceOp op,
                        double scale);
  Status DirectRound(const SegmentLayout& buf, size_t a, size_t b, DataType dtype, ReduceOp op,
                     double scale);
  Status SlicedRound(const SegmentLayout& buf, size_t count, size_t a, size_t b, DataType dtype,
                     ReduceOp op, double scale);
  // An op on a communicator that cannot run it (spans hosts): an internal error.
  Status NotHere(const char* op) const;

  BackendOptions options_;
  std::vector<int32_t> members_;  // job ranks
  int rank_;
  std::shared_ptr<const std::vector<std::string>> hosts_;
  bool one_host_;
  std::unique_ptr<shm::Group> group_;  // one host and more than one member
};

}  // namespace spark_hvd
