// Registers backend "nccl": CUDA tensors (device >= 0) on NCCL, enabled where the
// CUDA runtime and NCCL load (loader.h) and SPARK_HVD_GPU_OPERATIONS does not ask
// for another backend. It runs allreduce (fused, every NCCL dtype, scale factors),
// broadcast, allgather, alltoall and reducescatter (barrier and join stay on the
// control plane).
#include "backends/members.h"
#include "backends/nccl/communicator.h"
#include "backends/registry.h"
#include "common/env.h"

namespace spark_hvd {
namespace {

class NcclBackend : public Backend {
 public:
  const char* name() const override { return "nccl"; }
  bool Enabled(const BackendOptions&) const override {
    const std::string& wanted = env::GpuOperations();
    if (!wanted.empty() && wanted != name()) return false;
    std::string why;
    const bool loaded = cuda::Nccl(&why) != nullptr;
    if (!loaded && wanted == name()) {
      throw StatusError(Status::InvalidArgument(
          "SPARK_HVD_GPU_OPERATIONS=nccl, but NCCL is not available: " + why +
          " (set SPARK_HVD_NCCL_LIBRARY / SPARK_HVD_CUDA_LIBRARY, or install the nvidia-nccl "
          "and nvidia-cuda-runtime wheels)"));
    }
    return loaded;
  }
  bool Accepts(int32_t device, OpType op, DataType dtype) const override {
    if (device < 0 || dtype == DataType::kInt16) return false;  // NCCL has no int16
    return op != OpType::kBarrier && op != OpType::kJoin;
  }
  std::unique_ptr<Communicator> Connect(const BackendOptions& o) override {
    return std::make_unique<nccl::NcclCommunicator>(o, AllRanks(o.size), 0, cuda::Cuda(),
                                                    cuda::Nccl());
  }
};

}  // namespace

void RegisterNcclBackend(BackendRegistry* registry) {
  registry->Add(std::make_unique<NcclBackend>());
}

}  // namespace spark_hvd
