// The part of the CUDA runtime and NCCL C APIs the NCCL backend uses, declared
// here so that spark_hvd builds with no CUDA toolkit and no NCCL headers. Values
// and signatures follow the libraries' public ABI (cuda_runtime_api.h, nccl.h);
// the libraries themselves are loaded at run time (loader.h). The test doubles
// in tests/fakes/ implement exactly this subset.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

// -- CUDA runtime ---------------------------------------------------------------
typedef int cudaError_t;  // enum cudaError
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorNotReady = 600;
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef int cudaMemcpyKind;
constexpr cudaMemcpyKind cudaMemcpyHostToHost = 0;
constexpr cudaMemcpyKind cudaMemcpyHostToDevice = 1;
constexpr cudaMemcpyKind cudaMemcpyDeviceToHost = 2;
constexpr cudaMemcpyKind cudaMemcpyDeviceToDevice = 3;
constexpr cudaMemcpyKind cudaMemcpyDefault = 4;
constexpr unsigned int cudaStreamNonBlocking = 0x01;
constexpr unsigned int cudaEventDisableTiming = 0x02;

typedef cudaError_t (*cudaGetDeviceCount_t)(int* count);
typedef cudaError_t (*cudaGetDevice_t)(int* device);
typedef cudaError_t (*cudaSetDevice_t)(int device);
typedef cudaError_t (*cudaMalloc_t)(void** ptr, size_t bytes);
typedef cudaError_t (*cudaFree_t)(void* ptr);
typedef cudaError_t (*cudaMallocHost_t)(void** ptr, size_t bytes);
typedef cudaError_t (*cudaFreeHost_t)(void* ptr);
typedef cudaError_t (*cudaMemcpyAsync_t)(void* dst, const void* src, size_t bytes,
                                         cudaMemcpyKind kind, cudaStream_t stream);
typedef cudaError_t (*cudaMemsetAsync_t)(void* ptr, int value, size_t bytes, cudaStream_t stream);
typedef cudaError_t (*cudaStreamCreateWithFlags_t)(cudaStream_t* stream, unsigned int flags);
typedef cudaError_t (*cudaStreamDestroy_t)(cudaStream_t stream);
typedef cudaError_t (*cudaStreamSynchronize_t)(cudaStream_t stream);
typedef cudaError_t (*cudaStreamWaitEvent_t)(cudaStream_t stream, cudaEvent_t event,
                                             unsigned int flags);
typedef cudaError_t (*cudaEventCreateWithFlags_t)(cudaEvent_t* event, unsigned int flags);
typedef cudaError_t (*cudaEventDestroy_t)(cudaEvent_t event);
typedef cudaError_t (*cudaEventRecord_t)(cudaEvent_t event, cudaStream_t stream);
typedef cudaError_t (*cudaEventQuery_t)(cudaEvent_t event);
typedef cudaError_t (*cudaEventSynchronize_t)(cudaEvent_t event);
typedef const char* (*cudaGetErrorString_t)(cudaError_t error);
typedef cudaError_t (*cudaRuntimeGetVersion_t)(int* version);

// -- NCCL -----------------------------------------------------------------------
typedef int ncclResult_t;  // enum ncclResult_t
constexpr ncclResult_t ncclSuccess = 0;
constexpr ncclResult_t ncclUnhandledCudaError = 1;
constexpr ncclResult_t ncclSystemError = 2;
constexpr ncclResult_t ncclInternalError = 3;
constexpr ncclResult_t ncclInvalidArgument = 4;
constexpr ncclResult_t ncclInvalidUsage = 5;
constexpr ncclResult_t ncclRemoteError = 6;
constexpr ncclResult_t ncclInProgress = 7;

typedef int ncclDataType_t;  // enum ncclDataType_t
constexpr ncclDataType_t ncclInt8 = 0;
constexpr ncclDataType_t ncclUint8 = 1;
constexpr ncclDataType_t ncclInt32 = 2;
constexpr ncclDataType_t ncclUint32 = 3;
constexpr ncclDataType_t ncclInt64 = 4;
constexpr ncclDataType_t ncclUint64 = 5;
constexpr ncclDataType_t ncclFloat16 = 6;
constexpr ncclDataType_t ncclFloat32 = 7;
constexpr ncclDataType_t ncclFloat64 = 8;
constexpr ncclDataType_t ncclBfloat16 = 9;

