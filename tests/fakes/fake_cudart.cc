// libshvd_fake_cudart.so: the CUDA runtime subset of csrc/backends/cuda/api.h over host
// memory, for testing the NCCL backend where there is no GPU. It is strict where a real
// GPU would fail or give wrong results, so such code fails here too.
//
// Contract
// * Devices: SHVD_FAKE_CUDA_DEVICES physical devices (default 1); CUDA_VISIBLE_DEVICES,
//   when set, selects and orders them as with real CUDA (entries up to the first invalid
//   one; an empty value hides all: cudaGetDeviceCount -> cudaErrorNoDevice). The current
//   device is per host thread (default 0); cudaSetDevice out of range ->
//   cudaErrorInvalidDevice (101).
// * "Device" memory is host memory the host cannot touch: cudaMalloc maps a shared
//   memory object twice, the address it returns without any access (so host code that
//   reads or writes device memory, or passes a device pointer where a host one belongs,
//   dies of SIGSEGV, as it would on a GPU) and a second, read-write mapping that only
//   the fake's streams (and the fake NCCL, through shvd_fake_view) use. 256-byte (in
//   fact page) aligned, filled with 0xFF bytes (NaN for floating types, -1 for integers)
//   so a result that is never written shows; 0 bytes gives nullptr. It remembers its
//   device. cudaFree of anything but a live cudaMalloc base pointer ->
//   cudaErrorInvalidValue (1); cudaFree(nullptr) is a no-op. cudaMallocHost/cudaFreeHost:
//   pinned host memory (readable by the host), tracked apart (freeing one kind with the
//   other's call -> 1). Like the real ones, cudaFree and cudaFreeHost first wait for all
//   work queued on every stream (an implicit device synchronization).
// * Device-wide synchronizing calls are counted per process, by call and calling
//   thread's name: cudaMalloc, cudaFree, cudaMallocHost, cudaFreeHost,
//   cudaDeviceSynchronize, and cudaStreamSynchronize of the null stream or of a stream
//   that no spark_hvd thread (named shvd_*) created. shvd_fake_sync_calls/_report/_reset
//   (fake_internal.h) read and clear the counts, so a test can forbid them in steady state.
// * shvd_fake_launch_kernel(stream, us) queues a "kernel" that runs for `us`
//   microseconds: a test's stand-in for compute queued on a stream.
// * cudaMemcpyAsync checks the kind: a HostToDevice/DeviceToDevice destination and a
//   DeviceToHost/DeviceToDevice source must lie inside one live cudaMalloc allocation,
//   and the host side of HostToDevice/DeviceToHost/HostToHost must not be device memory
//   (else 1); cudaMemcpyDefault takes any mix; a range that runs past the end of an
//   allocation -> 1; kind > 4 -> cudaErrorInvalidMemcpyDirection (21).
//   cudaMemsetAsync needs device memory. Both read and write the memory when the stream
//   runs them, not when called (stricter than pageable-memory copies on a real GPU).
// * Streams (cudaStreamCreateWithFlags; flags 0 or cudaStreamNonBlocking) each have a
//   worker thread running their queue strictly in order; each item first sleeps
//   SHVD_FAKE_CUDA_DELAY_US microseconds (default 200; shvd_fake_set_delay_us changes it
//   for every stream of the process from then on), so reading a result without
//   waiting for the stream sees the old value. The null stream (0) runs its work at
//   once in the calling thread, like a per-thread default stream: no implicit
//   synchronization with other streams (code relying on the legacy default stream's
//   implicit waits gets stale data here). With SHVD_FAKE_CUDA_LEGACY_STREAM=1 it is
//   instead queued like the others, one per device (the calling thread's current one),
//   as the legacy default stream that torch's default stream is: work queued there
//   runs later, so code that reads a tensor produced there without waiting for it
//   sees the old value (its implicit waits on blocking streams are still not modelled).
//   cudaStreamSynchronize waits for the queue to drain; cudaStreamDestroy waits, then
//   joins the worker.
// * Events: cudaEventRecord(e, s) queues a marker; cudaEventQuery -> cudaSuccess once
//   the most recent recording's marker ran (or if never recorded), else
//   cudaErrorNotReady (600); cudaEventSynchronize blocks for it; cudaStreamWaitEvent(s,
//   e, 0) makes s wait for e's most recent recording at the time of the call (nothing if
//   never recorded); flags other than 0 -> 1.
// * Handles are never reused: a destroyed stream or event -> cudaErrorInvalidResourceHandle
//   (400); cudaGetErrorString names every code returned here.
// * Contexts: with SHVD_FAKE_CUDA_EXCLUSIVE_DIR=<dir> the devices are in the
//   EXCLUSIVE_PROCESS compute mode: the first call that needs a context on a physical
//   device (every call but cudaGetDeviceCount, cudaGetDevice, cudaGetErrorString and
//   cudaRuntimeGetVersion; it is made on the calling thread's current device, default 0,
//   and cudaSetDevice makes one on the device it sets, as CUDA 12 does) claims the device
//   for the process (the file <dir>/gpu<N> holds its pid); a call of another live process
//   needing that device -> cudaErrorDevicesUnavailable (46), naming both on stderr. So a
//   thread that forgets cudaSetDevice in a rank whose GPU is not 0 fails here, where a real
//   GPU would quietly make a second context on GPU 0 (or fail the same way).
// * cudaRuntimeGetVersion -> 12040.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "fake_internal.h"

