// The CPU communicator of backend "gloo": Gloo's pairs and algorithms
// (halving-doubling allreduce in SPARK_HVD_GLOO_CHUNK_BYTES pieces, its allgatherv,
// broadcast, alltoallv and barrier), over a Gloo context connected through the
// rendezvous store. Chosen with SPARK_HVD_CPU_OPERATIONS=gloo; the control plane
// then stays on backend "tcp".
#pragma once

#include <list>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backends/backend.h"
#include "backends/communicator.h"
#include "backends/contiguous.h"

namespace gloo {
class Context;
class Algorithm;
}  // namespace gloo

namespace spark_hvd {

class GlooCommunicator : public Communicator {
 public:
  // Connects `members` (job ranks, sorted, this rank among them) through the store,
  // under "<store_prefix>/gloo/set<set_id>". Collective over the members.
  static std::unique_ptr<GlooCommunicator> Connect(const BackendOptions& options,
                                                   std::vector<int32_t> members, int32_t set_id);
  ~GlooCommunicator() override;

  const char* name() const override { return "gloo"; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }

  Status AllgatherFixed(const void* in, void* out, int64_t bytes) override;
  Status Allreduce(const ReduceArgs& args) override;
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank) override;
  Status Broadcast(void* buf, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                   const std::vector<int64_t>& recv_bytes) override;
  Status Barrier() override;
  std::unique_ptr<Communicator> Split(const std::vector<int32_t>& ranks, int32_t set_id) override;

 private:
  GlooCommunicator(const BackendOptions& options, std::vector<int32_t> members, int rank,
                   std::shared_ptr<gloo::Context> context);

  // One contiguous buffer, in SPARK_HVD_GLOO_CHUNK_BYTES pieces; `stable`: the
  // fusion buffer, whose algorithm objects are cached.
  Status ReduceContiguous(void* buf, int64_t count, DataType dtype, ReduceOp op, bool stable);
  // Stable-buffer counts round up to a few size classes (halving-doubling sets up per size).
  static int64_t SizeClass(int64_t count);

  // Set-up-once algorithm objects, reused while (pointer, count, dtype, op) repeat:
  // the fusion buffer keeps its address, so training steps hit this cache.
  using AlgoKey = std::tuple<void*, int64_t, int, int>;
  gloo::Algorithm* CachedAllreduce(void* buf, int64_t count, DataType dtype, ReduceOp op);
  std::unique_ptr<gloo::Algorithm> NewAllreduce(void* buf, int64_t count, DataType dtype,
                                                ReduceOp op);

  BackendOptions options_;
  std::vector<int32_t> members_;  // job ranks
  int rank_;
  std::shared_ptr<gloo::Context> context_;  // null with one rank
  FusionBuffer fusion_;
  struct CachedAlgo {
    AlgoKey key;
    int64_t scratch_bytes;  // what the algorithm holds besides the caller's buffer
    std::unique_ptr<gloo::Algorithm> algo;
  };
  std::list<CachedAlgo> algos_;  // LRU, front = newest
  int64_t algos_bytes_ = 0;
  uint32_t tag_ = 0;
};

}  // namespace spark_hvd
