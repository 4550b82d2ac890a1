// Process sets: subsets of the global ranks with their own communicators.
// Negotiation for every set runs in the global control exchange (controller.h);
// data moves on the set's own communicators.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/backend.h"
#include "backends/communicator.h"

namespace spark_hvd {

struct ProcessSet {
  int32_t id = 0;
  std::vector<int32_t> ranks;  // global ranks, sorted
  // One communicator per backend of the job, in the registry's priority order.
  struct Link {
    Backend* backend;
    std::unique_ptr<Communicator> comm;
  };
  std::vector<Link> comms;

  bool Contains(int32_t global_rank) const;
  int32_t SetRank(int32_t global_rank) const;  // -1 when not a member
  // The first communicator whose backend executes `op` on `dtype` tensors of
  // `device` and that runs it (Communicator::Runs); null if none.
  Communicator* For(int32_t device, OpType op, DataType dtype) const;
};

// Owned by the engine. The background thread mutates it; API threads read
// membership under the lock to validate requests early.
class ProcessSetTable {
 public:
  void Add(std::unique_ptr<ProcessSet> set);
  void Remove(int32_t id);
  ProcessSet* Get(int32_t id);             // background thread only
  std::vector<int32_t> Ranks(int32_t id);  // empty when unknown
  // The set's size (0 when unknown) and whether `global_rank` is a member, read under the
  // lock without copying the ranks (validation of every op).
  size_t Membership(int32_t id, int32_t global_rank, bool* member);
  std::vector<int32_t> Ids();
  int32_t NextId();
  void Clear();
  void AbortAll();  // Communicator::Abort on every communicator of every set

 private:
  std::mutex mu_;
  std::map<int32_t, std::unique_ptr<ProcessSet>> sets_;
  int32_t next_id_ = 1;
};

}  // namespace spark_hvd
