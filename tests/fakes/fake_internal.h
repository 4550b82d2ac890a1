// What the fake NCCL (fake_nccl*.cc) needs from the fake CUDA runtime (fake_cudart.cc)
// beyond the public API: libshvd_fake_nccl.so links against libshvd_fake_cudart.so
// (DT_NEEDED by soname, rpath $ORIGIN), so both see one set of streams, allocations and
// current devices however the backend dlopens them. The names carry a shvd_fake_ prefix
// so that a real libcudart loaded elsewhere in the process can never interpose them.
#pragma once

#include <cstddef>

#include "backends/cuda/api.h"

extern "C" {

typedef void (*shvd_fake_work_fn)(void* arg);

// Queues fn(arg) on `stream`, behind everything queued there before; the null stream
// runs it now, in the calling thread. cudaErrorInvalidResourceHandle (400) for a
// stream that is not (or no longer) live; fn is not called then.
cudaError_t shvd_fake_enqueue(cudaStream_t stream, shvd_fake_work_fn fn, void* arg);

// Runs fn(arg) once each of the n streams (duplicates and the null stream allowed) has
// reached this point, and holds all of them until it returns: what ncclGroupEnd does
// for a group whose calls used several streams.
cudaError_t shvd_fake_enqueue_joined(const cudaStream_t* streams, int n, shvd_fake_work_fn fn,
                                     void* arg);

// Where [ptr, ptr + bytes) lies; *device is set for kShvdFakeDevice.
enum ShvdFakeMemory {
  kShvdFakeHost = 0,     // not from the fake's allocators (pageable host memory)
  kShvdFakeDevice = 1,   // inside one live cudaMalloc allocation
  kShvdFakePinned = 2,   // inside one live cudaMallocHost allocation
  kShvdFakeOverrun = 3,  // starts inside an allocation and runs past its end
};
int shvd_fake_memory_kind(const void* ptr, size_t bytes, int* device);

// Where the fake's streams read and write `ptr`: for device memory its second, read-write
// mapping (the address cudaMalloc returned has no host access), else ptr itself.
void* shvd_fake_view(const void* ptr);

// The device a stream was created on (the calling thread's current one for the null
// stream); 400 for a stream that is not live.
cudaError_t shvd_fake_stream_device(cudaStream_t stream, int* device);

// The calling thread's current device, and the "bus id" of a visible device: its index
// among SHVD_FAKE_CUDA_DEVICES physical devices after CUDA_VISIBLE_DEVICES (-1 if out of
// range). NCCL's duplicate-GPU check compares these, as the real one compares bus ids.
int shvd_fake_current_device(void);
int shvd_fake_physical_device(int device);

// -- for tests (by dlsym or ctypes on libshvd_fake_cudart.so) --------------------------

// Queues a "kernel" on `stream` that runs for `microseconds` (compute, as a test sees it).
cudaError_t shvd_fake_launch_kernel(cudaStream_t stream, unsigned int microseconds);

// Every stream item's wait from now on, for every stream of the process (initially
// SHVD_FAKE_CUDA_DELAY_US): a test makes a rank's GPU slow at the moment it chooses.
void shvd_fake_set_delay_us(int microseconds);

// The device-synchronizing calls this process made since the last reset (see the
// contract in fake_cudart.cc): their number, and a report "call on thread 'name' xN; ..."
// written into buf (its full length returned).
unsigned long long shvd_fake_sync_calls(void);
int shvd_fake_sync_report(char* buf, int size);
void shvd_fake_sync_reset(void);
// Bytes of live cudaMalloc allocations on `device` (its index in this process), or of
// live cudaMallocHost ones (device -1): what the tests read to see memory come back.
unsigned long long shvd_fake_live_bytes(int device);

}  // extern "C"