namespace {

constexpr cudaError_t kErrInvalidValue = 1;
constexpr cudaError_t kErrMemoryAllocation = 2;
constexpr cudaError_t kErrInvalidMemcpyDirection = 21;
constexpr cudaError_t kErrNoDevice = 100;
constexpr cudaError_t kErrInvalidDevice = 101;
constexpr cudaError_t kErrDevicesUnavailable = 46;
constexpr cudaError_t kErrInvalidResourceHandle = 400;
constexpr size_t kAlignment = 256;

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

// CUDA_VISIBLE_DEVICES over SHVD_FAKE_CUDA_DEVICES physical devices.
std::vector<int> VisibleDevices() {
  const int physical = std::max(0, EnvInt("SHVD_FAKE_CUDA_DEVICES", 1));
  std::vector<int> visible;
  const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
  if (!env) {
    for (int d = 0; d < physical; ++d) visible.push_back(d);
    return visible;
  }
  std::string list(env);
  size_t pos = 0;
  while (pos < list.size()) {
    size_t end = list.find(',', pos);
    if (end == std::string::npos) end = list.size();
    std::string item = list.substr(pos, end - pos);
    char* rest = nullptr;
    long d = std::strtol(item.c_str(), &rest, 10);
    if (item.empty() || *rest || d < 0 || d >= physical ||
        std::find(visible.begin(), visible.end(), int(d)) != visible.end())
      break;
    visible.push_back(int(d));
    pos = end + 1;
  }
  return visible;
}

// Each stream item's wait (SHVD_FAKE_CUDA_DELAY_US; shvd_fake_set_delay_us changes it).
std::atomic<int>& DelayUs() {
  static std::atomic<int>* delay =
      new std::atomic<int>(std::max(0, EnvInt("SHVD_FAKE_CUDA_DELAY_US", 200)));
  return *delay;
}

class Stream {
 public:
  Stream(int device, bool core) : device_(device), core_(core) {
    worker_ = std::thread([this] { Loop(); });
  }
  int device() const { return device_; }
  bool core() const { return core_; }  // made by one of spark_hvd's threads (shvd_*)

  void Push(std::function<void()> work) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(work));
    cv_.notify_all();
  }
  void Drain() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return queue_.empty() && !running_; });
  }
  void Stop() {
    Drain();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    worker_.join();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      std::function<void()> work = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
      lock.unlock();
      const int delay_us = DelayUs().load();
      if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      work();
      lock.lock();
      running_ = false;
      cv_.notify_all();
    }
  }

  const int device_;
  const bool core_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool running_ = false;
  bool stop_ = false;
  std::thread worker_;
};

class Event {
 public:
  uint64_t Record() {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.insert(++latest_);
    return latest_;
  }
  void Complete(uint64_t gen) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.erase(gen);
    cv_.notify_all();
  }
  uint64_t Latest() {
    std::lock_guard<std::mutex> lock(mu_);
    return latest_;
  }
  bool Done(uint64_t gen) {
    std::lock_guard<std::mutex> lock(mu_);
    return !pending_.count(gen);
  }
  void Wait(uint64_t gen) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !pending_.count(gen); });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t latest_ = 0;         // generation of the most recent cudaEventRecord
  std::set<uint64_t> pending_;  // recorded generations whose marker has not run yet
};

