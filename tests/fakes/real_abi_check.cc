// Compile-time check of csrc/backends/cuda/api.h (our own declarations of the CUDA
// runtime and NCCL subset the backend loads with dlopen) against the libraries' real
// headers, as the nvidia-cuda-runtime / nvidia-nccl wheels ship them. Compiled (only)
// by tests/fakes/test_real_nvidia_libraries.py with -fsyntax-only; every mismatch is
// a static_assert naming the function or constant.
//
// What "the same" means here is what matters for a call through a dlsym'd pointer:
// the same number of parameters, and each parameter and result the same type, where
// our `int` may stand for one of the headers' C enums of int size, and our copy of a
// by-value struct (ncclUniqueId) must have the real one's size and alignment.
//
// Compiled twice: with SHVD_CHECK_CUDA the CUDA runtime part against
// cuda_runtime_api.h alone (nccl.h pulls in cuda_runtime.h, whose C++ overloads of
// cudaMalloc & co. would make their names ambiguous), with SHVD_CHECK_NCCL the NCCL part.
#if defined(SHVD_CHECK_CUDA) == defined(SHVD_CHECK_NCCL)
#error "define one of SHVD_CHECK_CUDA and SHVD_CHECK_NCCL"
#endif
#ifdef SHVD_CHECK_CUDA
#include <cuda_runtime_api.h>
#else
#include <nccl.h>
#endif

#include <cstddef>
#include <cstdint>
#include <type_traits>

// Two flags are macros in the real header; api.h declares them as constants.
constexpr unsigned int kRealStreamNonBlocking = cudaStreamNonBlocking;
constexpr unsigned int kRealEventDisableTiming = cudaEventDisableTiming;
#undef cudaStreamNonBlocking
#undef cudaEventDisableTiming

namespace ours {
#include "backends/cuda/api.h"
}  // namespace ours

namespace {

// Our ncclUniqueId (A) for the real one (B): same size and alignment.
template <typename A, typename B>
constexpr bool SameUniqueId() {
#ifdef SHVD_CHECK_NCCL
  if constexpr (std::is_same_v<A, ours::ncclUniqueId> && std::is_same_v<B, ::ncclUniqueId>) {
    return sizeof(A) == sizeof(B) && alignof(A) == alignof(B);
  }
#endif
  return false;
}

template <typename A, typename B>
constexpr bool Compatible();

template <typename A, typename B>
constexpr bool PointeeCompatible() {
  if constexpr (std::is_const_v<A> != std::is_const_v<B> ||
                std::is_volatile_v<A> != std::is_volatile_v<B>) {
    return false;
  } else {
    return Compatible<std::remove_cv_t<A>, std::remove_cv_t<B>>();
  }
}

template <typename A, typename B>
constexpr bool Compatible() {
  if constexpr (std::is_same_v<A, B>) {
    return true;
  } else if constexpr (std::is_same_v<A, int> && std::is_enum_v<B>) {
    return sizeof(B) == sizeof(int) && std::is_integral_v<std::underlying_type_t<B>>;
  } else if constexpr (std::is_pointer_v<A> && std::is_pointer_v<B>) {
    return PointeeCompatible<std::remove_pointer_t<A>, std::remove_pointer_t<B>>();
  } else {
    return SameUniqueId<A, B>();
  }
}

template <typename Ours, typename Real>
struct SameCall : std::false_type {};

template <typename R1, typename... A1, typename R2, typename... A2>
struct SameCall<R1 (*)(A1...), R2(A2...)> {
  static constexpr bool value =
      sizeof...(A1) == sizeof...(A2) && Compatible<R1, R2>() && (Compatible<A1, A2>() && ...);
};

}  // namespace

