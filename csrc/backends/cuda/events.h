// CUDA events the GPU code reuses instead of creating one per op, and the ready event a
// device op records on its producer's stream when it is submitted.
//
// Why at submit: a framework queues an op's input on its current stream, submits the op,
// and goes on queueing the rest of its step (the backward pass) there. The op's stream must
// wait for the input only, so the event is recorded at the submit; one recorded when the
// op executes (after negotiation) would make it wait for everything queued since, and
// communication would stop overlapping compute.
#pragma once

#include <cstdint>
#include <memory>

#include "backends/cuda/loader.h"
#include "common/status.h"

namespace spark_hvd {
namespace cuda {

// An event of its device's pool: back in the pool when the last copy goes. Dropping one
// makes no CUDA call, so any thread may (a recorded event may be re-recorded once every
// cudaStreamWaitEvent on it has been queued: the waits keep the recording they saw).
using PooledEvent = std::shared_ptr<CUevent_st>;

// An event of `device`'s pool, made there (cudaEventCreate) if the pool is empty; the
// calling thread's current device must then be `device`.
Status TakeEvent(const CudaApi* cuda, int32_t device, PooledEvent* out);

// The ready event of an op on `device`, recorded now on `stream` (the input's producer;
// null: the legacy default stream, torch's default). InvalidArgument when the calling
// thread's current device is not `device` (the null stream is the current device's, and
// events are made on it), naming both and the fix.
Status RecordReady(const CudaApi* cuda, int32_t device, void* stream, PooledEvent* out);

// Destroys the events idle in every pool (at shutdown; the pools fill again on use).
void ReleaseIdleEvents(const CudaApi* cuda);

}  // namespace cuda
}  // namespace spark_hvd