typedef int ncclRedOp_t;  // enum ncclRedOp_t; values >= ncclNumOps are user-created ops
constexpr ncclRedOp_t ncclSum = 0;
constexpr ncclRedOp_t ncclProd = 1;
constexpr ncclRedOp_t ncclMax = 2;
constexpr ncclRedOp_t ncclMin = 3;
constexpr ncclRedOp_t ncclAvg = 4;
constexpr ncclRedOp_t ncclNumOps = 5;

typedef int ncclScalarResidence_t;
constexpr ncclScalarResidence_t ncclScalarDevice = 0;
constexpr ncclScalarResidence_t ncclScalarHostImmediate = 1;

constexpr int kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
typedef struct {
  char internal[kNcclUniqueIdBytes];
} ncclUniqueId;
typedef struct ncclComm* ncclComm_t;

// The leading fields of ncclConfig_t (NCCL 2.14, when it came): NCCL reads `size` bytes and
// takes the fields a config of an older `version` lacks from its defaults, so this prefix
// is a valid config for every later NCCL. `blocking` = 0 makes a non-blocking
// communicator: no call blocks the host (each may return ncclInProgress until
// ncclCommGetAsyncError says otherwise), so a call whose peers never come can be aborted
// by the thread that made it.
struct ncclConfig_t {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
};
constexpr unsigned int kNcclConfigMagic = 0xcafebeef;
constexpr unsigned int kNcclConfigVersion = 21400;  // NCCL_VERSION(2, 14, 0)

typedef ncclResult_t (*ncclGetVersion_t)(int* version);
typedef ncclResult_t (*ncclGetUniqueId_t)(ncclUniqueId* id);
typedef ncclResult_t (*ncclCommInitRank_t)(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
typedef ncclResult_t (*ncclCommInitRankConfig_t)(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                                 int rank, ncclConfig_t* config);
typedef ncclResult_t (*ncclCommDestroy_t)(ncclComm_t comm);
typedef ncclResult_t (*ncclCommAbort_t)(ncclComm_t comm);
typedef ncclResult_t (*ncclCommGetAsyncError_t)(ncclComm_t comm, ncclResult_t* async_error);
typedef const char* (*ncclGetErrorString_t)(ncclResult_t result);
typedef const char* (*ncclGetLastError_t)(ncclComm_t comm);
typedef ncclResult_t (*ncclAllReduce_t)(const void* send, void* recv, size_t count,
                                        ncclDataType_t dtype, ncclRedOp_t op, ncclComm_t comm,
                                        cudaStream_t stream);
typedef ncclResult_t (*ncclBroadcast_t)(const void* send, void* recv, size_t count,
                                        ncclDataType_t dtype, int root, ncclComm_t comm,
                                        cudaStream_t stream);
typedef ncclResult_t (*ncclAllGather_t)(const void* send, void* recv, size_t send_count,
                                        ncclDataType_t dtype, ncclComm_t comm, cudaStream_t stream);
typedef ncclResult_t (*ncclReduceScatter_t)(const void* send, void* recv, size_t recv_count,
                                            ncclDataType_t dtype, ncclRedOp_t op, ncclComm_t comm,
                                            cudaStream_t stream);
typedef ncclResult_t (*ncclSend_t)(const void* send, size_t count, ncclDataType_t dtype, int peer,
                                   ncclComm_t comm, cudaStream_t stream);
typedef ncclResult_t (*ncclRecv_t)(void* recv, size_t count, ncclDataType_t dtype, int peer,
                                   ncclComm_t comm, cudaStream_t stream);
typedef ncclResult_t (*ncclGroupStart_t)();
typedef ncclResult_t (*ncclGroupEnd_t)();
typedef ncclResult_t (*ncclRedOpCreatePreMulSum_t)(ncclRedOp_t* op, void* scalar,
                                                   ncclDataType_t dtype,
                                                   ncclScalarResidence_t residence,
                                                   ncclComm_t comm);
typedef ncclResult_t (*ncclRedOpDestroy_t)(ncclRedOp_t op, ncclComm_t comm);

}  // extern "C"
