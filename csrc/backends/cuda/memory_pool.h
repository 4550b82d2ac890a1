// MemoryPool: the device memory (and pinned host memory) the GPU backends reuse across
// steps, so that no op allocates or frees through CUDA in steady state: cudaMalloc and
// cudaFree (cudaMallocHost, cudaFreeHost) each wait for the whole GPU, stalling the
// training kernels, and a free while NCCL kernels are being launched on another thread is
// a known NCCL hang. A caching allocator: one pool per (device, kind), process-wide.
//
// Who holds what
// 1. Allocate hands out a block of the smallest size class that fits (classes a quarter
//    apart: 2^k, 1.25 * 2^k, 1.5 * 2^k, 1.75 * 2^k, from 512 bytes), an idle one of that
//    class when there is one, else a new one (cudaMalloc, the only allocation path).
// 2. The block comes back when the last copy of its Buffer's owner goes, on whatever
//    thread: the engine's (scratch and staging buffers, right after queuing the work that
//    uses them), InFlight's (an op's output, once the op completed), a Python thread (the
//    tensor a framework made of a DLPack output). A block remembers its last users: the
//    stream it was allocated for and, for an op's output, the stream the op was
//    submitted from (where the framework reads it). An event is recorded on each at
//    return when the returning thread's current device is the pool's (else at reuse,
//    which waits for more).
// 3. A block is reused by work on stream S after S waits for those events (a
//    cudaStreamWaitEvent, no host wait; none for S itself, whose order suffices, nor for
//    work already done), so nothing queued before the return sees the new contents.
//    Pinned blocks are also read and written by host code: the staged backend touches
//    one only after synchronizing the stream it was allocated for, which covers the wait.
// 4. Idle memory is bounded by SPARK_HVD_GPU_CACHE_BYTES per pool: a block returned
//    beyond it goes back to CUDA (on the shvd_cudafree thread, FreeLater), and the log
//    warns once. When the last communicator using the pool goes (Detach, at shutdown),
//    idle blocks are freed and blocks returned later go straight back to CUDA.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/communicator.h"
#include "backends/cuda/events.h"
#include "backends/cuda/loader.h"
#include "common/free_list.h"

namespace spark_hvd {
namespace cuda {

class MemoryPool : public std::enable_shared_from_this<MemoryPool> {
 public:
  enum Kind { kDevice, kPinned };

  // The pool of `device` and `kind` (pinned memory: the host memory a thread on `device`
  // allocates), made on first use; the same one while anything holds it.
  static std::shared_ptr<MemoryPool> Of(const CudaApi* cuda, int32_t device, Kind kind);

  // A communicator uses the pool from Attach to Detach; the last Detach frees the idle
  // blocks (step 4).
  void Attach();
  void Detach();

  // `bytes` for work queued on `stream`, on the engine thread with the pool's device
  // current. `user_stream`: where the block is read
  // after the op (its output), waited for before the block's reuse; null: none.
  Status Allocate(int64_t bytes, cudaStream_t stream, Buffer* out,
                  const cudaStream_t* user_stream = nullptr);

  // What the pool holds now: idle bytes, and bytes handed out.
  int64_t idle_bytes();
  int64_t used_bytes();

  static size_t SizeClass(int64_t bytes);

 private:
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;
    // Streams whose work must precede reuse (the one the block was allocated for, and the
    // user's stream of an output): an event recorded at return, or (recorded at reuse)
    // only the stream. Fixed room, so that a block's return allocates nothing.
    std::pair<cudaStream_t, PooledEvent> after[2];
    int n_after = 0;
  };
  MemoryPool(const CudaApi* cuda, int32_t device, Kind kind);
  void Return(Block block);
  // Orders `stream` after the block's last users (step 3); false if that cannot be done.
  bool OrderAfter(Block* block, cudaStream_t stream);
  void Release(void* ptr);  // to CUDA, on the shvd_cudafree thread
  Status Fresh(size_t size, void** ptr);

  const CudaApi* cuda_;
  const int32_t device_;
  const Kind kind_;
  // The shared counts of the owners Allocate hands out, reused (one per op otherwise).
  std::shared_ptr<FreeList> owner_counts_ = std::make_shared<FreeList>(1024);
  std::mutex mu_;
  std::map<size_t, std::vector<Block>> idle_;  // by size class
  int64_t idle_bytes_ = 0;
  int64_t used_bytes_ = 0;
  int users_ = 0;
  bool warned_ = false;
};

}  // namespace cuda
}  // namespace spark_hvd