// Each typedef `name_t` in api.h against the real declaration of `name`.
#define SHVD_SAME_CALL(name)                                       \
  static_assert(SameCall<ours::name##_t, decltype(::name)>::value, \
                #name " in api.h differs from the real header's declaration")

#ifdef SHVD_CHECK_CUDA
SHVD_SAME_CALL(cudaGetDeviceCount);
SHVD_SAME_CALL(cudaGetDevice);
SHVD_SAME_CALL(cudaSetDevice);
SHVD_SAME_CALL(cudaMalloc);
SHVD_SAME_CALL(cudaFree);
SHVD_SAME_CALL(cudaMallocHost);
SHVD_SAME_CALL(cudaFreeHost);
SHVD_SAME_CALL(cudaMemcpyAsync);
SHVD_SAME_CALL(cudaMemsetAsync);
SHVD_SAME_CALL(cudaStreamCreateWithFlags);
SHVD_SAME_CALL(cudaStreamDestroy);
SHVD_SAME_CALL(cudaStreamSynchronize);
SHVD_SAME_CALL(cudaStreamWaitEvent);
SHVD_SAME_CALL(cudaEventCreateWithFlags);
SHVD_SAME_CALL(cudaEventDestroy);
SHVD_SAME_CALL(cudaEventRecord);
SHVD_SAME_CALL(cudaEventQuery);
SHVD_SAME_CALL(cudaEventSynchronize);
SHVD_SAME_CALL(cudaGetErrorString);
SHVD_SAME_CALL(cudaRuntimeGetVersion);
#else

SHVD_SAME_CALL(ncclGetVersion);
SHVD_SAME_CALL(ncclGetUniqueId);
SHVD_SAME_CALL(ncclCommInitRank);
SHVD_SAME_CALL(ncclCommDestroy);
SHVD_SAME_CALL(ncclCommAbort);
SHVD_SAME_CALL(ncclCommGetAsyncError);
SHVD_SAME_CALL(ncclGetErrorString);
SHVD_SAME_CALL(ncclGetLastError);
SHVD_SAME_CALL(ncclAllReduce);
SHVD_SAME_CALL(ncclBroadcast);
SHVD_SAME_CALL(ncclAllGather);
SHVD_SAME_CALL(ncclReduceScatter);
SHVD_SAME_CALL(ncclSend);
SHVD_SAME_CALL(ncclRecv);
SHVD_SAME_CALL(ncclGroupStart);
SHVD_SAME_CALL(ncclGroupEnd);
SHVD_SAME_CALL(ncclRedOpCreatePreMulSum);
SHVD_SAME_CALL(ncclRedOpDestroy);
#endif

#undef SHVD_SAME_CALL

// Each constant of api.h against the real enumerator or macro of the same name.
#define SHVD_SAME_VALUE(name) \
  static_assert(ours::name == static_cast<int>(::name), #name " in api.h has another value")

SHVD_SAME_VALUE(cudaSuccess);
SHVD_SAME_VALUE(cudaErrorNotReady);
SHVD_SAME_VALUE(cudaMemcpyHostToHost);
SHVD_SAME_VALUE(cudaMemcpyHostToDevice);
SHVD_SAME_VALUE(cudaMemcpyDeviceToHost);
SHVD_SAME_VALUE(cudaMemcpyDeviceToDevice);
SHVD_SAME_VALUE(cudaMemcpyDefault);
static_assert(ours::cudaStreamNonBlocking == kRealStreamNonBlocking,
              "cudaStreamNonBlocking in api.h has another value");
static_assert(ours::cudaEventDisableTiming == kRealEventDisableTiming,
              "cudaEventDisableTiming in api.h has another value");

#ifdef SHVD_CHECK_NCCL
SHVD_SAME_VALUE(ncclSuccess);
SHVD_SAME_VALUE(ncclUnhandledCudaError);
SHVD_SAME_VALUE(ncclSystemError);
SHVD_SAME_VALUE(ncclInternalError);
SHVD_SAME_VALUE(ncclInvalidArgument);
SHVD_SAME_VALUE(ncclInvalidUsage);
SHVD_SAME_VALUE(ncclRemoteError);
SHVD_SAME_VALUE(ncclInProgress);
SHVD_SAME_VALUE(ncclInt8);
SHVD_SAME_VALUE(ncclUint8);
SHVD_SAME_VALUE(ncclInt32);
SHVD_SAME_VALUE(ncclUint32);
SHVD_SAME_VALUE(ncclInt64);
SHVD_SAME_VALUE(ncclUint64);
SHVD_SAME_VALUE(ncclFloat16);
SHVD_SAME_VALUE(ncclFloat32);
SHVD_SAME_VALUE(ncclFloat64);
SHVD_SAME_VALUE(ncclBfloat16);
SHVD_SAME_VALUE(ncclSum);
SHVD_SAME_VALUE(ncclProd);
SHVD_SAME_VALUE(ncclMax);
SHVD_SAME_VALUE(ncclMin);
SHVD_SAME_VALUE(ncclAvg);
SHVD_SAME_VALUE(ncclNumOps);
SHVD_SAME_VALUE(ncclScalarDevice);
SHVD_SAME_VALUE(ncclScalarHostImmediate);
static_assert(ours::kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES,
              "kNcclUniqueIdBytes in api.h is not NCCL_UNIQUE_ID_BYTES");

static_assert(std::is_same_v<ours::ncclComm_t, ::ncclComm_t>, "ncclComm_t differs");

// ncclCommInitRankConfig takes our ncclConfig_t, the leading fields of the real one: the
// call is the same but for that pointer's type, and the fields lie where NCCL reads them.
static_assert(
    SameCall<ours::ncclCommInitRankConfig_t,
             ncclResult_t(::ncclComm_t*, int, ::ncclUniqueId, int, ours::ncclConfig_t*)>::value &&
        std::is_same_v<decltype(::ncclCommInitRankConfig),
                       ncclResult_t(::ncclComm_t*, int, ::ncclUniqueId, int, ::ncclConfig_t*)>,
    "ncclCommInitRankConfig in api.h differs from the real header's declaration");
#define SHVD_SAME_FIELD(field)                                                            \
  static_assert(offsetof(ours::ncclConfig_t, field) == offsetof(::ncclConfig_t, field) && \
                    sizeof(ours::ncclConfig_t::field) == sizeof(::ncclConfig_t::field),   \
                "ncclConfig_t::" #field " in api.h is not where the real header has it")
SHVD_SAME_FIELD(size);
SHVD_SAME_FIELD(magic);
SHVD_SAME_FIELD(version);
SHVD_SAME_FIELD(blocking);
#undef SHVD_SAME_FIELD
static_assert(sizeof(ours::ncclConfig_t) <= sizeof(::ncclConfig_t), "ncclConfig_t is too long");
constexpr ::ncclConfig_t kRealConfig = NCCL_CONFIG_INITIALIZER;
static_assert(ours::kNcclConfigMagic == kRealConfig.magic, "ncclConfig_t's magic differs");
static_assert(ours::kNcclConfigVersion <= kRealConfig.version, "kNcclConfigVersion is too new");
#endif

#undef SHVD_SAME_VALUE

// The opaque handles must be the very types of the headers (api.h names the same
// structs, so the typedefs meet).
static_assert(std::is_same_v<ours::cudaStream_t, ::cudaStream_t>, "cudaStream_t differs");
static_assert(std::is_same_v<ours::cudaEvent_t, ::cudaEvent_t>, "cudaEvent_t differs");
