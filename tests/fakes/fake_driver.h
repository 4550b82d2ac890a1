// The harness of fake_driver.cc: loading the fakes the way the NCCL backend loads the
// real libraries (dlopen by path, every symbol resolved by name), checks that print both
// values and file:line, the unique id and "done" hand-offs through files, device
// buffers, and exact encodings of the small values the scenarios use.
#pragma once

#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/api.h"

namespace driver {

// clang-format off
#define SHVD_FAKE_API(X)                                                                      \
  X(cudaGetDeviceCount) X(cudaGetDevice) X(cudaSetDevice) X(cudaMalloc) X(cudaFree)           \
  X(cudaMallocHost) X(cudaFreeHost) X(cudaMemcpyAsync) X(cudaMemsetAsync)                     \
  X(cudaStreamCreateWithFlags) X(cudaStreamDestroy) X(cudaStreamSynchronize)                  \
  X(cudaStreamWaitEvent) X(cudaEventCreateWithFlags) X(cudaEventDestroy) X(cudaEventRecord)   \
  X(cudaEventQuery) X(cudaEventSynchronize) X(cudaGetErrorString) X(cudaRuntimeGetVersion)    \
  X(ncclGetVersion) X(ncclGetUniqueId) X(ncclCommInitRank) X(ncclCommDestroy)                 \
  X(ncclCommAbort) X(ncclCommGetAsyncError) X(ncclGetErrorString) X(ncclGetLastError)         \
  X(ncclAllReduce) X(ncclBroadcast) X(ncclAllGather) X(ncclReduceScatter) X(ncclSend)         \
  X(ncclRecv) X(ncclGroupStart) X(ncclGroupEnd) X(ncclRedOpCreatePreMulSum) X(ncclRedOpDestroy)
// clang-format on

struct Api {
#define SHVD_FIELD(name) name##_t name = nullptr;
  SHVD_FAKE_API(SHVD_FIELD)
#undef SHVD_FIELD
  void* cudart = nullptr;
  void* nccl = nullptr;
};

inline Api api;
inline int g_rank = 0, g_size = 1;
inline std::string g_dir;

[[noreturn]] void Die(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "[rank %d] FAIL %s:%d: %s\n", g_rank, file, line, what.c_str());
  std::fflush(stderr);
  if (!g_dir.empty())  // release rank 0's wait in Pass(): the exit code tells the failure
    std::ofstream(g_dir + "/done." + std::to_string(g_rank)) << "failed";
  std::_Exit(1);
}

