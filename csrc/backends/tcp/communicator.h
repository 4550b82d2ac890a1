// The CPU communicator of backend "tcp" (the default): spark_hvd's own TCP
// connections (TcpMesh, mesh.h) among the ranks of one process set. Also the
// control plane of jobs that meet through the rendezvous store.
#pragma once

#include <memory>
#include <vector>

#include "backends/backend.h"
#include "backends/communicator.h"
#include "backends/host_reduce.h"

namespace spark_hvd {

class TcpMesh;

class TcpCommunicator : public Communicator {
 public:
  // Connects `members` (job ranks, sorted, this rank among them) through the store,
  // under "<store_prefix>/tcp/set<set_id>". Collective over the members.
  static std::unique_ptr<TcpCommunicator> Connect(const BackendOptions& options,
                                                  std::vector<int32_t> members, int32_t set_id);
  ~TcpCommunicator() override;

  const char* name() const override { return "tcp"; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }

  Status AllgatherFixed(const void* in, void* out, int64_t bytes) override;
  Status AllreduceFixed(void* inout, int64_t bytes, Combine combine) override;
  Status Allreduce(const ReduceArgs& args) override;
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank) override;
  Status Broadcast(void* buf, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                   const std::vector<int64_t>& recv_bytes) override;
  Status Barrier() override;
  std::unique_ptr<Communicator> Split(const std::vector<int32_t>& ranks, int32_t set_id) override;

 private:
  TcpCommunicator(const BackendOptions& options, std::vector<int32_t> members, int rank,
                  std::unique_ptr<TcpMesh> mesh);

  BackendOptions options_;
  std::vector<int32_t> members_;  // job ranks
  int rank_;
  std::unique_ptr<TcpMesh> mesh_;     // null with one rank
  HostReduceScratch reduce_scratch_;  // HostAllreduce's, kept: no allocation per op
};

}  // namespace spark_hvd
