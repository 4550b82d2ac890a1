// The communicator of backend "staged": GPU tensors through pinned host memory on a
// CPU communicator among the same ranks (tcp, gloo or mpi). For jobs where NCCL is
// not there (the CUDA runtime is), where SPARK_HVD_GPU_OPERATIONS names a CPU
// backend, or where several ranks share one GPU (which NCCL refuses). Each op waits
// for its inputs' ready events, copies them to pinned host memory on its own stream, runs
// the CPU collective, and queues the copies back; the op completes (InFlight) when they
// have run. Its pinned buffers go back to their pool once the copies are queued: a
// later user orders its work after them, and the host touches one only after a Wait().
#pragma once

#include <memory>
#include <vector>

#include "backends/communicator.h"
#include "backends/cuda/loader.h"
#include "backends/cuda/memory_pool.h"

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

  Status Prepare(const DeviceInputs& inputs) override;
  Status Copy(void* dst, const void* src, int64_t bytes) override;
  Status Allocate(int64_t bytes, Buffer* out) override;
  std::unique_ptr<PendingWork> TakePending() override;
  void Abort() override;  // the host communicator's

 private:
  Status Check(cudaError_t err, const char* what) const;
  // Pinned host memory from the pool, for the current op; the host reads or writes it only
  // after a Wait(), which covers whatever its previous users queued (memory_pool.h).
  Status Pinned(int64_t bytes, void** out);
  Status ToHost(void* host, const void* device, int64_t bytes);
  Status ToDevice(void* device, const void* host, int64_t bytes);
  Status Wait();  // for the stream: the host copies are complete

  std::unique_ptr<Communicator> host_;
  const cuda::CudaApi* cuda_;
  int32_t device_ = -1;
  cudaStream_t stream_ = nullptr;
  // This rank's GPU memory and pinned host memory (Attached from the first op on).
  std::shared_ptr<cuda::MemoryPool> device_pool_, pinned_pool_;
  bool user_stream_known_ = false;  // the op's outputs are read on user_stream_
  cudaStream_t user_stream_ = nullptr;
  bool queued_ = false;                        // copies queued since the last TakePending
  std::vector<std::shared_ptr<void>> pinned_;  // of the current op
  ReduceArgs staged_;                          // Allreduce's host-side arguments, kept
};

}  // namespace spark_hvd
