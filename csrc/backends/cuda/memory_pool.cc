#include "backends/cuda/memory_pool.h"

#include <utility>

#include "backends/cuda/util.h"
#include "common/env.h"
#include "common/logging.h"

namespace spark_hvd {
namespace cuda {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::pair<int32_t, int>, std::weak_ptr<MemoryPool>> pools;
};

Registry& TheRegistry() {
  static Registry* registry = new Registry;  // leaked: blocks may come back during exit
  return *registry;
}

}  // namespace

std::shared_ptr<MemoryPool> MemoryPool::Of(const CudaApi* cuda, int32_t device, Kind kind) {
  std::lock_guard<std::mutex> lock(TheRegistry().mu);
  auto& weak = TheRegistry().pools[{device, static_cast<int>(kind)}];
  std::shared_ptr<MemoryPool> pool = weak.lock();
  if (!pool) {
    pool.reset(new MemoryPool(cuda, device, kind));
    weak = pool;
  }
  return pool;
}

MemoryPool::MemoryPool(const CudaApi* cuda, int32_t device, Kind kind)
    : cuda_(cuda), device_(device), kind_(kind) {}

size_t MemoryPool::SizeClass(int64_t bytes) {
  const size_t n = static_cast<size_t>(bytes);
  if (n <= 512) return 512;
  const size_t p = size_t(1) << (63 - __builtin_clzll(static_cast<unsigned long long>(n)));
  if (n == p) return p;
  const size_t step = p / 4;
  return p + (n - p + step - 1) / step * step;
}

void MemoryPool::Attach() {
  std::lock_guard<std::mutex> lock(mu_);
  ++users_;
}

void MemoryPool::Detach() {
  std::map<size_t, std::vector<Block>> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--users_ > 0) return;
    idle.swap(idle_);
    idle_bytes_ = 0;
  }
  for (auto& kv : idle) {
    for (auto& b : kv.second) Release(b.ptr);
  }
  idle.clear();  // their events go back to the event pool first
  ReleaseIdleEvents(cuda_);
}

int64_t MemoryPool::idle_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return idle_bytes_;
}

int64_t MemoryPool::used_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return used_bytes_;
}

void MemoryPool::Release(void* ptr) { FreeLater(cuda_, device_, ptr, kind_ == kPinned); }

Status MemoryPool::Fresh(size_t size, void** ptr) {
  auto allocate = [&] {
    return kind_ == kDevice ? cuda_->Malloc(ptr, size) : cuda_->MallocHost(ptr, size);
  };
  cudaError_t err = allocate();
  if (err != cudaSuccess) {  // out of memory, perhaps: give the idle blocks back and retry
    std::map<size_t, std::vector<Block>> idle;
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle.swap(idle_);
      idle_bytes_ = 0;
    }
    for (auto& kv : idle) {
      for (auto& b : kv.second) {
        if (kind_ == kDevice) {
          cuda_->Free(b.ptr);  // here, not later: the memory is needed now
        } else {
          cuda_->FreeHost(b.ptr);
        }
      }
    }
    err = allocate();
  }
  return CudaStatus(cuda_, err,
                    std::string(kind_ == kDevice ? "cudaMalloc" : "cudaMallocHost") + " of " +
                        std::to_string(size) + " bytes on GPU " + std::to_string(device_));
}

Status MemoryPool::Allocate(int64_t bytes, cudaStream_t stream, Buffer* out,
                            const cudaStream_t* user_stream) {
  const size_t size = SizeClass(bytes);
  Block block;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.find(size);
    if (it != idle_.end() && !it->second.empty()) {
      block = std::move(it->second.back());
      it->second.pop_back();
      idle_bytes_ -= static_cast<int64_t>(size);
    }
  }
  if (block.ptr != nullptr && !OrderAfter(&block, stream)) {
    Release(block.ptr);  // its last users cannot be waited for: let CUDA's free do it
    block.ptr = nullptr;
  }
  if (block.ptr == nullptr) {
    Status s = Fresh(size, &block.ptr);
    if (!s.ok()) return s;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    used_bytes_ += static_cast<int64_t>(size);
  }
  out->data = block.ptr;
  out->bytes = bytes;
  out->device = kind_ == kDevice ? device_ : kCpuDevice;
  std::shared_ptr<MemoryPool> self = shared_from_this();
  const bool for_user = user_stream != nullptr;
  const cudaStream_t user = for_user ? *user_stream : nullptr;
  out->owner = std::shared_ptr<void>(
      block.ptr,
      [self, size, stream, for_user, user](void* p) {
        Block b;
        b.ptr = p;
        b.size = size;
        b.after[b.n_after++].first = stream;
        if (for_user && user != stream) b.after[b.n_after++].first = user;
        self->Return(std::move(b));
      },
      FreeListAllocator<char>(owner_counts_));
  return Status::OK();
}

void MemoryPool::Return(Block b) {
  bool open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    used_bytes_ -= static_cast<int64_t>(b.size);
    open = users_ > 0;
  }
  if (!open) return Release(b.ptr);
  int current = -1;
  if (cuda_->GetDevice(&current) == cudaSuccess && current == device_) {
    for (int i = 0; i < b.n_after; ++i) {  // step 2: what the last users queued so far
      auto& a = b.after[i];
      PooledEvent ev;
      if (!TakeEvent(cuda_, device_, &ev).ok() ||
          cuda_->EventRecord(ev.get(), a.first) != cudaSuccess) {
        return Release(b.ptr);  // a stream that is gone: CUDA's free waits for everything
      }
      a.second = std::move(ev);
    }
  }
  const int64_t cap = env::GpuCacheBytes();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (users_ > 0 && idle_bytes_ + static_cast<int64_t>(b.size) <= cap) {
      idle_bytes_ += static_cast<int64_t>(b.size);
      idle_[b.size].push_back(std::move(b));
      return;
    }
    if (users_ > 0 && !warned_) {
      warned_ = true;
      SHVD_LOG(kWarning, "gpu") << "the " << (kind_ == kDevice ? "GPU" : "pinned host")
                                << " memory cache of GPU " << device_ << " holds " << idle_bytes_
                                << " idle bytes, SPARK_HVD_GPU_CACHE_BYTES=" << cap
                                << ": a block of " << b.size
                                << " bytes goes back to CUDA, whose free waits for the whole "
                                   "GPU; raise SPARK_HVD_GPU_CACHE_BYTES if this repeats every "
                                   "step";
    }
  }
  Release(b.ptr);
}

bool MemoryPool::OrderAfter(Block* block, cudaStream_t stream) {
  for (int i = 0; i < block->n_after; ++i) {
    auto& a = block->after[i];
    if (a.first == stream) continue;  // the same stream: its own order suffices
    PooledEvent ev = a.second;
    if (!ev) {  // not recorded at return: record now (later, so it waits for more)
      if (!TakeEvent(cuda_, device_, &ev).ok() ||
          cuda_->EventRecord(ev.get(), a.first) != cudaSuccess) {
        return false;
      }
    }
    if (cuda_->EventQuery(ev.get()) == cudaSuccess) continue;  // done already
    if (cuda_->StreamWaitEvent(stream, ev.get(), 0) != cudaSuccess) return false;
  }
  for (int i = 0; i < block->n_after; ++i) block->after[i] = {};
  block->n_after = 0;
  return true;
}

}  // namespace cuda
}  // namespace spark_hvd