#define CHECK(cond)                              \
  do {                                           \
    if (!(cond)) Die(__FILE__, __LINE__, #cond); \
  } while (0)
#define EXPECT_EQ(a, b)                                                                       \
  do {                                                                                        \
    auto a_ = (a);                                                                            \
    auto b_ = (b);                                                                            \
    if (!(a_ == b_))                                                                          \
      Die(__FILE__, __LINE__,                                                                 \
          std::string(#a " == " #b ": ") + std::to_string(a_) + " vs " + std::to_string(b_)); \
  } while (0)
#define CUDA(call)                                                                   \
  do {                                                                               \
    cudaError_t e_ = (call);                                                         \
    if (e_ != cudaSuccess)                                                           \
      Die(__FILE__, __LINE__, std::string(#call ": ") + api.cudaGetErrorString(e_)); \
  } while (0)
#define NCCL(call)                                                      \
  do {                                                                  \
    ncclResult_t r_ = (call);                                           \
    if (r_ != ncclSuccess)                                              \
      Die(__FILE__, __LINE__,                                           \
          std::string(#call ": ") + api.ncclGetErrorString(r_) + ": " + \
              api.ncclGetLastError(nullptr));                           \
  } while (0)

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

void Load(const char* cudart, const char* nccl) {
  api.cudart = dlopen(cudart, RTLD_NOW | RTLD_LOCAL);
  if (!api.cudart) Die(__FILE__, __LINE__, dlerror());
  api.nccl = dlopen(nccl, RTLD_NOW | RTLD_LOCAL);
  if (!api.nccl) Die(__FILE__, __LINE__, dlerror());
#define SHVD_RESOLVE(name)                                                        \
  api.name = reinterpret_cast<name##_t>(                                          \
      dlsym(std::strncmp(#name, "cuda", 4) == 0 ? api.cudart : api.nccl, #name)); \
  if (!api.name) Die(__FILE__, __LINE__, "missing symbol " #name);
  SHVD_FAKE_API(SHVD_RESOLVE)
#undef SHVD_RESOLVE
}

// -- processes ----------------------------------------------------------------------

bool WaitForFile(const std::string& path, double timeout_s) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (access(path.c_str(), F_OK) != 0) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

void Touch(const std::string& name) {
  std::string tmp = g_dir + "/." + name + "." + std::to_string(getpid());
  std::ofstream(tmp) << g_rank;
  CHECK(std::rename(tmp.c_str(), (g_dir + "/" + name).c_str()) == 0);
}

// Rank 0 makes the id and writes it to DIR/<name>; the others read it.
ncclUniqueId ShareId(const std::string& name = "id") {
  ncclUniqueId id;
  const std::string path = g_dir + "/" + name;
  if (g_rank == 0) {
    NCCL(api.ncclGetUniqueId(&id));
    std::string tmp = path + ".tmp";
    std::ofstream(tmp, std::ios::binary).write(id.internal, sizeof id.internal);
    CHECK(std::rename(tmp.c_str(), path.c_str()) == 0);
  } else {
    CHECK(WaitForFile(path, 30));
    std::ifstream(path, std::ios::binary).read(id.internal, sizeof id.internal);
  }
  return id;
}

// Each rank on its own device (the tests set SHVD_FAKE_CUDA_DEVICES=SIZE).
void UseOwnDevice() {
  int devices = 0;
  CUDA(api.cudaGetDeviceCount(&devices));
  CUDA(api.cudaSetDevice(g_rank % devices));
}

ncclComm_t Join() {
  UseOwnDevice();
  ncclUniqueId id = ShareId();
  ncclComm_t comm = nullptr;
  NCCL(api.ncclCommInitRank(&comm, g_size, id, g_rank));
  return comm;
}

// A communicator of this rank alone.
ncclComm_t JoinAlone() {
  ncclUniqueId id;
  NCCL(api.ncclGetUniqueId(&id));
  ncclComm_t comm = nullptr;
  NCCL(api.ncclCommInitRank(&comm, 1, id, 0));
  return comm;
}

// Rank 0 hosts the coordinator: it leaves only after everyone is done.
void Pass() {
  Touch("done." + std::to_string(g_rank));
  if (g_rank == 0)
    for (int r = 0; r < g_size; ++r) CHECK(WaitForFile(g_dir + "/done." + std::to_string(r), 60));
  std::printf("PASS\n");
  std::fflush(stdout);
}

// -- memory -------------------------------------------------------------------------

void* DevAlloc(size_t bytes) {
  void* p = nullptr;
  CUDA(api.cudaMalloc(&p, bytes));
  return p;
}

void Put(void* dev, const std::vector<char>& host) {
  if (!host.empty())
    CUDA(api.cudaMemcpyAsync(dev, host.data(), host.size(), cudaMemcpyHostToDevice, nullptr));
}

std::vector<char> Get(const void* dev, size_t bytes) {
  std::vector<char> host(bytes);
  if (bytes) CUDA(api.cudaMemcpyAsync(host.data(), dev, bytes, cudaMemcpyDeviceToHost, nullptr));
  return host;
}

void* DevCopy(const std::vector<char>& host, size_t bytes = 0) {
  void* p = DevAlloc(std::max(bytes, host.size()));
  Put(p, host);
  return p;
}

cudaStream_t NewStream() {
  cudaStream_t s = nullptr;
  CUDA(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

// The fake's stand-in for compute: a "kernel" of `us` microseconds on `s`.
cudaError_t LaunchKernel(cudaStream_t s, unsigned int us) {
  using Fn = cudaError_t (*)(cudaStream_t, unsigned int);
  static Fn fn = reinterpret_cast<Fn>(dlsym(api.cudart, "shvd_fake_launch_kernel"));
  if (!fn) Die(__FILE__, __LINE__, "missing symbol shvd_fake_launch_kernel");
  return fn(s, us);
}

cudaEvent_t NewEvent() {
  cudaEvent_t e = nullptr;
  CUDA(api.cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

// -- datatypes: exact encodings of the small values the scenarios use ---------------

struct Dtype {
  ncclDataType_t id;
  const char* name;
  size_t size;
  bool floating;
  bool is_signed;
};
const Dtype kDtypes[] = {
    {ncclInt8, "int8", 1, false, true},      {ncclUint8, "uint8", 1, false, false},
    {ncclInt32, "int32", 4, false, true},    {ncclUint32, "uint32", 4, false, false},
    {ncclInt64, "int64", 8, false, true},    {ncclUint64, "uint64", 8, false, false},
    {ncclFloat16, "float16", 2, true, true}, {ncclFloat32, "float32", 4, true, true},
    {ncclFloat64, "float64", 8, true, true}, {ncclBfloat16, "bfloat16", 2, true, true}};

const Dtype& D(ncclDataType_t id) {
  for (const auto& d : kDtypes)
    if (d.id == id) return d;
  Die(__FILE__, __LINE__, "unknown dtype");
}

// Writes v (which must be exact in the dtype) at p.
void Encode(const Dtype& d, double v, char* p) {
  switch (d.id) {
    case ncclInt8: {
      int8_t x = int8_t(v);
      std::memcpy(p, &x, 1);
      return;
    }
    case ncclUint8: {
      uint8_t x = uint8_t(v);
      std::memcpy(p, &x, 1);
      return;
    }
    case ncclInt32: {
      int32_t x = int32_t(v);
      std::memcpy(p, &x, 4);
      return;
    }
    case ncclUint32: {
      uint32_t x = uint32_t(v);
      std::memcpy(p, &x, 4);
      return;
    }
    case ncclInt64: {
      int64_t x = int64_t(v);
      std::memcpy(p, &x, 8);
      return;
    }
    case ncclUint64: {
      uint64_t x = uint64_t(v);
      std::memcpy(p, &x, 8);
      return;
    }
    case ncclFloat32: {
      float x = float(v);
      std::memcpy(p, &x, 4);
      return;
    }
    case ncclFloat64:
      std::memcpy(p, &v, 8);
      return;
    case ncclBfloat16: {
      float f = float(v);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      CHECK((bits & 0xFFFF) == 0);  // exact
      uint16_t x = uint16_t(bits >> 16);
      std::memcpy(p, &x, 2);
      return;
    }
    case ncclFloat16: {
      uint16_t x = v < 0 ? 0x8000 : 0;
      double a = std::fabs(v);
      if (a != 0) {
        int e;
        double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
        double frac = (m * 2 - 1) * 1024;
        CHECK(e - 1 + 15 > 0 && e - 1 + 15 < 31 && frac == std::floor(frac));
        x |= uint16_t(((e - 1 + 15) << 10) | int(frac));
      }
      std::memcpy(p, &x, 2);
      return;
    }
  }
}

double Decode(const Dtype& d, const char* p) {
  switch (d.id) {
    case ncclInt8: {
      int8_t x;
      std::memcpy(&x, p, 1);
      return x;
    }
    case ncclUint8: {
      uint8_t x;
      std::memcpy(&x, p, 1);
      return x;
    }
    case ncclInt32: {
      int32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case ncclUint32: {
      uint32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case ncclInt64: {
      int64_t x;
      std::memcpy(&x, p, 8);
      return double(x);
    }
    case ncclUint64: {
      uint64_t x;
      std::memcpy(&x, p, 8);
      return double(x);
    }
    case ncclFloat32: {
      float x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case ncclFloat64: {
      double x;
      std::memcpy(&x, p, 8);
      return x;
    }
    case ncclBfloat16: {
      uint16_t x;
      std::memcpy(&x, p, 2);
      uint32_t bits = uint32_t(x) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    default: {  // float16
      uint16_t x;
      std::memcpy(&x, p, 2);
      int e = (x >> 10) & 0x1F, m = x & 0x3FF;
      double v = e == 0 ? std::ldexp(m, -24) : e == 31 ? NAN : std::ldexp(1024 + m, e - 25);
      return (x & 0x8000) ? -v : v;
    }
  }
}

std::vector<char> Encoded(const Dtype& d, const std::vector<double>& values) {
  std::vector<char> out(values.size() * d.size);
  for (size_t i = 0; i < values.size(); ++i) Encode(d, values[i], &out[i * d.size]);
  return out;
}

std::vector<double> Decoded(const Dtype& d, const std::vector<char>& bytes) {
  std::vector<double> out(bytes.size() / d.size);
  for (size_t i = 0; i < out.size(); ++i) out[i] = Decode(d, &bytes[i * d.size]);
  return out;
}

void ExpectValues(const std::string& what, const std::vector<double>& got,
                  const std::vector<double>& want, double tolerance = 0) {
  CHECK(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::fabs(got[i] - want[i]) > tolerance * (1 + std::fabs(want[i]))) {
      Die(__FILE__, __LINE__,
          what + ": element " + std::to_string(i) + " is " + std::to_string(got[i]) + ", want " +
              std::to_string(want[i]));
    }
  }
}

// A check to run once the stream has finished: what it read, and how to judge it.
struct Pending {
  std::string what;
  const Dtype* dtype;
  const void* dev;
  std::vector<double> want;
  double tolerance;
};

void Judge(const std::vector<Pending>& checks) {
  for (const auto& c : checks)
    ExpectValues(c.what, Decoded(*c.dtype, Get(c.dev, c.want.size() * c.dtype->size)), c.want,
                 c.tolerance);
}

}  // namespace driver
