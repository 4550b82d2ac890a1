// The shm backend's communicator for a set whose ranks span hosts, and the choice
// between it and ShmCommunicator.
//
// Hierarchical allreduce (SPARK_HVD_HIERARCHICAL_ALLREDUCE, Horovod's
// HOROVOD_HIERARCHICAL_ALLREDUCE), when every host holds the same number L of the set's
// ranks; local rank i of a host is its i-th member there:
//  1. Within each host, over shared memory: the buffer is cut into L pieces and local
//     rank i ends with piece i reduced over its host (ShmCommunicator::ReduceScatterPieces).
//  2. Across hosts, over tcp: local rank i allreduces its piece with the local ranks i of
//     the other hosts (a tcp communicator among them), scaled as the set's allreduce is.
//     The L pieces cross at once, each host's links carried by all its ranks.
//  3. Within each host again: every local rank copies the others' pieces
//     (ShmCommunicator::AllgatherPieces).
// Hierarchical allgather (SPARK_HVD_HIERARCHICAL_ALLGATHER; unset, on for a set with at
// least 2 of its ranks on every host): the blocks of each host are gathered within it
// (shm), local rank 0 of each host exchanges its host's blocks with the others across
// hosts (tcp), then broadcasts everything within its host (shm). The host's shm group and
// the tcp communicator across hosts are made by the set's first op that runs here.
// Results are those of the flat tcp collectives; for floats only the order of the
// additions differs. Every other op, and these when off or when the hosts hold different
// numbers of ranks, is declined (Runs): it goes to the set's tcp communicator.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/shm/communicator.h"

namespace spark_hvd {

// The shm backend's communicator among `members` (job ranks, sorted, this rank among
// them) of process set `set_id`: a ShmCommunicator when they share this host, else a
// HierarchicalCommunicator. Collective over the members.
std::unique_ptr<Communicator> ConnectShmSet(const BackendOptions& options,
                                            std::vector<int32_t> members, HostKeys hosts,
                                            int32_t set_id);

class HierarchicalCommunicator : public Communicator {
 public:
  HierarchicalCommunicator(const BackendOptions& options, std::vector<int32_t> members,
                           HostKeys hosts, int32_t set_id);
  ~HierarchicalCommunicator() override;

  const char* name() const override { return "shm"; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  bool Runs(OpType op) const override;

  Status AllgatherFixed(const void* in, void* out, int64_t bytes) override;
  Status Allreduce(const ReduceArgs& args) override;
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank) override;
  Status Broadcast(void* buf, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                   const std::vector<int64_t>& recv_bytes) override;
  Status Barrier() override;
  std::unique_ptr<Communicator> Split(const std::vector<int32_t>& ranks, int32_t set_id) override;

 private:
  Status Declined(const char* op) const;
  Status Connected();             // makes local_ and cross_ on first use (what failed: sticky)
  Status Across(Status s) const;  // a failure of the cross-host step, said so

  BackendOptions options_;
  std::vector<int32_t> members_;  // job ranks
  int rank_;
  HostKeys hosts_;
  bool allreduce_ = false;                      // hierarchical allreduce on (and possible)
  bool allgather_ = false;                      // hierarchical allgather on (and possible)
  std::vector<std::vector<int>> host_members_;  // member ranks by host, hosts by first member
  int host_ = 0;                                // this rank's host, its index there
  int local_rank_ = 0;
  std::string set_name_;
  bool connected_ = false;
  Status broken_;
  std::unique_ptr<ShmCommunicator> local_;  // this host's members (null: one)
  std::unique_ptr<Communicator> cross_;     // tcp among the local ranks local_rank_ of every host
                                            // (allgather alone: only local rank 0's)
  std::vector<uint8_t> scratch_;            // allgather: the hosts' blocks, kept across calls
};

}  // namespace spark_hvd
