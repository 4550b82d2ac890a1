// The communicator of backend "staged": GPU tensors through pinned host memory on a
// CPU communicator among the same ranks (tcp, gloo or mpi). For jobs where NCCL is
// not there (the CUDA runtime is), where SPARK_HVD_GPU_OPERATIONS names a CPU
// backend, or where several ranks share one GPU (which NCCL refuses). Each op waits
// for its inputs' streams, copies them to host memory on its own stream, runs the
// CPU collective, and queues the copies back; the op completes (InFlight) when they
// have run, and only then are its pinned buffers freed.
#pragma once

#include <memory>
#include <vector>

#include "backends/communicator.h"
#include "backends/cuda/loader.h"

namespace spark_hvd {

class StagedCommunicator : public Communicator {
 public:
  StagedCommunicator(std::unique_ptr<Communicator> host, const cuda::CudaApi* cuda);
  ~StagedCommunicator() override;

  const char* name() const override { return "staged"; }
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }

  Status AllgatherFixed(const void* in, void* out, int64_t bytes) override;
  Status Allreduce(const ReduceArgs& args) override;
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank) override;
  Status Broadcast(void* buf, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                   const std::vector<int64_t>& recv_bytes) override;
  Status Barrier() override { return host_->Barrier(); }
  std::unique_ptr<Communicator> Split(const std::vector<int32_t>& ranks, int32_t set_id) override;

  Status Prepare(int32_t device, const std::vector<void*>& streams) override;
  Status Copy(void* dst, const void* src, int64_t bytes) override;
  Status Allocate(int64_t bytes, Buffer* out) override;
  std::unique_ptr<PendingWork> TakePending() override;
  void Abort() override;  // the host communicator's

 private:
  Status Check(cudaError_t err, const char* what) const;
  // Pinned host memory, kept until the op's queued copies have run.
  Status Pinned(int64_t bytes, void** out);
  Status ToHost(void* host, const void* device, int64_t bytes);
  Status ToDevice(void* device, const void* host, int64_t bytes);
  Status Wait();  // for the stream: the host copies are complete

  std::unique_ptr<Communicator> host_;
  const cuda::CudaApi* cuda_;
  int32_t device_ = -1;
  cudaStream_t stream_ = nullptr;
  bool queued_ = false;
  std::vector<std::shared_ptr<void>> pinned_;  // of the current op
};

}  // namespace spark_hvd
