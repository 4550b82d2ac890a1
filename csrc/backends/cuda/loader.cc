#include "backends/cuda/loader.h"

#include <dlfcn.h>

#include <mutex>

#include "common/config.h"
#include "common/env.h"
#include "common/logging.h"

namespace spark_hvd {
namespace cuda {
namespace {

std::mutex g_mu;
std::vector<std::string> g_dirs;

// Opens the first library that loads: `override` alone when set, else each soname
// in each directory, then each soname on the default search path.
void* Open(const std::string& override, const std::vector<std::string>& sonames,
           std::string* tried) {
  std::vector<std::string> candidates;
  if (!override.empty()) {
    candidates.push_back(override);
  } else {
    for (const auto& dir : g_dirs) {
      for (const auto& so : sonames) candidates.push_back(dir + "/" + so);
    }
    candidates.insert(candidates.end(), sonames.begin(), sonames.end());
  }
  for (const auto& c : candidates) {
    void* lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) {
      SHVD_LOG(kDebug, "nccl") << "loaded " << c;
      return lib;
    }
    const char* err = dlerror();
    if (!override.empty() && err != nullptr) *tried += std::string(err) + "; ";
  }
  if (override.empty()) {
    *tried += "none of";
    for (const auto& so : sonames) *tried += " " + so;
    *tried += " found";
  }
  return nullptr;
}

// Resolves every symbol; false (naming the first missing one) if any is absent.
template <typename T>
bool Bind(void* lib, const char* symbol, T* out, std::string* why) {
  *out = reinterpret_cast<T>(dlsym(lib, symbol));
  if (*out == nullptr) *why = std::string("missing symbol ") + symbol;
  return *out != nullptr;
}

struct Loaded {
  bool tried = false;
  bool ok = false;
  std::string why;
};

}  // namespace

void SetLibraryDirs(const std::vector<std::string>& dirs) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_dirs = dirs;
}

#define SHVD_BIND(api, prefix, name) ok = ok && Bind(lib, prefix #name, &api.name, &state.why)

const CudaApi* Cuda(std::string* why) {
  static CudaApi api;
  static Loaded state;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!state.tried) {
    state.tried = true;
    void* lib = Open(env::CudaLibrary(),
                     {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"},
                     &state.why);
    bool ok = lib != nullptr;
    SHVD_BIND(api, "cuda", GetDeviceCount);
    SHVD_BIND(api, "cuda", GetDevice);
    SHVD_BIND(api, "cuda", SetDevice);
    SHVD_BIND(api, "cuda", Malloc);
    SHVD_BIND(api, "cuda", Free);
    SHVD_BIND(api, "cuda", MallocHost);
    SHVD_BIND(api, "cuda", FreeHost);
    SHVD_BIND(api, "cuda", MemcpyAsync);
    SHVD_BIND(api, "cuda", MemsetAsync);
    SHVD_BIND(api, "cuda", StreamCreateWithFlags);
    SHVD_BIND(api, "cuda", StreamDestroy);
    SHVD_BIND(api, "cuda", StreamSynchronize);
    SHVD_BIND(api, "cuda", StreamWaitEvent);
    SHVD_BIND(api, "cuda", EventCreateWithFlags);
    SHVD_BIND(api, "cuda", EventDestroy);
    SHVD_BIND(api, "cuda", EventRecord);
    SHVD_BIND(api, "cuda", EventQuery);
    SHVD_BIND(api, "cuda", EventSynchronize);
    SHVD_BIND(api, "cuda", GetErrorString);
    SHVD_BIND(api, "cuda", RuntimeGetVersion);
    state.ok = ok;
    if (ok) {
      int devices = 0;
      if (api.GetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        state.ok = false;
        state.why = "the CUDA runtime loaded but sees no GPU";
      }
    }
  }
  if (why) *why = state.why;
  return state.ok ? &api : nullptr;
}

const NcclApi* Nccl(std::string* why) {
  static NcclApi api;
  static Loaded state;
  std::string cuda_why;
  if (Cuda(&cuda_why) == nullptr) {
    if (why) *why = "CUDA runtime: " + cuda_why;
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  if (!state.tried) {
    state.tried = true;
    void* lib = Open(env::NcclLibrary(), {"libnccl.so.2", "libnccl.so"}, &state.why);
    bool ok = lib != nullptr;
    SHVD_BIND(api, "nccl", GetVersion);
    SHVD_BIND(api, "nccl", GetUniqueId);
    SHVD_BIND(api, "nccl", CommInitRank);
    SHVD_BIND(api, "nccl", CommDestroy);
    SHVD_BIND(api, "nccl", CommAbort);
    SHVD_BIND(api, "nccl", CommGetAsyncError);
    SHVD_BIND(api, "nccl", GetErrorString);
    SHVD_BIND(api, "nccl", GetLastError);
    SHVD_BIND(api, "nccl", AllReduce);
    SHVD_BIND(api, "nccl", Broadcast);
    SHVD_BIND(api, "nccl", AllGather);
    SHVD_BIND(api, "nccl", ReduceScatter);
    SHVD_BIND(api, "nccl", Send);
    SHVD_BIND(api, "nccl", Recv);
    SHVD_BIND(api, "nccl", GroupStart);
    SHVD_BIND(api, "nccl", GroupEnd);
    SHVD_BIND(api, "nccl", RedOpCreatePreMulSum);
    SHVD_BIND(api, "nccl", RedOpDestroy);
    if (ok) {  // optional (NCCL 2.14+): without it communicators block
      api.CommInitRankConfig =
          reinterpret_cast<ncclCommInitRankConfig_t>(dlsym(lib, "ncclCommInitRankConfig"));
    }
    state.ok = ok;
    if (!ok) state.why = "NCCL: " + state.why;
  }
  if (why) *why = state.why;
  return state.ok ? &api : nullptr;
}

#undef SHVD_BIND

bool NcclBackendLoads(std::string* why) {
#if SPARK_HVD_HAVE_NCCL
  return Nccl(why) != nullptr;
#else
  if (why)
    *why = "spark_hvd was built without its NCCL backend (its CMake option was switched off)";
  return false;
#endif
}

}  // namespace cuda
}  // namespace spark_hvd
