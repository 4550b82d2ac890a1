// Registers backend "tcp": the own TCP mesh. Enabled whenever the ranks meet
// through the rendezvous store (controller "gloo"), as the control plane, and for
// CPU ops unless another CPU backend is asked for (SPARK_HVD_CPU_OPERATIONS).
#include "backends/members.h"
#include "backends/registry.h"
#include "backends/tcp/communicator.h"

namespace spark_hvd {
namespace {

class TcpBackend : public Backend {
 public:
  const char* name() const override { return "tcp"; }
  bool Enabled(const BackendOptions& o) const override {
    if (o.controller == "gloo") return true;
    if (o.cpu_operations == name()) {
      throw StatusError(Status::InvalidArgument(
          "SPARK_HVD_CPU_OPERATIONS=tcp needs the rendezvous store, which a job started by "
          "mpirun does not have: launch with spark-hvdrun without --mpi, or use mpi"));
    }
    return false;
  }
  bool ControlPlane() const override { return true; }
  bool AnyThread() const override { return true; }
  bool Accepts(int32_t device, OpType, DataType) const override { return device == kCpuDevice; }
  std::unique_ptr<Communicator> Connect(const BackendOptions& o) override {
    return TcpCommunicator::Connect(o, AllRanks(o.size), 0);
  }
};

}  // namespace

void RegisterTcpBackend(BackendRegistry* registry) {
  registry->Add(std::make_unique<TcpBackend>());
}

}  // namespace spark_hvd
