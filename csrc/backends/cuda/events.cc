#include "backends/cuda/events.h"

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backends/cuda/util.h"
#include "common/free_list.h"

namespace spark_hvd {
namespace cuda {
namespace {

// Idle events by device; leaked, so that an event dropped during exit still has a pool.
struct Pools {
  std::mutex mu;
  std::map<int32_t, std::vector<cudaEvent_t>> idle;
};

Pools& ThePools() {
  static Pools* pools = new Pools;
  return *pools;
}

// The handles' shared counts, reused: a PooledEvent is made for every device op (its
// ready event, the event its completion is polled on), and a count from the heap would
// be an allocation per op. Leaked like the pools.
const std::shared_ptr<FreeList>& Counts() {
  static auto* counts = new std::shared_ptr<FreeList>(std::make_shared<FreeList>(4096));
  return *counts;
}

PooledEvent Wrap(cudaEvent_t event, int32_t device) {
  return PooledEvent(
      event,
      [device](cudaEvent_t e) {
        std::lock_guard<std::mutex> lock(ThePools().mu);
        ThePools().idle[device].push_back(e);
      },
      FreeListAllocator<char>(Counts()));
}

}  // namespace

Status TakeEvent(const CudaApi* cuda, int32_t device, PooledEvent* out) {
  {
    std::lock_guard<std::mutex> lock(ThePools().mu);
    auto& idle = ThePools().idle[device];
    if (!idle.empty()) {
      *out = Wrap(idle.back(), device);
      idle.pop_back();
      return Status::OK();
    }
  }
  cudaEvent_t event = nullptr;
  Status s = CudaStatus(cuda, cuda->EventCreateWithFlags(&event, cudaEventDisableTiming),
                        "cudaEventCreate");
  if (s.ok()) *out = Wrap(event, device);
  return s;
}

Status RecordReady(const CudaApi* cuda, int32_t device, void* stream, PooledEvent* out) {
  int current = -1;
  Status s = CudaStatus(cuda, cuda->GetDevice(&current), "cudaGetDevice");
  if (!s.ok()) return s;
  if (current != device) {
    return Status::InvalidArgument("the tensor is on GPU " + std::to_string(device) +
                                   " but the submitting thread's "
                                   "current CUDA device is " +
                                   std::to_string(current) +
                                   ": make the tensor's device "
                                   "current first (torch.cuda.set_device(" +
                                   std::to_string(device) +
                                   "), as each rank "
                                   "does with its local_rank())");
  }
  s = TakeEvent(cuda, device, out);
  if (s.ok()) {
    s = CudaStatus(cuda, cuda->EventRecord(out->get(), static_cast<cudaStream_t>(stream)),
                   "cudaEventRecord on the tensor's stream");
  }
  if (!s.ok()) out->reset();
  return s;
}

void ReleaseIdleEvents(const CudaApi* cuda) {
  std::map<int32_t, std::vector<cudaEvent_t>> idle;
  {
    std::lock_guard<std::mutex> lock(ThePools().mu);
    idle.swap(ThePools().idle);
  }
  for (auto& kv : idle) {
    for (cudaEvent_t e : kv.second) cuda->EventDestroy(e);
  }
}

}  // namespace cuda
}  // namespace spark_hvd
