#include "backends/nccl/cuda_util.h"

#include <algorithm>

namespace spark_hvd {
namespace nccl {

Status CudaStatus(const CudaApi* cuda, cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::OK();
  return Status::Internal("CUDA " + what + " failed: " + cuda->GetErrorString(err));
}

Status WaitForStreams(const CudaApi* cuda, cudaStream_t stream,
                      const std::vector<void*>& producers) {
  for (void* producer : producers) {
    cudaEvent_t ready;
    Status s = CudaStatus(cuda, cuda->EventCreateWithFlags(&ready, cudaEventDisableTiming),
                          "cudaEventCreate");
    if (!s.ok()) return s;
    s = CudaStatus(cuda, cuda->EventRecord(ready, static_cast<cudaStream_t>(producer)),
                   "cudaEventRecord");
    if (s.ok()) s = CudaStatus(cuda, cuda->StreamWaitEvent(stream, ready, 0), "cudaStreamWaitEvent");
    cuda->EventDestroy(ready);  // released once the wait has passed
    if (!s.ok()) return s;
  }
  return Status::OK();
}

cudaEvent_t EventAfterQueuedWork(const CudaApi* cuda, cudaStream_t stream) {
  cudaEvent_t done = nullptr;
  if (cuda->EventCreateWithFlags(&done, cudaEventDisableTiming) == cudaSuccess) {
    if (cuda->EventRecord(done, stream) == cudaSuccess) return done;
    cuda->EventDestroy(done);
  }
  // Cannot observe the work: wait for it here rather than release its buffers early.
  cuda->StreamSynchronize(stream);
  return nullptr;
}

Status AllocateDevice(const CudaApi* cuda, int32_t device, int64_t bytes, Buffer* out) {
  void* p = nullptr;
  Status s = CudaStatus(cuda, cuda->Malloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1))),
                        "cudaMalloc");
  if (!s.ok()) return s;
  out->data = p;
  out->bytes = bytes;
  out->device = device;
  out->owner = std::shared_ptr<void>(p, [cuda](void* q) { cuda->Free(q); });
  return Status::OK();
}

}  // namespace nccl
}  // namespace spark_hvd
