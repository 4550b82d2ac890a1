// spark_hvd._core: the only pybind11 translation unit. Every binding parses its
// Python arguments with the GIL held, releases the GIL around native work, and
// turns a failed Status into the matching spark_hvd.exceptions class (Raise).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/config.h"
#include "common/env.h"
#include "common/types.h"
#include "engine/engine.h"
#include "python/py_store.h"

namespace py = pybind11;
using namespace spark_hvd;

namespace {

Engine& TheEngine() {
  // Deliberately never destroyed: its thread is joined by shutdown() (also
  // registered with atexit by spark_hvd), not by static destructors.
  static Engine* engine = new Engine();
  return *engine;
}

[[noreturn]] void Raise(const Status& s) {
  py::object exc = py::module_::import("spark_hvd.exceptions")
                       .attr("from_code")(static_cast<int>(s.code()), s.message());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

template <typename F>
auto Native(F&& f) -> decltype(f()) {
  try {
    py::gil_scoped_release release;
    return f();
  } catch (const StatusError& e) {
    Raise(e.status());
  }
}

std::shared_ptr<OpState> StateOf(int64_t handle) {
  auto state = TheEngine().handles().Get(handle);
  if (!state) Raise(Status::InvalidArgument("unknown or released handle " + std::to_string(handle)));
  return state;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "spark_hvd native core (negotiation engine, Gloo/MPI backends)";

  m.def("gloo_built", [] { return SPARK_HVD_HAVE_GLOO == 1; });
  m.def("mpi_built", [] { return SPARK_HVD_HAVE_MPI == 1; });
  m.def("nccl_built", [] { return SPARK_HVD_HAVE_NCCL == 1; });
  m.def(
      "settings",
      [] {
        py::list out;
        for (const auto& s : env::Settings()) {
          out.append(py::dict(py::arg("name") = s.name, py::arg("type") = s.type,
                              py::arg("default") = s.default_value, py::arg("unit") = s.unit,
                              py::arg("meaning") = s.meaning));
        }
        return out;
      },
      "Every SPARK_HVD_* setting as the core compiled it (spark_hvd/settings.def): dicts of "
      "name, type, default, unit, meaning.");

  m.def(
      "init",
      [](int rank, int size, const std::string& controller, py::object store,
         const std::string& store_prefix, const std::string& bind_host, double connect_timeout_s,
         const std::string& timeline_path) {
        EngineOptions o;
        o.rank = rank;
        o.size = size;
        o.controller = controller;
        if (!store.is_none()) o.store = std::make_shared<PyStore>(store);
        o.store_prefix = store_prefix;
        o.gloo.bind_host = bind_host;
        o.gloo.connect_timeout_s = connect_timeout_s;
        o.timeline_path = timeline_path;
        Native([&] { TheEngine().Init(o); });
      },
      py::arg("rank"), py::arg("size"), py::arg("controller") = "gloo",
      py::arg("store") = py::none(), py::arg("store_prefix") = "spark_hvd",
      py::arg("bind_host") = "127.0.0.1", py::arg("connect_timeout_s") = 60.0,
      py::arg("timeline_path") = "");
  m.def("shutdown", [] { Native([] { TheEngine().Shutdown(); }); });
  m.def("is_initialized", [] { return TheEngine().initialized(); });
  m.def("rank", [] { return TheEngine().rank(); });
  m.def("size", [] { return TheEngine().size(); });
  m.def("controller", [] { return TheEngine().controller_name(); });

  m.def(
      "enqueue",
      [](int op, const std::string& name, int dtype, std::vector<int64_t> shape, uintptr_t input,
         uintptr_t output, int reduce_op, double prescale, double postscale, int root,
         int process_set, int device, std::vector<int64_t> splits, const std::string& group,
         int group_size) {
        if (!IsValidDataType(dtype)) Raise(Status::InvalidArgument("unknown dtype code " + std::to_string(dtype)));
        Request r;
        r.name = name;
        r.op = static_cast<OpType>(op);
        r.dtype = static_cast<DataType>(dtype);
        r.shape = std::move(shape);
        r.reduce_op = static_cast<ReduceOp>(reduce_op);
        r.prescale = prescale;
        r.postscale = postscale;
        r.root = root;
        r.process_set = process_set;
        r.device = device;
        r.splits = std::move(splits);
        r.group = group;
        r.group_size = group_size;
        try {
          return TheEngine().Enqueue(std::move(r), reinterpret_cast<const void*>(input),
                                     reinterpret_cast<void*>(output));
        } catch (const StatusError& e) {
          Raise(e.status());
        }
      },
      py::arg("op"), py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("input"),
      py::arg("output"), py::arg("reduce_op") = 0, py::arg("prescale") = 1.0,
      py::arg("postscale") = 1.0, py::arg("root") = 0, py::arg("process_set") = 0,
      py::arg("device") = kCpuDevice, py::arg("splits") = std::vector<int64_t>{},
      py::arg("group") = "", py::arg("group_size") = 0);
  m.def("add_process_set_op", [] { return static_cast<int>(kAddProcessSet); });
  m.def("remove_process_set_op", [] { return static_cast<int>(kRemoveProcessSet); });

  m.def("poll", [](int64_t h) { return TheEngine().handles().Poll(h); });
  m.def(
      "wait",
      [](int64_t h, double timeout_s) {
        return Native([&] { return TheEngine().handles().Wait(h, timeout_s); });
      },
      py::arg("handle"), py::arg("timeout_s") = -1.0);
  // The outcome of a completed op: raises its error, else returns
  // (output as a uint8 numpy array sharing the core's buffer, output shape,
  //  received splits, value).
  m.def("result", [](int64_t h) {
    auto state = StateOf(h);
    if (!state->done) Raise(Status::InvalidArgument("handle " + std::to_string(h) + " is not complete; call wait() first"));
    if (!state->status.ok()) Raise(state->status);
    auto* holder = new std::shared_ptr<OpState>(state);
    py::capsule owner(holder, [](void* p) { delete static_cast<std::shared_ptr<OpState>*>(p); });
    py::array_t<uint8_t> out({static_cast<py::ssize_t>(state->output.size())}, {1},
                             state->output.data(), owner);
    return py::make_tuple(out, state->output_shape, state->received_splits, state->value);
  });
  m.def("release", [](int64_t h) { TheEngine().handles().Release(h); });

  m.def("process_set_ranks", [](int id) { return TheEngine().ProcessSetRanks(id); });
  m.def("process_set_ids", [] { return TheEngine().ProcessSetIds(); });
  m.def("start_timeline", [](const std::string& path) {
    if (!TheEngine().StartTimeline(path)) Raise(Status::InvalidArgument("cannot open timeline file " + path));
  });
  m.def("stop_timeline", [] { TheEngine().StopTimeline(); });
}
