#include "backends/cuda/util.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace spark_hvd {
namespace cuda {

Status CudaStatus(const CudaApi* cuda, cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::OK();
  return Status::Internal("CUDA " + what + " failed: " + cuda->GetErrorString(err));
}

Status WaitForEvents(const CudaApi* cuda, cudaStream_t stream, const std::vector<void*>& events) {
  for (void* event : events) {
    Status s = CudaStatus(cuda, cuda->StreamWaitEvent(stream, static_cast<cudaEvent_t>(event), 0),
                          "cudaStreamWaitEvent (on an input's ready event)");
    if (!s.ok()) return s;
  }
  return Status::OK();
}

Status EventAfterQueuedWork(const CudaApi* cuda, int32_t device, cudaStream_t stream,
                            PooledEvent* out) {
  Status s = TakeEvent(cuda, device, out);
  if (s.ok()) s = CudaStatus(cuda, cuda->EventRecord(out->get(), stream), "cudaEventRecord");
  if (!s.ok()) out->reset();
  return s;
}

cudaError_t QueryOnDevice(const CudaApi* cuda, int32_t device, cudaEvent_t event) {
  cuda->SetDevice(device);
  return cuda->EventQuery(event);
}

namespace {

class Reaper {
 public:
  void Push(const CudaApi* cuda, int32_t device, void* ptr, bool pinned) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) {
      started_ = true;
      std::thread([this] { Loop(); }).detach();  // lives as long as the process
    }
    queue_.push_back(Item{cuda, device, ptr, pinned});
    cv_.notify_one();
  }

 private:
  struct Item {
    const CudaApi* cuda;
    int32_t device;
    void* ptr;
    bool pinned;
  };
  void Loop() {
#ifdef __linux__
    pthread_setname_np(pthread_self(), "shvd_cudafree");
#endif
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return !queue_.empty(); });
      Item item = queue_.front();
      queue_.pop_front();
      lock.unlock();
      // The memory's own device: a CUDA call on device 0 (this thread's default) would
      // make a context there in every rank.
      if (item.device >= 0) item.cuda->SetDevice(item.device);
      if (item.pinned) {
        item.cuda->FreeHost(item.ptr);
      } else {
        item.cuda->Free(item.ptr);
      }
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool started_ = false;
};

}  // namespace

void FreeLater(const CudaApi* cuda, int32_t device, void* ptr, bool pinned) {
  static Reaper* reaper = new Reaper;  // never destroyed: frees may come during exit
  if (ptr != nullptr) reaper->Push(cuda, device, ptr, pinned);
}

Status WaitPolling(const CudaApi* cuda, int32_t device, cudaStream_t stream,
                   FunctionRef<Status()> abort) {
  PooledEvent done;
  Status s = EventAfterQueuedWork(cuda, device, stream, &done);
  auto pause = std::chrono::microseconds(10);
  while (s.ok()) {
    const cudaError_t q = cuda->EventQuery(done.get());
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      s = CudaStatus(cuda, q, "cudaEventQuery");
      break;
    }
    s = abort();
    if (!s.ok()) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  return s;
}

}  // namespace cuda
}  // namespace spark_hvd
