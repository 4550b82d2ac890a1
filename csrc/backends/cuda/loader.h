// The CUDA runtime and NCCL, loaded at run time (the way NCCL loads its own
// optional dependencies): the extension builds and imports without either, and
// the NCCL backend is enabled only where both load. SPARK_HVD_CUDA_LIBRARY and
// SPARK_HVD_NCCL_LIBRARY name the libraries (a path or a soname); otherwise the
// usual sonames are tried, first in the directories of SetLibraryDirs (the
// Python layer passes those of the nvidia-* wheels PyTorch installs), then on
// the loader's own search path.
#pragma once

#include <string>
#include <vector>

#include "backends/cuda/api.h"

namespace spark_hvd {
namespace cuda {

struct CudaApi {
  cudaGetDeviceCount_t GetDeviceCount;
  cudaGetDevice_t GetDevice;
  cudaSetDevice_t SetDevice;
  cudaMalloc_t Malloc;
  cudaFree_t Free;
  cudaMallocHost_t MallocHost;
  cudaFreeHost_t FreeHost;
  cudaMemcpyAsync_t MemcpyAsync;
  cudaMemsetAsync_t MemsetAsync;
  cudaStreamCreateWithFlags_t StreamCreateWithFlags;
  cudaStreamDestroy_t StreamDestroy;
  cudaStreamSynchronize_t StreamSynchronize;
  cudaStreamWaitEvent_t StreamWaitEvent;
  cudaEventCreateWithFlags_t EventCreateWithFlags;
  cudaEventDestroy_t EventDestroy;
  cudaEventRecord_t EventRecord;
  cudaEventQuery_t EventQuery;
  cudaEventSynchronize_t EventSynchronize;
  cudaGetErrorString_t GetErrorString;
  cudaRuntimeGetVersion_t RuntimeGetVersion;
};

struct NcclApi {
  ncclGetVersion_t GetVersion;
  ncclGetUniqueId_t GetUniqueId;
  ncclCommInitRank_t CommInitRank;
  ncclCommInitRankConfig_t CommInitRankConfig;  // null before NCCL 2.14: blocking calls then
  ncclCommDestroy_t CommDestroy;
  ncclCommAbort_t CommAbort;
  ncclCommGetAsyncError_t CommGetAsyncError;
  ncclGetErrorString_t GetErrorString;
  ncclGetLastError_t GetLastError;
  ncclAllReduce_t AllReduce;
  ncclBroadcast_t Broadcast;
  ncclAllGather_t AllGather;
  ncclReduceScatter_t ReduceScatter;
  ncclSend_t Send;
  ncclRecv_t Recv;
  ncclGroupStart_t GroupStart;
  ncclGroupEnd_t GroupEnd;
  ncclRedOpCreatePreMulSum_t RedOpCreatePreMulSum;
  ncclRedOpDestroy_t RedOpDestroy;
};

// Directories searched first for the default sonames (call before the first load).
void SetLibraryDirs(const std::vector<std::string>& dirs);

// The loaded API, or null with *why saying what was tried and what failed.
// Loads once; later calls return the same answer.
const CudaApi* Cuda(std::string* why = nullptr);
const NcclApi* Nccl(std::string* why = nullptr);
// Whether this build has backend "nccl" (SPARK_HVD_HAVE_NCCL) and NCCL loads: what
// spark_hvd.nccl_built() says; *why says why not.
bool NcclBackendLoads(std::string* why = nullptr);

}  // namespace cuda
}  // namespace spark_hvd
