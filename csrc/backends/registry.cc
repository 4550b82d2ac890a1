#include "backends/registry.h"

#include <dlfcn.h>

#include <algorithm>
#include <sstream>

#include "common/config.h"
#include "common/env.h"

namespace spark_hvd {

void RegisterTcpBackend(BackendRegistry* registry);
void RegisterGlooBackend(BackendRegistry* registry);
void RegisterMpiBackend(BackendRegistry* registry);
void RegisterNcclBackend(BackendRegistry* registry);
void RegisterStagedBackend(BackendRegistry* registry);
void RegisterShmBackend(BackendRegistry* registry);

namespace {

std::string Join(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// Stands in for a backend this build left out (its library was not found, or the build
// switched it off): asked for, it says so and how to get it; otherwise it takes nothing.
class NotBuiltBackend : public Backend {
 public:
  // controls: whether SPARK_HVD_CONTROLLER=<name> asks for this backend too.
  NotBuiltBackend(const char* name, bool controls, std::string why)
      : name_(name), controls_(controls), why_(std::move(why)) {}
  const char* name() const override { return name_; }
  bool Enabled(const BackendOptions& o) const override {
    if (o.cpu_operations == name_ || (controls_ && o.controller == name_)) {
      throw StatusError(Status::InvalidArgument(why_));
    }
    return false;
  }
  bool Accepts(int32_t, OpType, DataType) const override { return false; }
  std::unique_ptr<Communicator> Connect(const BackendOptions&) override { return nullptr; }

 private:
  const char* name_;
  bool controls_;
  std::string why_;
};

}  // namespace

void RegisterBuiltinBackends(BackendRegistry* registry) {
#if SPARK_HVD_HAVE_NCCL
  RegisterNcclBackend(registry);
#endif
  RegisterStagedBackend(registry);
#if SPARK_HVD_HAVE_MPI
  RegisterMpiBackend(registry);
#else
  registry->Add(std::make_unique<NotBuiltBackend>(
      "mpi", true,
      "this spark_hvd was built without MPI (spark_hvd.mpi_built() is False); install an "
      "MPI (apt-get install libopenmpi-dev) and reinstall, or launch without --mpi"));
#endif
#if SPARK_HVD_HAVE_GLOO
  RegisterGlooBackend(registry);
#else
  registry->Add(std::make_unique<NotBuiltBackend>(
      "gloo", false,
      "SPARK_HVD_CPU_OPERATIONS (or SPARK_HVD_GLOO_DATA_PLANE) asks for gloo, but this "
      "spark_hvd was built without Gloo (spark_hvd.gloo_built() is False); install Gloo "
      "(apt-get install libgloo-dev) and reinstall, or unset it for the default tcp backend"));
#endif
  RegisterShmBackend(registry);
  RegisterTcpBackend(registry);
}

void BackendRegistry::Add(std::unique_ptr<Backend> backend) {
  backends_.push_back(std::move(backend));
}

void BackendRegistry::AddPlugin(const std::string& path) {
  // Never closed: the backend's code must outlive every object it made.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    throw StatusError(Status::InvalidArgument("cannot load backend plugin '" + path +
                                              "' (SPARK_HVD_BACKEND_PLUGINS): " + dlerror()));
  }
  using Make = Backend* (*)();
  auto make = reinterpret_cast<Make>(dlsym(lib, "spark_hvd_make_backend"));
  if (make == nullptr) {
    throw StatusError(Status::InvalidArgument("backend plugin '" + path +
                                              "' does not export spark_hvd_make_backend()"));
  }
  Add(std::unique_ptr<Backend>(make()));
}

void BackendRegistry::AddPlugins(const std::string& paths) {
  std::istringstream in(paths);
  std::string path;
  while (std::getline(in, path, ':')) {
    if (path.empty() || std::count(plugins_.begin(), plugins_.end(), path)) continue;
    AddPlugin(path);
    plugins_.push_back(path);
  }
}

std::string CpuOperationsSetting() {
  return env::CpuOperations().empty() ? env::GlooDataPlane() : env::CpuOperations();
}

Backend* BackendRegistry::Find(const std::string& name) const {
  for (const auto& b : backends_) {
    if (b->name() == name) return b.get();
  }
  return nullptr;
}

std::vector<std::string> BackendRegistry::Names() const {
  std::vector<std::string> names;
  for (const auto& b : backends_) names.push_back(b->name());
  return names;
}

std::vector<Backend*> BackendRegistry::Select(const BackendOptions& options) const {
  std::vector<Backend*> enabled;
  bool cpu_named = options.cpu_operations.empty();
  for (const auto& b : backends_) {
    const bool on = b->Enabled(options);
    if (b->name() == options.cpu_operations) {
      cpu_named = true;
      if (!on || !TakesCpuOps(*b)) {
        throw StatusError(Status::InvalidArgument(
            "SPARK_HVD_CPU_OPERATIONS=" + options.cpu_operations +
            ": that backend cannot run CPU operations in this job (launched with controller '" +
            options.controller + "')"));
      }
    }
    if (on) enabled.push_back(b.get());
  }
  if (!cpu_named) {
    std::vector<std::string> cpu;
    for (const auto& b : backends_) {
      if (TakesCpuOps(*b)) cpu.push_back(b->name());
    }
    throw StatusError(Status::InvalidArgument(
        "SPARK_HVD_CPU_OPERATIONS (or its older name SPARK_HVD_GLOO_DATA_PLANE)='" +
        options.cpu_operations + "' is not a CPU backend; use one of: " + Join(cpu)));
  }
  // The backend named for CPU ops goes first, so that it, and not one of higher
  // priority that also takes CPU ops (tcp is always on), runs them. The control plane
  // is still the first that can carry it.
  std::stable_partition(enabled.begin(), enabled.end(),
                        [&](Backend* b) { return b->name() == options.cpu_operations; });
  for (Backend* b : enabled) {
    if (b->ControlPlane()) return enabled;
  }
  throw StatusError(Status::InvalidArgument(
      "no backend can run controller '" + options.controller +
      "' (SPARK_HVD_CONTROLLER): use gloo (the rendezvous store) or mpi (under mpirun)"));
}

}  // namespace spark_hvd
