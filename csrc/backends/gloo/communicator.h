// The CPU communicator (backend name "gloo"), also the default control plane. Its
// control plane and, by default, every collective run on spark_hvd's own TCP
// connections (TcpMesh); SPARK_HVD_GLOO_DATA_PLANE=gloo runs the collectives on
// Gloo's pairs and algorithms instead.
#pragma once

#include <functional>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backends/communicator.h"
#include "rendezvous/store.h"

namespace gloo {
class Context;
class Algorithm;
}  // namespace gloo

namespace spark_hvd {

class TcpMesh;

struct GlooOptions {
  std::string bind_host = "127.0.0.1";  // address peers reach this rank on
  double timeout_s = 30.0;               // transport timeout (silent peer)
  double connect_timeout_s = 60.0;       // rendezvous timeout
  // Ranks of this communicator the job has lost; asked while connecting (may be empty).
  std::function<std::vector<int>()> lost_peers;
};

class GlooCommunicator : public Communicator {
 public:
  // Connects a full mesh among `size` ranks through `store` (keys under its prefix).
  static std::unique_ptr<GlooCommunicator> Connect(int rank, int size, std::shared_ptr<Store> store,
                                                   const GlooOptions& options);
  ~GlooCommunicator() override;

  const char* name() const override { return "gloo"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool Accepts(int32_t device) const override { return device == kCpuDevice; }

  Status AllgatherFixed(const void* in, void* out, int64_t bytes) override;
  Status Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op,
                   bool stable_buffer) override;
  int64_t StableAllreduceCount(int64_t count) const override;
  bool SegmentedAllreduce() const override { return !gloo_plane_ && mesh_ != nullptr; }
  Status AllreduceSegments(const std::vector<Segment>& segments, DataType dtype, ReduceOp op,
                           double scale) override;
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank) override;
  Status Broadcast(void* buf, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                   const std::vector<int64_t>& recv_bytes) override;
  Status Barrier() override;

 private:
  GlooCommunicator(int rank, int size, std::shared_ptr<gloo::Context> context,
                   std::unique_ptr<TcpMesh> mesh);

  // Set-up-once algorithm objects, reused while (pointer, count, dtype, op) repeat:
  // the engine's fusion buffer keeps its address, so training steps hit this cache.
  using AlgoKey = std::tuple<void*, int64_t, int, int>;
  gloo::Algorithm* CachedAllreduce(void* buf, int64_t count, DataType dtype, ReduceOp op);
  std::unique_ptr<gloo::Algorithm> NewAllreduce(void* buf, int64_t count, DataType dtype,
                                                ReduceOp op);

  int rank_;
  int size_;
  std::shared_ptr<gloo::Context> context_;  // only with the "gloo" data plane
  // Our own connections (null in a one-rank job).
  std::unique_ptr<TcpMesh> mesh_;
  bool gloo_plane_;  // collectives on Gloo's context (else on mesh_)
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