struct Allocation {
  size_t bytes;
  int device;
  char* view;     // where the fake's streams read and write it (pinned memory: itself)
  size_t mapped;  // device memory: the length of both mappings
};

// The calling thread's name ("" if it has none).
std::string ThreadName() {
  char name[32] = {};
  pthread_getname_np(pthread_self(), name, sizeof name);
  return name;
}

// Calls that synchronize the whole device (or a stream the core does not own), counted
// per (call, calling thread's name) for tests that forbid them in steady state.
class SyncCalls {
 public:
  void Count(const char* call) {
    const std::string key = std::string(call) + " on thread '" + ThreadName() + "'";
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[key];
    ++total_;
  }
  unsigned long long Total() {
    std::lock_guard<std::mutex> lock(mu_);
    return total_;
  }
  std::string Report() {
    std::lock_guard<std::mutex> lock(mu_);
    std::string out;
    for (const auto& kv : counts_)
      out += (out.empty() ? "" : "; ") + kv.first + " x" + std::to_string(kv.second);
    return out;
  }
  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    counts_.clear();
    total_ = 0;
  }

 private:
  std::mutex mu_;
  std::map<std::string, unsigned long long> counts_;
  unsigned long long total_ = 0;
};

SyncCalls& Syncs() {
  static SyncCalls* calls = new SyncCalls;  // leaked, as Runtime
  return *calls;
}

// The process's fake CUDA state; leaked on purpose so stream workers never see it
// destroyed at exit.
class Runtime {
 public:
  const std::vector<int> visible = VisibleDevices();

