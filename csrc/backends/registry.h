// BackendRegistry: the ordered list of backends an engine may use. Built-in
// backends register in RegisterBuiltinBackends (registry.cc); more can be added
// from shared libraries (SPARK_HVD_BACKEND_PLUGINS): each exports
//   extern "C" spark_hvd::Backend* spark_hvd_make_backend();
// and is compiled against these headers by the same compiler.
//
// Order is priority: an op runs on the first enabled backend that accepts its
// device, op and dtype (the one SPARK_HVD_CPU_OPERATIONS names goes first); the
// control plane is the first enabled backend that can carry it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"

namespace spark_hvd {

class BackendRegistry {
 public:
  void Add(std::unique_ptr<Backend> backend);
  // Loads a plugin library and adds its backend (throws StatusError naming the path).
  void AddPlugin(const std::string& path);
  // Every path of a ':'-separated list not loaded yet (SPARK_HVD_BACKEND_PLUGINS).
  void AddPlugins(const std::string& paths);

  // The backends this job uses, in order; the first is the control plane.
  // Throws StatusError(kInvalidArgument) when the settings cannot work (no control
  // plane for the controller, a CPU backend that is not registered or enabled).
  std::vector<Backend*> Select(const BackendOptions& options) const;

  std::vector<std::string> Names() const;
  Backend* Find(const std::string& name) const;  // null when not registered

 private:
  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<std::string> plugins_;  // paths loaded
};

// SPARK_HVD_CPU_OPERATIONS, or else its alias SPARK_HVD_GLOO_DATA_PLANE ("" = default).
std::string CpuOperationsSetting();

// nccl (GPUs), mpi (or a stand-in that explains it was not built), gloo, shm, tcp, in
// priority order.
void RegisterBuiltinBackends(BackendRegistry* registry);

}  // namespace spark_hvd
