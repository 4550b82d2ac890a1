// Registers backend "staged": GPU tensors through pinned host memory on a CPU
// backend, where the CUDA runtime loads but backend "nccl" does not (NCCL missing, or
// a build without it), or where
// SPARK_HVD_GPU_OPERATIONS names a CPU backend (tcp, gloo or mpi: e.g. when several
// ranks share one GPU, which NCCL refuses). It connects its own communicator of
// that CPU backend (under its own store prefix).
#include "backends/cuda/loader.h"
#include "backends/registry.h"
#include "backends/staged/communicator.h"
#include "common/env.h"

namespace spark_hvd {
namespace {

class StagedBackend : public Backend {
 public:
  const char* name() const override { return "staged"; }
  bool Enabled(const BackendOptions&) const override {
    const std::string& wanted = env::GpuOperations();
    std::string why;
    if (wanted == "nccl") {  // backend nccl, when built, says why it cannot run
      if (!cuda::NcclBackendLoads(&why)) {
        throw StatusError(Status::InvalidArgument("SPARK_HVD_GPU_OPERATIONS=nccl, but " + why));
      }
      return false;
    }
    const bool loaded = cuda::Cuda(&why) != nullptr;
    if (!loaded && !wanted.empty()) {
      throw StatusError(Status::InvalidArgument("SPARK_HVD_GPU_OPERATIONS=" + wanted +
                                                " stages GPU tensors through host memory, "
                                                "which needs the CUDA runtime: " +
                                                why));
    }
    if (!loaded) return false;
    return !wanted.empty() || !cuda::NcclBackendLoads();
  }
  bool Accepts(int32_t device, OpType op, DataType) const override {
    return device >= 0 && op != OpType::kBarrier && op != OpType::kJoin;
  }
  std::unique_ptr<Communicator> Connect(const BackendOptions& o) override {
    std::string host = env::GpuOperations();
    if (host.empty()) host = CpuOperationsSetting();
    if (host.empty()) host = o.controller == "mpi" ? "mpi" : "tcp";
    BackendOptions inner = o;
    inner.store_prefix = o.store_prefix + "/staged";
    return std::make_unique<StagedCommunicator>(o.connect_backend(host, inner), cuda::Cuda());
  }
};

}  // namespace

void RegisterStagedBackend(BackendRegistry* registry) {
  registry->Add(std::make_unique<StagedBackend>());
}

}  // namespace spark_hvd