  // Device memory (device >= 0): one shared memory object mapped twice, without access
  // at the address handed out and read-write at `view` for the streams. Pinned (-1):
  // plain host memory.
  cudaError_t Allocate(std::map<uintptr_t, Allocation>* table, void** ptr, size_t bytes,
                       int device) {
    if (!ptr) return kErrInvalidValue;
    *ptr = nullptr;
    if (bytes == 0) return cudaSuccess;
    size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    Allocation a{bytes, device, nullptr, 0};
    void* p = nullptr;
    if (device < 0) {
      p = std::aligned_alloc(kAlignment, rounded);
      if (!p) return kErrMemoryAllocation;
      a.view = static_cast<char*>(p);
    } else {
      const size_t page = size_t(::sysconf(_SC_PAGESIZE));
      a.mapped = (rounded + page - 1) / page * page;
      int fd = ::memfd_create("shvd_fake_device_memory", MFD_CLOEXEC);
      if (fd < 0 || ::ftruncate(fd, off_t(a.mapped)) != 0) {
        if (fd >= 0) ::close(fd);
        return kErrMemoryAllocation;
      }
      p = ::mmap(nullptr, a.mapped, PROT_NONE, MAP_SHARED, fd, 0);
      void* view = ::mmap(nullptr, a.mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      ::close(fd);
      if (p == MAP_FAILED || view == MAP_FAILED) {
        if (p != MAP_FAILED) ::munmap(p, a.mapped);
        if (view != MAP_FAILED) ::munmap(view, a.mapped);
        return kErrMemoryAllocation;
      }
      a.view = static_cast<char*>(view);
      std::memset(a.view, 0xFF, a.mapped);
    }
    std::lock_guard<std::mutex> lock(mu_);
    (*table)[uintptr_t(p)] = a;
    *ptr = p;
    return cudaSuccess;
  }

  cudaError_t Release(std::map<uintptr_t, Allocation>* table, void* ptr) {
    if (!ptr) return cudaSuccess;
    SynchronizeAll();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table->find(uintptr_t(ptr));
    if (it == table->end()) return kErrInvalidValue;
    const Allocation a = it->second;
    table->erase(it);
    if (a.mapped) {
      ::munmap(ptr, a.mapped);
      ::munmap(a.view, a.mapped);
    } else {
      std::free(ptr);
    }
    return cudaSuccess;
  }

  // Bytes of live allocations in `table` (device >= -1: of that device only; pinned: -1).
  unsigned long long LiveBytes(const std::map<uintptr_t, Allocation>& table, int device) {
    std::lock_guard<std::mutex> lock(mu_);
    unsigned long long total = 0;
    for (const auto& [base, a] : table) {
      if (a.device == device) total += a.bytes;
    }
    return total;
  }

  // Where the streams touch [ptr, ptr + bytes): device memory's second mapping, anything
  // else itself.
  void* View(const void* ptr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = device_mem.upper_bound(uintptr_t(ptr));
    if (it == device_mem.begin()) return const_cast<void*>(ptr);
    --it;
    const uintptr_t base = it->first;
    if (uintptr_t(ptr) >= base + it->second.mapped) return const_cast<void*>(ptr);
    return it->second.view + (uintptr_t(ptr) - base);
  }

  int Kind(const void* ptr, size_t bytes, int* device) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto* table : {&device_mem, &pinned_mem}) {
      auto it = table->upper_bound(uintptr_t(ptr));
      if (it == table->begin()) continue;
      --it;
      uintptr_t p = uintptr_t(ptr), base = it->first, end = base + it->second.bytes;
      if (p >= end && !(bytes == 0 && p == end)) continue;
      if (bytes > end - p) return kShvdFakeOverrun;
      if (table == &pinned_mem) return kShvdFakePinned;
      if (device) *device = it->second.device;
      return kShvdFakeDevice;
    }
    return kShvdFakeHost;
  }

  std::shared_ptr<Stream> FindStream(cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(s);
    return it == streams_.end() ? nullptr : it->second;
  }
  cudaStream_t AddStream(int device) {
    auto handle = reinterpret_cast<cudaStream_t>(new char);  // never freed: never reused
    const bool core = ThreadName().rfind("shvd_", 0) == 0;
    std::lock_guard<std::mutex> lock(mu_);
    streams_[handle] = std::make_shared<Stream>(device, core);
    return handle;
  }
  std::shared_ptr<Stream> RemoveStream(cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(s);
    if (it == streams_.end()) return nullptr;
    auto stream = it->second;
    streams_.erase(it);
    return stream;
  }
  void SynchronizeAll() {
    std::vector<std::shared_ptr<Stream>> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& kv : streams_) all.push_back(kv.second);
      for (auto& kv : legacy_) all.push_back(kv.second);
    }
    for (auto& s : all) s->Drain();
  }
  // SHVD_FAKE_CUDA_LEGACY_STREAM=1: the queued null stream of `device` (made on first
  // use); else null (the null stream runs work at once).
  std::shared_ptr<Stream> Legacy(int device) {
    if (!legacy_stream) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = legacy_[device];
    if (!s) s = std::make_shared<Stream>(device, false);
    return s;
  }
  const bool legacy_stream = EnvInt("SHVD_FAKE_CUDA_LEGACY_STREAM", 0) != 0;

  // SHVD_FAKE_CUDA_EXCLUSIVE_DIR: a context on (visible) `device` for this process,
  // claimed through a file per physical device; see the contract at the top.
  cudaError_t Context(int device) {
    static const char* dir = std::getenv("SHVD_FAKE_CUDA_EXCLUSIVE_DIR");
    if (!dir || !*dir || device < 0 || device >= int(visible.size())) return cudaSuccess;
    const int physical = visible[size_t(device)];
    std::lock_guard<std::mutex> lock(claim_mu_);
    if (claimed_.count(physical)) return cudaSuccess;
    const std::string path = std::string(dir) + "/gpu" + std::to_string(physical);
    for (int attempt = 0; attempt < 200; ++attempt) {
      int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0644);
      if (fd >= 0) {
        const std::string pid = std::to_string(::getpid()) + "\n";
        (void)!::write(fd, pid.data(), pid.size());
        ::close(fd);
        claimed_.insert(physical);
        return cudaSuccess;
      }
      long holder = 0;
      if (FILE* f = std::fopen(path.c_str(), "r")) {
        if (std::fscanf(f, "%ld", &holder) != 1) holder = 0;
        std::fclose(f);
      }
      if (holder == long(::getpid())) {
        claimed_.insert(physical);
        return cudaSuccess;
      }
      if (holder > 0 && (::kill(pid_t(holder), 0) == 0 || errno == EPERM)) {
        std::fprintf(stderr,
                     "fake CUDA: process %d needs a context on GPU %d, which process %ld "
                     "holds (exclusive-process mode): cudaErrorDevicesUnavailable\n",
                     int(::getpid()), physical, holder);
        return kErrDevicesUnavailable;
      }
      if (holder > 0) {
        ::unlink(path.c_str());  // its process is gone
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // being written
      }
    }
    return kErrDevicesUnavailable;
  }

  std::shared_ptr<Event> FindEvent(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = events_.find(e);
    return it == events_.end() ? nullptr : it->second;
  }
  cudaEvent_t AddEvent() {
    auto handle = reinterpret_cast<cudaEvent_t>(new char);
    std::lock_guard<std::mutex> lock(mu_);
    events_[handle] = std::make_shared<Event>();
    return handle;
  }
  bool RemoveEvent(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    return events_.erase(e) > 0;
  }

  std::map<uintptr_t, Allocation> device_mem, pinned_mem;  // guarded by mu_

 private:
  std::mutex mu_;
  std::unordered_map<cudaStream_t, std::shared_ptr<Stream>> streams_;
  std::map<int, std::shared_ptr<Stream>> legacy_;
  std::mutex claim_mu_;
  std::set<int> claimed_;  // physical devices this process holds a context on
  std::unordered_map<cudaEvent_t, std::shared_ptr<Event>> events_;
};

