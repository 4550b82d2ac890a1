// Small CUDA runtime helpers shared by the GPU backends (nccl/, staged/).
#pragma once

#include <string>
#include <vector>

#include "backends/communicator.h"
#include "backends/nccl/loader.h"

namespace spark_hvd {
namespace nccl {

// OK, or Internal naming the call and CUDA's text for err.
Status CudaStatus(const CudaApi* cuda, cudaError_t err, const std::string& what);
// Orders work queued on `stream` after what is queued on each of `producers` now.
Status WaitForStreams(const CudaApi* cuda, cudaStream_t stream,
                      const std::vector<void*>& producers);
// An event recorded behind everything queued on `stream` so far, for polling; null
// if none could be made, after waiting for the stream (the work is then finished).
cudaEvent_t EventAfterQueuedWork(const CudaApi* cuda, cudaStream_t stream);
// `bytes` of device memory on `device` (cudaFree when the Buffer's owner goes).
Status AllocateDevice(const CudaApi* cuda, int32_t device, int64_t bytes, Buffer* out);

}  // namespace nccl
}  // namespace spark_hvd
