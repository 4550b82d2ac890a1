// The GPU communicator of backend "nccl": NCCL collectives on CUDA tensors, on a
// stream of its own. Work is queued, not waited for: after each op TakePending
// records an event behind everything queued for it, which the engine's InFlight
// polls; the op completes, and its buffers are released, when the event has passed.
// Allgather (ragged) is a group of broadcasts, alltoall a group of send/recv pairs;
// their outputs are allocated on the rank's GPU (Allocate). The NCCL communicator is made
// at the first op, when the rank's device is known (all members run that op
// together): rank 0 of the communicator creates the unique id and passes it
// through the rendezvous store.
//
// Reductions NCCL has natively run as one call (fused tensors through a device
// fusion buffer with device-to-device copies): Sum, Min, Max, Product, and float
// Average and pre/postscale as one ncclRedOpCreatePreMulSum factor. What it cannot
// express (integer Average, scale factors with Min/Max/Product or on integers) is
// staged through host memory around a plain NCCL reduction. bool reduces as uint8
// (Sum: Max, Product: Min); int16 has no NCCL type.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/communicator.h"
#include "backends/cuda/loader.h"
#include "backends/cuda/memory_pool.h"
#include "backends/nccl/comm_handle.h"
#include "backends/nccl/wait_marks.h"
#include "common/function_ref.h"

namespace spark_hvd {
namespace nccl {

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(const BackendOptions& options, std::vector<int32_t> members, int32_t set_id,
                   const cuda::CudaApi* cuda, const cuda::NcclApi* nccl);
  ~NcclCommunicator() override;

  const char* name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }

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

  Status Prepare(const DeviceInputs& inputs) override;
  Status Copy(void* dst, const void* src, int64_t bytes) override;
  Status Allocate(int64_t bytes, Buffer* out) override;  // from the GPU's MemoryPool
  std::unique_ptr<PendingWork> TakePending() override;
  void Abort() override;

 private:
  Status Connect(int32_t device);  // the NCCL communicator, collectively
  Status InitRank(const std::shared_ptr<CommHandle>& handle, int32_t device,
                  const ncclUniqueId& id);
  Status CudaCheck(cudaError_t err, const char* what) const;
  // OK, the Status of an NCCL failure, or, for a call on a non-blocking communicator that
  // returned ncclInProgress, what Settle says.
  Status NcclCheck(ncclResult_t err, const char* what) const;
  // settle.cc: waits (polling, `mu` held) until the non-blocking communicator's last call
  // is no longer in progress; within SPARK_HVD_TIMEOUT_S, else asks the abort (CommHandle
  // 5) and says which members never reached this call (marks_).
  Status Settle(const char* what) const;

  // Runs `calls` (NCCL calls on the communicator, and their checks) through
  // CommHandle::Call (one thread at a time), unless an abort was asked: PeerLost then.
  Status OnComm(FunctionRef<Status()> calls);
  Status Aborted() const;
  // Members the rendezvous service reports lost (none when it cannot say).
  std::vector<int32_t> MembersLost() const;
  // Waits for this rank's stream, giving up (and aborting the communicator) on an
  // NCCL error, a lost member or SPARK_HVD_TIMEOUT_S.
  Status WaitForStream();

  // Scratch (a fusion buffer) on this rank's GPU for work about to be queued on the
  // stream; the pool reuses it once that work is done, whenever the Buffer goes.
  Status Scratch(size_t bytes, Buffer* out);
  bool WithNcclOp(const ReduceArgs& a, ncclDataType_t dtype, FunctionRef<Status(ncclRedOp_t)> run,
                  Status* status);
  Status Native(const ReduceArgs& a, ncclDataType_t dtype, ncclRedOp_t op, size_t count);
  Status Staged(const ReduceArgs& a, ncclDataType_t dtype, ncclRedOp_t op, size_t count);

  BackendOptions options_;
  std::vector<int32_t> members_;  // job ranks
  int32_t set_id_;
  int rank_;
  const cuda::CudaApi* cuda_;
  const cuda::NcclApi* nccl_;
  std::shared_ptr<CommHandle> comm_;
  int32_t device_ = -1;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<cuda::MemoryPool> pool_;  // this rank's GPU memory (Attached while connected)
  bool user_stream_known_ = false;          // the op's outputs are read on user_stream_
  cudaStream_t user_stream_ = nullptr;
  bool queued_ = false;                     // work queued since the last TakePending
  uint64_t calls_made_ = 0;                 // OnComm calls, the same sequence on every member
  std::shared_ptr<const WaitMarks> marks_;  // who waits in which call (wait_marks.h)
  std::vector<std::vector<uint8_t>> keep_;  // host memory the queued copies read
};

}  // namespace nccl
}  // namespace spark_hvd