Runtime& Rt() {
  static Runtime* rt = new Runtime;
  return *rt;
}

thread_local int t_device = 0;

// A context on the calling thread's current device (SHVD_FAKE_CUDA_EXCLUSIVE_DIR).
#define SHVD_FAKE_CONTEXT()                                           \
  do {                                                                \
    if (cudaError_t ctx_err = Rt().Context(t_device)) return ctx_err; \
  } while (0)

// Runs work on `stream`: queued; the null stream runs it now unless it is the queued
// legacy one (SHVD_FAKE_CUDA_LEGACY_STREAM).
cudaError_t Submit(cudaStream_t stream, std::function<void()> work) {
  if (!stream) {
    if (auto legacy = Rt().Legacy(t_device)) {
      legacy->Push(std::move(work));
      return cudaSuccess;
    }
    work();
    return cudaSuccess;
  }
  auto s = Rt().FindStream(stream);
  if (!s) return kErrInvalidResourceHandle;
  s->Push(std::move(work));
  return cudaSuccess;
}

bool IsDevice(const void* p, size_t bytes) {
  return Rt().Kind(p, bytes, nullptr) == kShvdFakeDevice;
}
bool IsHostSide(const void* p, size_t bytes) {
  int kind = Rt().Kind(p, bytes, nullptr);
  return kind == kShvdFakeHost || kind == kShvdFakePinned;
}

}  // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return kErrInvalidValue;
  *count = int(Rt().visible.size());
  return *count ? cudaSuccess : kErrNoDevice;
}

cudaError_t cudaGetDevice(int* device) {
  if (!device) return kErrInvalidValue;
  if (Rt().visible.empty()) return kErrNoDevice;
  *device = t_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (Rt().visible.empty()) return kErrNoDevice;
  if (device < 0 || device >= int(Rt().visible.size())) return kErrInvalidDevice;
  if (cudaError_t err = Rt().Context(device)) return err;
  t_device = device;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (Rt().visible.empty()) return kErrNoDevice;
  SHVD_FAKE_CONTEXT();
  Syncs().Count("cudaMalloc");
  return Rt().Allocate(&Rt().device_mem, ptr, bytes, t_device);
}

cudaError_t cudaFree(void* ptr) {
  SHVD_FAKE_CONTEXT();
  Syncs().Count("cudaFree");
  return Rt().Release(&Rt().device_mem, ptr);
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
  SHVD_FAKE_CONTEXT();
  Syncs().Count("cudaMallocHost");
  return Rt().Allocate(&Rt().pinned_mem, ptr, bytes, -1);
}

cudaError_t cudaFreeHost(void* ptr) {
  SHVD_FAKE_CONTEXT();
  Syncs().Count("cudaFreeHost");
  return Rt().Release(&Rt().pinned_mem, ptr);
}

