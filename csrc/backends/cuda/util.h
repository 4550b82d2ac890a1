// Small CUDA runtime helpers shared by the GPU backends (nccl/, staged/) and the
// Python boundary.
#pragma once

#include <string>
#include <vector>

#include "backends/communicator.h"
#include "backends/cuda/events.h"
#include "backends/cuda/loader.h"
#include "common/function_ref.h"

namespace spark_hvd {
namespace cuda {

// OK, or Internal naming the call and CUDA's text for err. The const char* form makes no
// string on success (the GPU path checks every call of every op).
Status CudaStatus(const CudaApi* cuda, cudaError_t err, const std::string& what);
inline Status CudaStatus(const CudaApi* cuda, cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::OK();
  return CudaStatus(cuda, err, std::string(what));
}
// Orders work queued on `stream` after each of `events` (ready events, events.h).
Status WaitForEvents(const CudaApi* cuda, cudaStream_t stream, const std::vector<void*>& events);
// An event (of `device`'s pool) recorded behind everything queued on `stream` so far,
// for polling.
Status EventAfterQueuedWork(const CudaApi* cuda, int32_t device, cudaStream_t stream,
                            PooledEvent* out);
// cudaEventQuery(event) after setting `device`, for a thread that polls work of that
// device (its current device would otherwise be 0: a context there, in every rank).
cudaError_t QueryOnDevice(const CudaApi* cuda, int32_t device, cudaEvent_t event);
// Frees device memory of `device` (cudaFree), or pinned host memory a thread on
// `device` allocated (cudaFreeHost), on a thread of its own (`shvd_cudafree`), which
// sets the device first. Both calls wait for all work queued on the device: done here they would
// stall the caller (the engine, the InFlight thread, Python holding the GIL when a
// tensor goes) until the GPU is idle, or for good while a collective waits for a
// lost peer that only the InFlight thread's abort can end. Steady-state memory comes
// from MemoryPool (memory_pool.h), which frees through here only beyond its bound and
// at shutdown.
void FreeLater(const CudaApi* cuda, int32_t device, void* ptr, bool pinned = false);
// Waits for the work queued on `stream` (of `device`) by polling an event, and gives up
// when `abort` says so (it returns a non-OK status: a lost peer, a deadline), so that
// no wait on a collective can outlast the failure of one of its peers.
Status WaitPolling(const CudaApi* cuda, int32_t device, cudaStream_t stream,
                   FunctionRef<Status()> abort);

}  // namespace cuda
}  // namespace spark_hvd
