// spark_hvd._core: the only pybind11 translation unit. Every binding parses its
// Python arguments with the GIL held, releases the GIL around native work, and
// turns a failed Status into the matching spark_hvd.exceptions class (Raise).
#include <pybind11/native_enum.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <vector>

#include "backends/cuda/events.h"
#include "backends/cuda/loader.h"
#include "common/alloc_count.h"
#include "common/config.h"
#include "common/env.h"
#include "common/traffic.h"
#include "common/types.h"
#include "engine/engine.h"
#include "engine/instance.h"
#include "engine/message.h"
#include "python/dlpack.h"
#include "python/py_store.h"
#include "python/simulate.h"

namespace py = pybind11;
using namespace spark_hvd;

namespace {

// The exception carries the status's evidence as fields (exc.ranks, exc.tensor).
[[noreturn]] void Raise(const Status& s) {
  py::object exc = py::module_::import("spark_hvd.exceptions")
                       .attr("from_code")(s.code(), s.message(), py::arg("ranks") = s.ranks(),
                                          py::arg("tensor") = s.tensor());
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

// Python objects whose last core reference went away on a thread without the
// GIL (the engine's): decref'd by the next binding call that holds the GIL. The two
// vectors trade places at each drain, keeping their capacity: the engine's push_back
// allocates nothing per op in steady state.
constexpr size_t kReleasesKept = 1024;
std::mutex releases_mu;
std::vector<PyObject*> releases;
std::vector<PyObject*> draining;  // GIL held
bool in_drain = false;            // GIL held

void ReleaseLater(PyObject* obj) {
  if (PyGILState_Check()) {
    Py_DECREF(obj);
    return;
  }
  std::lock_guard<std::mutex> lock(releases_mu);
  releases.push_back(obj);
}

void DrainReleases() {  // GIL held
  // A decref may run Python code that calls a binding: that nested call leaves the
  // objects released meanwhile to the next drain instead of swapping `draining` away.
  if (in_drain) return;
  in_drain = true;
  {
    std::lock_guard<std::mutex> lock(releases_mu);
    draining.swap(releases);
  }
  for (PyObject* obj : draining) Py_DECREF(obj);
  draining.clear();
  in_drain = false;
}

// A Python object as the owner of an op's buffers, for the core to hold.
std::shared_ptr<void> OwnerOf(py::object obj) {
  if (obj.is_none()) return nullptr;
  return std::shared_ptr<void>(obj.release().ptr(),
                               [](void* p) { ReleaseLater(static_cast<PyObject*>(p)); });
}

// An op's input/output address: an int, or a numpy array's data pointer (the numpy
// layer passes its C-contiguous arrays: arr.ctypes.data would cost it ~1.5 us each).
uintptr_t AddressOf(py::handle obj) {
  if (py::isinstance<py::array>(obj)) {
    auto arr = py::reinterpret_borrow<py::array>(obj);
    if (!(arr.flags() & py::array::c_style)) {
      Raise(Status::InvalidArgument(
          "an op's input or output array must be C-contiguous; pass np.ascontiguousarray(a)"));
    }
    return reinterpret_cast<uintptr_t>(arr.data());
  }
  return obj.cast<uintptr_t>();
}

// One op as Python describes it (spark_hvd._ops.submit builds it with keyword fields):
// parsed into the engine's TensorEntry once, with the GIL held, when the op is
// submitted. enqueue() moves the entry out; an Op is submitted once.
struct Op {
  TensorEntry entry;
  bool submitted = false;
};

Op MakeOp(OpType op, const std::string& name, DataType dtype, std::vector<int64_t> shape,
          py::handle input, py::handle output, ReduceOp reduce_op, double prescale,
          double postscale, int root, int process_set, int device, std::vector<int64_t> splits,
          const std::string& group, int group_size, py::object owner, uintptr_t stream) {
  Op o;
  TensorEntry& e = o.entry;
  Request& r = e.req;
  r.op = op;
  r.name = name;
  r.dtype = dtype;
  r.shape = std::move(shape);
  r.reduce_op = reduce_op;
  r.prescale = prescale;
  r.postscale = postscale;
  r.root = root;
  r.process_set = process_set;
  r.device = device;
  r.splits = std::move(splits);
  r.group = group;
  r.group_size = group_size;
  e.input = reinterpret_cast<const void*>(AddressOf(input));
  e.output = reinterpret_cast<void*>(AddressOf(output));
  e.owner = OwnerOf(std::move(owner));
  e.stream = reinterpret_cast<void*>(stream);
  // A device op's ready event, recorded on its producer stream now, at submit (events.h).
  // Without the CUDA runtime no backend takes the op: Enqueue refuses it, saying so.
  const cuda::CudaApi* api = device >= 0 ? cuda::Cuda() : nullptr;
  if (api != nullptr) {
    cuda::PooledEvent ready;
    Status s = cuda::RecordReady(api, device, e.stream, &ready);
    if (!s.ok())
      Raise(Status(s.code(), std::string(OpTypeName(op)) + " '" + name + "': " + s.message()));
    e.ready = std::move(ready);
  }
  return o;
}

struct Work {
  std::shared_ptr<OpState> state;
  DataType dtype;  // of the op's tensors (a GPU output's DLPack type)
};

// The engine's Enqueue with its errors raised as Python exceptions (GIL held: the
// engine only queues, and wakes its thread).
std::vector<std::shared_ptr<OpState>> EnqueueEntries(std::vector<TensorEntry> entries, bool wake) {
  try {
    return TheEngine().Enqueue(std::move(entries), wake);
  } catch (const StatusError& e) {
    Raise(e.status());
  }
}

// The core's codes as enum.IntEnum subclasses (spark_hvd._types re-exports them):
// members compare, hash and pickle as the ints they are, so ReduceOp.SUM == 0
// and an op spec may carry either.
void BindEnums(py::module_& m) {
  py::native_enum<DataType>(m, "DataType", "enum.IntEnum", "Element types of tensors.")
      .value("UINT8", DataType::kUInt8)
      .value("INT8", DataType::kInt8)
      .value("INT16", DataType::kInt16)
      .value("INT32", DataType::kInt32)
      .value("INT64", DataType::kInt64)
      .value("FLOAT16", DataType::kFloat16)
      .value("BFLOAT16", DataType::kBFloat16)
      .value("FLOAT32", DataType::kFloat32)
      .value("FLOAT64", DataType::kFloat64)
      .value("BOOL", DataType::kBool)
      .finalize();
  py::native_enum<ReduceOp>(m, "ReduceOp", "enum.IntEnum",
                            "Reduction operations; spark_hvd.Sum etc. are these members.")
      .value("SUM", ReduceOp::kSum)
      .value("AVERAGE", ReduceOp::kAverage)
      .value("MIN", ReduceOp::kMin)
      .value("MAX", ReduceOp::kMax)
      .value("PRODUCT", ReduceOp::kProduct)
      .value("ADASUM", ReduceOp::kAdasum)
      .finalize();
  py::native_enum<OpType>(m, "OpType", "enum.IntEnum",
                          "Kinds of op an enqueue spec asks for, the internal ones included.")
      .value("ALLREDUCE", OpType::kAllreduce)
      .value("ALLGATHER", OpType::kAllgather)
      .value("BROADCAST", OpType::kBroadcast)
      .value("ALLTOALL", OpType::kAlltoall)
      .value("REDUCESCATTER", OpType::kReducescatter)
      .value("BARRIER", OpType::kBarrier)
      .value("JOIN", OpType::kJoin)
      .value("ADD_PROCESS_SET", kAddProcessSet)
      .value("REMOVE_PROCESS_SET", kRemoveProcessSet)
      .finalize();
  py::native_enum<StatusCode>(m, "StatusCode", "enum.IntEnum",
                              "Failure kinds; spark_hvd.exceptions has one class per code.")
      .value("OK", StatusCode::kOk)
      .value("UNKNOWN", StatusCode::kUnknown)
      .value("INVALID_ARGUMENT", StatusCode::kInvalidArgument)
      .value("MISMATCH", StatusCode::kMismatch)
      .value("NOT_INITIALIZED", StatusCode::kNotInitialized)
      .value("TIMEOUT", StatusCode::kTimeout)
      .value("PEER_LOST", StatusCode::kPeerLost)
      .value("STORE_ERROR", StatusCode::kStoreError)
      .value("AUTHENTICATION", StatusCode::kAuthentication)
      .value("INTERNAL", StatusCode::kInternal)
      .finalize();
}

py::dict CountsDict(const sim::Counts& c) {
  return py::dict(py::arg("seconds") = c.seconds, py::arg("cpu_s") = c.cpu_s,
                  py::arg("cycles") = c.cycles, py::arg("control_messages") = c.control_messages,
                  py::arg("control_bytes") = c.control_bytes,
                  py::arg("data_messages") = c.data_messages, py::arg("data_bytes") = c.data_bytes,
                  py::arg("liveness_messages") = c.liveness_messages, py::arg("opened") = c.opened,
                  py::arg("accepted") = c.accepted, py::arg("failed") = c.failed,
                  py::arg("dropped") = c.dropped);
}

py::dict ResourcesDict(const sim::Resources& r) {
  return py::dict(py::arg("fds") = r.fds, py::arg("sockets") = r.sockets,
                  py::arg("threads") = r.threads, py::arg("rss_bytes") = r.rss_bytes);
}

py::dict RequestsDict(const StoreRequests& q) {
  py::dict d;
  for (int op = 0; op < kStoreOps; ++op) d[StoreOpName(static_cast<StoreOp>(op))] = q.by_op[op];
  return d;
}

py::object StatusDict(const Status& s) {
  if (s.ok()) return py::none();
  return py::dict(py::arg("code") = s.code(), py::arg("message") = s.message(),
                  py::arg("ranks") = s.ranks());
}

// _core._simulate's answer (python/simulate.h's Result): per rank, lists indexed by rank.
py::dict SimulationDict(const sim::Result& x) {
  py::list init_s, fds, sockets, init_requests, requests, op_s, ops, killed_op, named_after_s;
  for (const sim::Rank& r : x.ranks) {
    init_s.append(r.init_s);
    fds.append(r.fds);
    sockets.append(r.sockets);
    init_requests.append(RequestsDict(r.init_requests));
    requests.append(RequestsDict(r.requests));
    op_s.append(r.op_s);
    ops.append(StatusDict(r.ops));
    killed_op.append(StatusDict(r.killed_op));
    named_after_s.append(r.named_after_s);
  }
  return py::dict(py::arg("size") = x.options.size, py::arg("ops") = x.options.ops,
                  py::arg("kill") = x.options.kill, py::arg("freeze") = x.options.freeze,
                  py::arg("error") = x.error, py::arg("init_s") = x.init_s,
                  py::arg("shutdown_s") = x.shutdown_s, py::arg("before") = ResourcesDict(x.before),
                  py::arg("after_init") = ResourcesDict(x.after_init),
                  py::arg("after_shutdown") = ResourcesDict(x.after_shutdown),
                  py::arg("init") = CountsDict(x.init), py::arg("steady") = CountsDict(x.steady),
                  py::arg("idle") = CountsDict(x.idle), py::arg("killed") = CountsDict(x.killed),
                  py::arg("ranks") = py::dict(
                      py::arg("init_s") = init_s, py::arg("fds") = fds,
                      py::arg("sockets") = sockets, py::arg("init_requests") = init_requests,
                      py::arg("requests") = requests, py::arg("op_s") = op_s, py::arg("ops") = ops,
                      py::arg("killed_op") = killed_op, py::arg("named_after_s") = named_after_s));
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  // Room for as many releases between two drains as a job keeps ops in flight.
  releases.reserve(kReleasesKept);
  draining.reserve(kReleasesKept);
  m.doc() = "spark_hvd native core (negotiation engine; tcp, gloo, mpi and nccl backends)";
  BindEnums(m);

  m.def("gloo_built", [] { return SPARK_HVD_HAVE_GLOO == 1; });
  m.def("mpi_built", [] { return SPARK_HVD_HAVE_MPI == 1; });
  // Whether the NCCL backend is compiled in and libnccl + the CUDA runtime load
  // (cuda/loader.h); cuda_built: whether the CUDA runtime loads and sees a GPU (GPU
  // tensors then run on NCCL, or staged through host memory).
  m.def("nccl_built", [] { return Native([] { return cuda::NcclBackendLoads(); }); });
  m.def("cuda_built", [] { return Native([] { return cuda::Cuda() != nullptr; }); });
  // Why nccl_built() is False ("" when it is True).
  m.def("nccl_unavailable_reason", [] {
    std::string why;
    cuda::NcclBackendLoads(&why);
    return why;
  });
  // Directories searched first for libcudart / libnccl (before the first load).
  m.def("set_library_dirs",
        [](const std::vector<std::string>& dirs) { cuda::SetLibraryDirs(dirs); });
  m.def(
      "settings",
      [] {
        py::list out;
        for (const auto& s : env::Settings()) {
          out.append(py::dict(py::arg("name") = s.name, py::arg("type") = s.type,
                              py::arg("default") = s.default_value, py::arg("unit") = s.unit,
                              py::arg("meaning") = s.meaning, py::arg("alias") = s.alias));
        }
        return out;
      },
      "Every SPARK_HVD_* setting as the core compiled it (spark_hvd/settings.def): dicts of "
      "name, type, default, unit, meaning, alias (Horovod's name, or '').");
  m.def(
      "setting_value",
      [](const std::string& name) {
        env::Value value;
        if (!env::Effective(name, &value)) {
          Raise(
              Status::InvalidArgument("no setting is named " + name + " (spark_hvd/settings.def)"));
        }
        return value;
      },
      py::arg("name"),
      "The value the core uses for setting `name` (SPARK_HVD_...), read from the environment "
      "(or its Horovod alias) at first use and cached.");

  m.def(
      "init",
      [](int rank, int size, const std::string& controller, py::object store,
         const std::string& store_prefix, const std::string& bind_host, double connect_timeout_s,
         const std::string& timeline_path, const std::string& host) {
        EngineOptions o;
        o.rank = rank;
        o.size = size;
        o.controller = controller;
        if (!store.is_none()) o.store = std::make_shared<PyStore>(store);
        o.store_prefix = store_prefix;
        o.bind_host = bind_host;
        o.connect_timeout_s = connect_timeout_s;
        o.timeline_path = timeline_path;
        o.host = host;
        Native([&] { TheEngine().Init(o); });
      },
      py::arg("rank"), py::arg("size"), py::arg("controller") = "gloo",
      py::arg("store") = py::none(), py::arg("store_prefix") = "spark_hvd",
      py::arg("bind_host") = "127.0.0.1", py::arg("connect_timeout_s") = 60.0,
      py::arg("timeline_path") = "", py::arg("host") = "");
  m.def("shutdown", [] {
    Native([] { TheEngine().Shutdown(); });
    DrainReleases();
  });
  m.def("is_initialized", [] { return TheEngine().initialized(); });
  m.def("rank", [] { return TheEngine().rank(); });
  m.def("size", [] { return TheEngine().size(); });
  m.def("controller", [] { return TheEngine().controller_name(); });

  // An op to enqueue: keyword fields only. input/output are addresses (ints, or
  // C-contiguous numpy arrays standing for their data pointers; stream: the CUDA stream
  // that produced a device input, 0 for the default one), and owner is the Python
  // object that keeps them valid; the core holds it until the op is finished with,
  // even when the returned Work is dropped first.
  py::class_<Op>(m, "Op")
      .def(py::init(&MakeOp), py::kw_only(), py::arg("op"), py::arg("name"), py::arg("dtype"),
           py::arg("shape"), py::arg("input") = 0, py::arg("output") = 0,
           py::arg("reduce_op") = ReduceOp::kSum, py::arg("prescale") = 1.0,
           py::arg("postscale") = 1.0, py::arg("root") = 0, py::arg("process_set") = 0,
           py::arg("device") = kCpuDevice, py::arg("splits") = std::vector<int64_t>{},
           py::arg("group") = "", py::arg("group_size") = 0, py::arg("owner") = py::none(),
           py::arg("stream") = 0)
      .def_property_readonly("name", [](const Op& o) { return o.entry.req.name; });

  // One or more Ops, queued together or not at all (a group is never half submitted).
  // wake=False: the caller waits for these ops right away (a blocking API call), and its
  // wait runs the cycle (Engine::Drive): the engine thread is not woken for them.
  m.def(
      "enqueue",
      [](const std::vector<Op*>& ops, bool wake) {
        DrainReleases();
        std::vector<TensorEntry> entries;
        entries.reserve(ops.size());
        for (Op* o : ops) {
          if (o->submitted) {
            Raise(
                Status::InvalidArgument("op '" + o->entry.req.name +
                                        "' was submitted already; make a new Op for each submit"));
          }
        }
        std::vector<DataType> dtypes;
        for (Op* o : ops) {
          o->submitted = true;
          dtypes.push_back(o->entry.req.dtype);
          entries.push_back(std::move(o->entry));
        }
        std::vector<std::shared_ptr<OpState>> states = EnqueueEntries(std::move(entries), wake);
        py::list works;
        for (size_t i = 0; i < states.size(); ++i) {
          works.append(Work{std::move(states[i]), dtypes[i]});
        }
        return works;
      },
      py::arg("ops"), py::arg("wake") = true);

  // One op alone, with the fields positional in Op's order: what enqueue([Op(...)])
  // does, without the keyword parsing, the Op and the lists (the per-call cost of a
  // small blocking collective; spark_hvd._ops.submit uses it outside a batch). wake as
  // enqueue's.
  m.def(
      "submit",
      [](OpType op, const std::string& name, DataType dtype, std::vector<int64_t> shape,
         py::handle input, py::handle output, ReduceOp reduce_op, double prescale, double postscale,
         int root, int process_set, int device, std::vector<int64_t> splits,
         const std::string& group, int group_size, py::object owner, uintptr_t stream, bool wake) {
        DrainReleases();
        Op o = MakeOp(op, name, dtype, std::move(shape), input, output, reduce_op, prescale,
                      postscale, root, process_set, device, std::move(splits), group, group_size,
                      std::move(owner), stream);
        std::vector<TensorEntry> entries;
        entries.push_back(std::move(o.entry));
        std::vector<std::shared_ptr<OpState>> states = EnqueueEntries(std::move(entries), wake);
        return Work{std::move(states[0]), dtype};
      },
      py::arg("op"), py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("input"),
      py::arg("output"), py::arg("reduce_op"), py::arg("prescale"), py::arg("postscale"),
      py::arg("root"), py::arg("process_set"), py::arg("device"), py::arg("splits"),
      py::arg("group"), py::arg("group_size"), py::arg("owner"), py::arg("stream"),
      py::arg("wake") = true);

  // An enqueued op, as the caller holds it (c10d's Work): dropping it never
  // frees what the op is still using; a result nobody claims is freed with it.
  py::class_<Work>(m, "Work")
      .def("poll",
           [](const Work& w) {
             DrainReleases();
             return TheEngine().completions().Done(*w.state);
           })
      .def(
          "wait",
          [](const Work& w, double timeout_s) {
            // A wait long enough to be a real one first runs the engine's next cycles on
            // this thread where the job allows it (Engine::Drive): no thread hand-off.
            const bool drive = timeout_s < 0 || timeout_s >= 0.1;
            bool done = Native([&] {
              Engine& engine = TheEngine();
              return (drive && engine.Drive(*w.state)) ||
                     engine.completions().Wait(*w.state, timeout_s);
            });
            DrainReleases();
            return done;
          },
          py::arg("timeout_s") = -1.0)
      // The outcome of a completed op: raises its error, else returns
      // (output, output shape, received splits, value). The output shares the core's
      // buffer: a uint8 numpy array for host memory, a DLPack capsule (typed, shaped)
      // for a GPU's.
      .def("result", [](const Work& w) {
        const auto& state = w.state;
        if (!TheEngine().completions().Done(*state)) {
          Raise(Status::InvalidArgument("the operation is not complete; call wait() first"));
        }
        if (!state->status.ok()) Raise(state->status);
        py::object out;
        if (state->output.device >= 0) {
          out = dlpack::Capsule(state, w.dtype);
        } else {
          auto* holder = new std::shared_ptr<OpState>(state);
          py::capsule owner(holder,
                            [](void* p) { delete static_cast<std::shared_ptr<OpState>*>(p); });
          out = py::array_t<uint8_t>({static_cast<py::ssize_t>(state->output.bytes)}, {1},
                                     static_cast<uint8_t*>(state->output.data), owner);
        }
        return py::make_tuple(out, state->output_shape, state->received_splits, state->value);
      });

  m.def(
      "tuned_parameters",
      [] {
        if (!TheEngine().initialized()) {
          Raise(
              Status::NotInitialized("spark_hvd is not initialized: call spark_hvd.init() first"));
        }
        const TuneState s = TheEngine().Tuned();
        py::list history;
        for (const auto& h : s.history) {
          history.append(
              py::make_tuple(h.cycle, h.params.fusion_threshold_bytes, h.params.cycle_time_ms));
        }
        return py::dict(py::arg("fusion_threshold") = s.current.fusion_threshold_bytes,
                        py::arg("cycle_time_ms") = s.current.cycle_time_ms,
                        py::arg("autotune") = s.tuned, py::arg("searching") = s.searching,
                        py::arg("history") = history);
      },
      "The fusion threshold (bytes) and cycle time (ms) the engine uses now; autotune: rank 0 "
      "runs SPARK_HVD_AUTOTUNE, searching: still searching; history: every change as "
      "(cycle, fusion_threshold, cycle_time_ms), the same on every rank.");
  m.def(
      "cache_stats",
      [] {
        const CacheStats& s = TheEngine().cache_stats();
        return py::dict(py::arg("hits") = s.hits.load(), py::arg("misses") = s.misses.load());
      },
      "This rank's requests since init that the response cache answered (hits: sent as one "
      "bit) or not (misses: cacheable ops sent in full).");
  m.def(
      "op_allocations", [] { return TheEngine().OpAllocations(); },
      "Heap allocations of op states and queue entries since the process started: flat "
      "over the steps of a job in steady state (the engine reuses them).");
  m.def(
      "engine_allocations", [] { return CountedAllocations(); },
      "Heap allocations (operator new) made by the engine's thread, and by the engine "
      "cycles API threads run (Drive), since the process started: flat over the steps of a "
      "job in steady state (common/alloc_count.h).");
  m.def(
      "_probe_allocations", [] { return ProbeCountedAllocations(); },
      "Self-check of engine_allocations' hook: what it counts of a vector and a string "
      "growing on the heap (>= 2 when it sees both).");
  m.def(
      "driven_cycles", [] { return TheEngine().DrivenCycles(); },
      "Engine cycles run on API threads waiting for their op (Engine::Drive) since the "
      "process started.");
  m.def(
      "cycles", [] { return TheEngine().Cycles(); },
      "Negotiation cycles this process has run since it started (any thread).");
  m.def(
      "traffic",
      [] {
        py::dict senders;
        for (int s = 0; s < kTrafficSenders; ++s) {
          py::dict kinds;
          for (int k = 0; k < kTrafficKinds; ++k) {
            const TrafficCount& c =
                Traffic(static_cast<TrafficSender>(s), static_cast<TrafficKind>(k));
            kinds[TrafficKindName(static_cast<TrafficKind>(k))] = py::dict(
                py::arg("messages") = c.messages.load(), py::arg("bytes") = c.bytes.load());
          }
          senders[TrafficSenderName(static_cast<TrafficSender>(s))] = kinds;
        }
        const ConnectionCount& c = Connections();
        senders["connections"] =
            py::dict(py::arg("opened") = c.opened.load(), py::arg("accepted") = c.accepted.load(),
                     py::arg("failed") = c.failed.load(), py::arg("dropped") = c.dropped.load());
        return senders;
      },
      "What this process has sent since it started (common/traffic.h): for each sender "
      "(tcp, shm, gloo, mpi, heartbeat), by kind (control: the per-cycle negotiation, data: "
      "collectives, liveness: heartbeats), messages and bytes (shm: rounds posted, no bytes); "
      "and connections: opened (connected and acknowledged), accepted, failed (attempts "
      "refused, reset or retried), dropped (accepted but invalid).");
  m.def(
      "_simulate",
      [](int size, int ops, int kill, bool freeze, double timeout_s, int warmup, double idle_s,
         const std::string& bind_host) {
        sim::Options o;
        o.size = size;
        o.ops = ops;
        o.kill = kill;
        o.freeze = freeze;
        o.timeout_s = timeout_s;
        o.warmup = warmup;
        o.idle_s = idle_s;
        o.bind_host = bind_host;
        return SimulationDict(Native([&] { return sim::Run(o); }));
      },
      py::arg("size"), py::arg("ops") = 50, py::arg("kill") = -1, py::arg("freeze") = false,
      py::arg("timeout_s") = 60.0, py::arg("warmup") = 3, py::arg("idle_s") = 0.0,
      py::arg("bind_host") = "127.0.0.1",
      "Tests and bench/scale.py only: `size` ranks of one job as engines on threads of this "
      "process (csrc/python/simulate.h): init, cached 4-byte allreduces, rank `kill` "
      "crashed or, with freeze, stopped (-1: none), shutdown; a dict of what each phase cost. "
      "Needs "
      "SPARK_HVD_CPU_OPERATIONS=tcp.");
  m.def("process_set_ranks", [](int id) { return TheEngine().ProcessSetRanks(id); });
  m.def("process_set_ids", [] { return TheEngine().ProcessSetIds(); });
  m.def("start_timeline", [](const std::string& path) {
    if (!TheEngine().StartTimeline(path))
      Raise(Status::InvalidArgument("cannot open timeline file " + path));
  });
  m.def("stop_timeline", [] { TheEngine().StopTimeline(); });
}
