// Registers backend "shm": shared memory among the ranks of one host, for CPU ops.
// Enabled by default in jobs that meet through the rendezvous store (and with
// SPARK_HVD_CPU_OPERATIONS=shm); a set whose ranks span hosts leaves its ops to tcp
// (communicator.h), and SPARK_HVD_CPU_OPERATIONS=tcp (or gloo) leaves every op to that.
#include "backends/registry.h"
#include "backends/shm/communicator.h"

namespace spark_hvd {
namespace {

class ShmBackend : public Backend {
 public:
  const char* name() const override { return "shm"; }
  bool Enabled(const BackendOptions& o) const override {
    if (o.cpu_operations.empty()) return o.controller == "gloo";
    if (o.cpu_operations != name()) return false;
    if (o.controller != "gloo") {
      throw StatusError(Status::InvalidArgument(
          "SPARK_HVD_CPU_OPERATIONS=shm needs the rendezvous store, which a job started by "
          "mpirun does not have (MPI has its own shared memory): launch with spark-hvdrun "
          "without --mpi, or use mpi"));
    }
    return true;
  }
  bool AnyThread() const override { return true; }
  bool Accepts(int32_t device, OpType, DataType) const override { return device == kCpuDevice; }
  std::unique_ptr<Communicator> Connect(const BackendOptions& o) override {
    return ConnectShmAll(o);
  }
};

}  // namespace

void RegisterShmBackend(BackendRegistry* registry) {
  registry->Add(std::make_unique<ShmBackend>());
}

}  // namespace spark_hvd
