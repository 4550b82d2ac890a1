// Registers backend "gloo": Gloo's pairs and algorithms for CPU ops, when asked
// for (SPARK_HVD_CPU_OPERATIONS=gloo, or its alias SPARK_HVD_GLOO_DATA_PLANE=gloo).
#include "backends/gloo/communicator.h"
#include "backends/members.h"
#include "backends/registry.h"

namespace spark_hvd {
namespace {

class GlooBackend : public Backend {
 public:
  const char* name() const override { return "gloo"; }
  bool Enabled(const BackendOptions& o) const override {
    if (o.cpu_operations != name()) return false;
    if (o.controller != "gloo") {
      throw StatusError(Status::InvalidArgument(
          "SPARK_HVD_CPU_OPERATIONS=gloo needs the rendezvous store, which a job started by "
          "mpirun does not have: launch with spark-hvdrun without --mpi, or use mpi"));
    }
    return true;
  }
  bool Accepts(int32_t device, OpType, DataType) const override { return device == kCpuDevice; }
  std::unique_ptr<Communicator> Connect(const BackendOptions& o) override {
    return GlooCommunicator::Connect(o, AllRanks(o.size), 0);
  }
};

}  // namespace

void RegisterGlooBackend(BackendRegistry* registry) {
  registry->Add(std::make_unique<GlooBackend>());
}

}  // namespace spark_hvd
