// Registers backend "mpi": MPI for the control plane and CPU ops of a job started
// by mpirun (spark-hvdrun --mpi). Built only when CMake finds an MPI.
#include "backends/mpi/communicator.h"
#include "backends/registry.h"

namespace spark_hvd {
namespace {

class MpiBackend : public Backend {
 public:
  const char* name() const override { return "mpi"; }
  bool Enabled(const BackendOptions& o) const override {
    if (o.controller == "mpi") return true;
    if (o.cpu_operations == name()) {
      throw StatusError(Status::InvalidArgument(
          "SPARK_HVD_CPU_OPERATIONS=mpi needs a job started by mpirun: launch with "
          "spark-hvdrun --mpi"));
    }
    return false;
  }
  bool ControlPlane() const override { return true; }
  bool Accepts(int32_t device, OpType, DataType) const override { return device == kCpuDevice; }
  // MPI_Init happens here, on the engine's thread (MPI_THREAD_SERIALIZED).
  std::unique_ptr<Communicator> Connect(const BackendOptions&) override {
    return MpiCommunicator::World();
  }
  void Finalize() override { MpiCommunicator::Finalize(); }
};

}  // namespace

void RegisterMpiBackend(BackendRegistry* registry) {
  registry->Add(std::make_unique<MpiBackend>());
}

}  // namespace spark_hvd
