// Backend: one way of moving tensors among ranks (one folder under backends/),
// as the engine sees it. Backends are peers: each registers itself in the
// ordered BackendRegistry (registry.h) with its name, whether this job uses it,
// which devices and ops it takes, and how it connects. The engine connects the
// enabled ones and sends each op to the first that accepts it; it never names a
// concrete backend.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/communicator.h"
#include "common/types.h"
#include "net/liveness.h"
#include "rendezvous/store.h"

namespace spark_hvd {

struct BackendOptions {
  int32_t rank = 0;  // as launched; a backend that defines the ranks (MPI) may differ
  int32_t size = 1;
  // How the job was launched: "gloo" (ranks meet through the rendezvous store) or
  // "mpi" (started by mpirun).
  std::string controller = "gloo";
  // Which backend runs CPU ops: a backend's name, or "" for the controller's default
  // (SPARK_HVD_CPU_OPERATIONS).
  std::string cpu_operations;
  std::shared_ptr<Store> store;         // null in a one-rank job without a launcher
  std::string store_prefix;             // this init's namespace in the store
  std::string bind_host = "127.0.0.1";  // the address peers reach this rank at
  // This rank's host as the launcher names it (SPARK_HVD_HOSTNAME, else the host name;
  // "" = the host name): shm shares memory among ranks of the same host.
  std::string host;
  double timeout_s = 30.0;          // a silent peer is lost after this
  double connect_timeout_s = 60.0;  // rendezvous at connect
  // Ranks of the job the rendezvous service has seen vanish (asked while connecting).
  std::function<std::vector<int32_t>()> lost_ranks;
  // The job's heartbeats (liveness.h), owned by the engine, alive until every
  // communicator is gone; null when the job has none.
  PeerLiveness* liveness = nullptr;
  // Connects another registered backend by name, for a backend that builds on one
  // (staged runs GPU tensors on a CPU backend). Throws StatusError for an unknown name.
  std::function<std::unique_ptr<Communicator>(const std::string& backend,
                                              const BackendOptions& options)>
      connect_backend;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const = 0;
  // Does this job use the backend? Throws StatusError(kInvalidArgument) for
  // settings that ask for it where it cannot work, naming the fix.
  virtual bool Enabled(const BackendOptions& options) const = 0;
  // Can its communicator carry the engine's per-cycle control exchange?
  virtual bool ControlPlane() const { return false; }
  // May its communicators be called from any thread, one call at a time? Then an API
  // thread that waits for an op may run the engine's cycles itself (Engine::Drive).
  virtual bool AnyThread() const { return false; }
  // Does it execute `op` on `dtype` tensors of `device` (kCpuDevice or a GPU ordinal)?
  virtual bool Accepts(int32_t device, OpType op, DataType dtype) const = 0;
  // The communicator among every rank of the job. Collective over the job.
  virtual std::unique_ptr<Communicator> Connect(const BackendOptions& options) = 0;
  // Called once the job's communicators of this backend are all destroyed.
  virtual void Finalize() {}
};

// Does the backend run CPU collectives (what SPARK_HVD_CPU_OPERATIONS can name)?
inline bool TakesCpuOps(const Backend& b) {
  return b.Accepts(kCpuDevice, OpType::kAllreduce, DataType::kFloat32);
}

}  // namespace spark_hvd