cudaError_t cudaDeviceSynchronize(void) {
  SHVD_FAKE_CONTEXT();
  Syncs().Count("cudaDeviceSynchronize");
  Rt().SynchronizeAll();
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  SHVD_FAKE_CONTEXT();
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return kErrInvalidMemcpyDirection;
  if (bytes == 0)
    return stream && !Rt().FindStream(stream) ? kErrInvalidResourceHandle : cudaSuccess;
  bool ok = false;
  switch (kind) {
    case cudaMemcpyHostToHost:
      ok = IsHostSide(dst, bytes) && IsHostSide(src, bytes);
      break;
    case cudaMemcpyHostToDevice:
      ok = IsDevice(dst, bytes) && IsHostSide(src, bytes);
      break;
    case cudaMemcpyDeviceToHost:
      ok = IsHostSide(dst, bytes) && IsDevice(src, bytes);
      break;
    case cudaMemcpyDeviceToDevice:
      ok = IsDevice(dst, bytes) && IsDevice(src, bytes);
      break;
    default:
      ok = Rt().Kind(dst, bytes, nullptr) != kShvdFakeOverrun &&
           Rt().Kind(src, bytes, nullptr) != kShvdFakeOverrun;
  }
  if (!ok || !dst || !src) return kErrInvalidValue;
  void* to = Rt().View(dst);
  const void* from = Rt().View(src);
  return Submit(stream, [to, from, bytes] { std::memmove(to, from, bytes); });
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  SHVD_FAKE_CONTEXT();
  if (bytes == 0)
    return stream && !Rt().FindStream(stream) ? kErrInvalidResourceHandle : cudaSuccess;
  if (!IsDevice(ptr, bytes)) return kErrInvalidValue;
  void* to = Rt().View(ptr);
  return Submit(stream, [to, value, bytes] { std::memset(to, value, bytes); });
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (!stream || (flags & ~cudaStreamNonBlocking)) return kErrInvalidValue;
  if (Rt().visible.empty()) return kErrNoDevice;
  SHVD_FAKE_CONTEXT();
  *stream = Rt().AddStream(t_device);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  SHVD_FAKE_CONTEXT();
  auto s = stream ? Rt().RemoveStream(stream) : nullptr;
  if (!s) return kErrInvalidResourceHandle;
  s->Stop();
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  SHVD_FAKE_CONTEXT();
  if (!stream) {
    Syncs().Count("cudaStreamSynchronize(null stream)");
    if (auto legacy = Rt().Legacy(t_device)) legacy->Drain();
    return cudaSuccess;
  }
  auto s = Rt().FindStream(stream);
  if (!s) return kErrInvalidResourceHandle;
  if (!s->core()) Syncs().Count("cudaStreamSynchronize(a stream spark_hvd does not own)");
  s->Drain();
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  SHVD_FAKE_CONTEXT();
  if (flags != 0) return kErrInvalidValue;
  auto e = Rt().FindEvent(event);
  if (!e || (stream && !Rt().FindStream(stream))) return kErrInvalidResourceHandle;
  uint64_t gen = e->Latest();
  if (gen == 0) return cudaSuccess;
  return Submit(stream, [e, gen] { e->Wait(gen); });
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  // cudaEventBlockingSync (1) and cudaEventDisableTiming (2) change nothing here.
  SHVD_FAKE_CONTEXT();
  if (!event || (flags & ~0x3u)) return kErrInvalidValue;
  *event = Rt().AddEvent();
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  // Queued markers and waits keep the event's state alive, as with real CUDA.
  SHVD_FAKE_CONTEXT();
  return Rt().RemoveEvent(event) ? cudaSuccess : kErrInvalidResourceHandle;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  SHVD_FAKE_CONTEXT();
  auto e = Rt().FindEvent(event);
  if (!e || (stream && !Rt().FindStream(stream))) return kErrInvalidResourceHandle;
  uint64_t gen = e->Record();
  return Submit(stream, [e, gen] { e->Complete(gen); });
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  SHVD_FAKE_CONTEXT();
  auto e = Rt().FindEvent(event);
  if (!e) return kErrInvalidResourceHandle;
  return e->Done(e->Latest()) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  SHVD_FAKE_CONTEXT();
  auto e = Rt().FindEvent(event);
  if (!e) return kErrInvalidResourceHandle;
  e->Wait(e->Latest());
  return cudaSuccess;
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case kErrInvalidValue:
      return "invalid argument";
    case kErrMemoryAllocation:
      return "out of memory";
    case kErrInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case kErrNoDevice:
      return "no CUDA-capable device is detected";
    case kErrInvalidDevice:
      return "invalid device ordinal";
    case kErrInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case kErrDevicesUnavailable:
      return "CUDA-capable device(s) is/are busy or unavailable";
    default:
      return "unrecognized error code";
  }
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  if (!version) return kErrInvalidValue;
  *version = 12040;
  return cudaSuccess;
}

// -- hooks for the fake NCCL (fake_internal.h) -------------------------------------

cudaError_t shvd_fake_enqueue(cudaStream_t stream, shvd_fake_work_fn fn, void* arg) {
  return Submit(stream, [fn, arg] { fn(arg); });
}

cudaError_t shvd_fake_enqueue_joined(const cudaStream_t* streams, int n, shvd_fake_work_fn fn,
                                     void* arg) {
  // The null stream, if present, runs fn (in this thread, after the others arrived;
  // on its queue when it is the legacy one).
  std::vector<cudaStream_t> distinct;
  for (int i = 0; i < n; ++i)
    if (std::find(distinct.begin(), distinct.end(), streams[i]) == distinct.end())
      distinct.push_back(streams[i]);
  // The null stream first, the others in order (a rotate: stable_partition's temporary
  // buffer would count as the core's allocation on the engine thread, cases_nccl.py).
  auto null = std::find(distinct.begin(), distinct.end(), nullptr);
  if (null != distinct.end()) std::rotate(distinct.begin(), null, null + 1);
  for (cudaStream_t s : distinct)
    if (s && !Rt().FindStream(s)) return kErrInvalidResourceHandle;
  if (distinct.size() == 1) return shvd_fake_enqueue(distinct[0], fn, arg);

  struct Join {
    std::mutex mu;
    std::condition_variable cv;
    size_t arrived = 0;
    bool done = false;
  };
  auto join = std::make_shared<Join>();
  const size_t others = distinct.size() - 1;
  for (size_t i = 1; i < distinct.size(); ++i) {
    Submit(distinct[i], [join] {
      std::unique_lock<std::mutex> lock(join->mu);
      ++join->arrived;
      join->cv.notify_all();
      join->cv.wait(lock, [&] { return join->done; });
    });
  }
  return Submit(distinct[0], [join, others, fn, arg] {
    {
      std::unique_lock<std::mutex> lock(join->mu);
      join->cv.wait(lock, [&] { return join->arrived == others; });
    }
    fn(arg);
    std::lock_guard<std::mutex> lock(join->mu);
    join->done = true;
    join->cv.notify_all();
  });
}

int shvd_fake_memory_kind(const void* ptr, size_t bytes, int* device) {
  return Rt().Kind(ptr, bytes, device);
}

void* shvd_fake_view(const void* ptr) { return Rt().View(ptr); }

// -- for tests (fake_internal.h) ------------------------------------------------------

cudaError_t shvd_fake_launch_kernel(cudaStream_t stream, unsigned int microseconds) {
  SHVD_FAKE_CONTEXT();
  return Submit(stream, [microseconds] {
    std::this_thread::sleep_for(std::chrono::microseconds(microseconds));
  });
}

void shvd_fake_set_delay_us(int microseconds) { DelayUs() = std::max(0, microseconds); }

unsigned long long shvd_fake_sync_calls(void) { return Syncs().Total(); }

int shvd_fake_sync_report(char* buf, int size) {
  const std::string text = Syncs().Report();
  if (buf && size > 0) {
    std::snprintf(buf, size_t(size), "%s", text.c_str());
  }
  return int(text.size());
}

void shvd_fake_sync_reset(void) { Syncs().Reset(); }

unsigned long long shvd_fake_live_bytes(int device) {
  return device < 0 ? Rt().LiveBytes(Rt().pinned_mem, -1) : Rt().LiveBytes(Rt().device_mem, device);
}

cudaError_t shvd_fake_stream_device(cudaStream_t stream, int* device) {
  if (!stream) {
    *device = t_device;
    return cudaSuccess;
  }
  auto s = Rt().FindStream(stream);
  if (!s) return kErrInvalidResourceHandle;
  *device = s->device();
  return cudaSuccess;
}

int shvd_fake_current_device(void) { return t_device; }

int shvd_fake_physical_device(int device) {
  const auto& v = Rt().visible;
  return device >= 0 && device < int(v.size()) ? v[device] : -1;
}

}  // extern "C"
