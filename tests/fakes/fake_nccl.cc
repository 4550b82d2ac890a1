// libshvd_fake_nccl.so: the NCCL subset of csrc/backends/cuda/api.h between processes
// of one machine, over the fake CUDA runtime's host-memory "devices" and streams
// (fake_internal.h). It enforces NCCL's contract where a backend could break it, so
// wrong logic fails here, not first on a cluster. This file: the C API, handles and
// groups; fake_nccl_comm.cc: one rank's communicator; fake_nccl_coordinator.cc: the
// matching and arithmetic between ranks.
//
// Contract
// * ncclGetUniqueId starts a coordinator in the calling process (a thread listening on
//   127.0.0.1, ephemeral port; fake_nccl_coordinator.cc) and puts a magic, the port and a
//   random nonce in the id. That process must outlive every use of the communicator by
//   the other ranks (it may destroy its own comm earlier); when every rank has closed
//   its connection the coordinator ends. One id makes one communicator.
// * ncclCommInitRank(comm, nranks, id, rank) blocks until all nranks joined. Errors on
//   every rank: nranks disagreeing, a rank taken twice, two ranks on one host with one
//   device ("Duplicate GPU detected", ncclInvalidUsage; a device is its index among
//   SHVD_FAKE_CUDA_DEVICES after CUDA_VISIBLE_DEVICES, the host is gethostname() or
//   SHVD_FAKE_NCCL_HOST), a rank that died before all joined (ncclRemoteError). Bad
//   arguments (nranks < 1 or > 65536, rank out of range, an id not from this fake) ->
//   ncclInvalidArgument; an unreachable coordinator -> ncclSystemError. The comm is on
//   the calling thread's current device. (It blocks at once even inside a group: one
//   thread cannot init several comms of one id in a group.)
// * Calls are checked when made, as real NCCL's argument checks: datatype, root/peer
//   in range, op (builtin, or a live PreMulSum op of this comm made for this dtype; a
//   destroyed or foreign one -> ncclInvalidArgument), every buffer the call touches
//   must lie inside one cudaMalloc allocation of the comm's device (count 0: unchecked)
//   -> else ncclInvalidArgument (stricter than real NCCL, which by default faults in
//   the kernel, and accepts pinned host memory); a stream that is not live or on
//   another device -> ncclUnhandledCudaError. A comm with an async error returns that
//   error from every call (ncclCommEnsureReady).
// * A call (outside a group) or a group (at the outermost ncclGroupEnd; nesting is per
//   thread) is queued on its stream(s) and runs in stream order: only then are inputs
//   read (and a ncclScalarDevice scalar), and outputs written when every op of it has
//   completed. A group whose calls used several streams holds all of them. Grouped
//   calls are shipped together, so grouped send/recv and broadcasts cannot deadlock;
//   ungrouped ones block their stream until matched, so a send that waits for a recv
//   queued behind it deadlocks, as with real NCCL. ncclGroupEnd without a start ->
//   ncclInvalidUsage; a call that failed inside a group fails the whole group at its
//   ncclGroupEnd (nothing of it is issued). On the null stream a call runs in the
//   calling thread, which it blocks until every rank has matched it.
// * ncclRedOpCreatePreMulSum: ncclScalarHostImmediate copies the value at once;
//   ncclScalarDevice needs device (or pinned) memory, read each time a collective
//   using the op runs. Op handles are unique in the process.
// * Matching and results: see fake_nccl_coordinator.cc. Collectives match by their
//   index per comm, send/recv by their index per (sender, receiver) pair. Disagreeing
//   descriptors fail the op on every rank and set the comm's async error to
//   ncclInvalidUsage with both calls in ncclGetLastError; queued ops then fail too
//   (outputs untouched). ncclAvg also takes integers (sum, then truncating division), as
//   real NCCL does; floating ncclAvg premultiplies by (dtype)(1/n).
// * A peer process that dies: the comm's async error becomes ncclRemoteError (within
//   milliseconds: its socket closes) and its queued and running ops block their streams
//   until ncclCommAbort, which lets them finish without writing outputs. A process that
//   exits with a live comm counts as dead, crash or not: destroy comms before exiting.
//   A rank that destroys its comm while another still needs it for a matching call
//   fails that call (ncclInvalidUsage; ncclRemoteError if it aborted).
// * ncclCommDestroy waits for the comm's queued work (it blocks forever if a peer died,
//   saying so on stderr: use ncclCommAbort then). After destroy or abort the handle
//   stays dead: every call on it -> ncclInvalidUsage. ncclRedOpDestroy may follow the
//   last call using the op.
// * ncclGetLastError(comm): that comm's async error text, else the process's last error.
//   ncclGetVersion -> 22304.
// * One thread at a time per communicator: a call (collectives, send/recv, op create and
//   destroy, abort, destroy) made while another thread is inside one on the same comm
//   fails with ncclInvalidUsage and says so on stderr ("... must not overlap"); an
//   overlapping abort or destroy still happens (the report is the test's evidence).
// * For tests: shvd_fake_nccl_calls() counts the collective and send/recv calls this
//   process made that NCCL accepted (a script waits on it to know its op reached NCCL).
//   Failures on demand, read from the environment: SHVD_FAKE_NCCL_INIT_ERROR=<code>
//   fails ncclCommInitRank at once with that code; SHVD_FAKE_NCCL_FAIL_CALL=<n>:<code>
//   makes the n-th accepted call's communicator fail: its ops block their streams until
//   abort, and the next call on it finds <code> (its async error from then on);
//   SHVD_FAKE_NCCL_HANG_CALL=<n>: the n-th accepted call (counted as FAIL_CALL's) waits
//   for peers that never come, as NCCL connecting to a peer that never makes the call:
//   on a blocking comm it blocks until another thread aborts the comm (which the overlap
//   check reports); on a non-blocking one (ncclCommInitRankConfig, blocking = 0) it
//   returns ncclInProgress, and ncclCommGetAsyncError says ncclInProgress, until abort.
//   SHVD_FAKE_NCCL_STOP_AT_CALL=<n>: the process stops (SIGSTOP) as it makes its n-th
//   call (accepted or not): a rank frozen before its collective, silent but alive.
//   SHVD_FAKE_NCCL_STOP_AT_INIT=<n>: the same as it enters its n-th ncclCommInitRank
//   (or ...Config): a rank frozen at its first GPU op, before it joins the communicator.
//   SHVD_FAKE_NCCL_STUCK_CALL_MS=<ms> makes each
//   call on a communicator that has an async error block that long before returning it
//   (as a real call stuck on a broken connection).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "fake_internal.h"
#include "fake_nccl_comm.h"
#include "fake_nccl_wire.h"

namespace shvd_fake {
namespace {

constexpr char kIdMagic[8] = {'S', 'H', 'V', 'D', 'F', 'A', 'K', 'E'};
struct IdLayout {
  char magic[8];
  uint64_t nonce;
  uint16_t port;
};
static_assert(sizeof(IdLayout) <= sizeof(ncclUniqueId), "id layout");
constexpr int kMaxRanks = 65536;

// Handles: never reused, so a destroyed or aborted one is recognized.
class Registry {
 public:
  ncclComm_t Add(std::shared_ptr<Comm> comm) {
    auto handle = reinterpret_cast<ncclComm_t>(new char);
    std::lock_guard<std::mutex> lock(mu_);
    live_[handle] = std::move(comm);
    return handle;
  }
  std::shared_ptr<Comm> Peek(ncclComm_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(handle);
    return it == live_.end() ? nullptr : it->second;
  }
  ncclResult_t Find(ncclComm_t handle, const char* fn, std::shared_ptr<Comm>* comm) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(handle);
    if (it != live_.end()) {
      *comm = it->second;
      return ncclSuccess;
    }
    if (dead_.count(handle)) {
      return Fail(ncclInvalidUsage, std::string(fn) +
                                        ": the communicator was destroyed or "
                                        "aborted already");
    }
    return Fail(ncclInvalidArgument,
                std::string(fn) + ": " + (handle ? "not a communicator" : "comm is NULL"));
  }
  std::shared_ptr<Comm> Retire(ncclComm_t handle, const char* fn, ncclResult_t* rc) {
    std::shared_ptr<Comm> comm;
    *rc = Find(handle, fn, &comm);
    if (*rc != ncclSuccess) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(handle);
    dead_.insert(handle);
    return comm;
  }

 private:
  std::mutex mu_;
  std::unordered_map<ncclComm_t, std::shared_ptr<Comm>> live_;
  std::unordered_set<ncclComm_t> dead_;
};

Registry& Comms() {
  static Registry* registry = new Registry;  // leaked: stream workers may outlive main()
  return *registry;
}

// ncclGroupStart/End state of this thread.
thread_local int t_depth = 0;
thread_local std::vector<std::pair<std::shared_ptr<Comm>, Call>> t_calls;
thread_local ncclResult_t t_group_error = ncclSuccess;

thread_local std::shared_ptr<Comm> t_hang;  // the group holds SHVD_FAKE_NCCL_HANG_CALL's call

unsigned long long EnvCount(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : 0;
}

ncclResult_t Flush(bool entered) {
  if (t_hang) {  // the whole group waits for the peers of its hung call
    auto comm = std::move(t_hang);
    t_hang.reset();
    t_calls.clear();
    t_group_error = ncclSuccess;
    return comm->Hang(entered ? "a collective" : "ncclGroupEnd", entered);
  }
  auto calls = std::move(t_calls);
  t_calls.clear();
  const ncclResult_t group_error = t_group_error;
  t_group_error = ncclSuccess;
  if (group_error != ncclSuccess) return group_error;
  if (calls.empty()) return ncclSuccess;
  auto unit = std::make_unique<Unit>();
  std::vector<cudaStream_t> streams;
  for (auto& [comm, call] : calls) {
    auto it = std::find_if(unit->parts.begin(), unit->parts.end(),
                           [&](const Part& p) { return p.comm == comm; });
    if (it == unit->parts.end()) {
      unit->parts.push_back(Part{comm, {}, 0, false});
      it = unit->parts.end() - 1;
    }
    it->calls.push_back(call);
    streams.push_back(call.stream);
  }
  for (size_t i = 0; i < unit->parts.size(); ++i) {
    if (!unit->parts[i].comm->Issue(&unit->parts[i])) {
      for (size_t j = 0; j < i; ++j) unit->parts[j].comm->Finish();
      return Fail(ncclInvalidUsage,
                  "ncclGroupEnd: a communicator of the group was destroyed "
                  "or aborted before it");
    }
  }
  Unit* raw = unit.release();
  if (shvd_fake_enqueue_joined(streams.data(), int(streams.size()), RunUnit, raw) != cudaSuccess) {
    for (auto& p : raw->parts) p.comm->Finish();
    delete raw;
    return Fail(ncclUnhandledCudaError, "a stream of the call was destroyed");
  }
  return ncclSuccess;
}

std::atomic<unsigned long long> g_calls{0};  // accepted calls (shvd_fake_nccl_calls)

// SHVD_FAKE_NCCL_FAIL_CALL=<n>:<code>: the n-th accepted call of this process (from 1)
// makes its communicator fail with <code> (Comm::Inject).
struct FailCall {
  unsigned long long n = 0;
  ncclResult_t code = ncclSuccess;
};

const FailCall& Planned() {
  static const FailCall plan = [] {
    FailCall p;
    const char* v = std::getenv("SHVD_FAKE_NCCL_FAIL_CALL");
    if (v && *v) {
      char* rest = nullptr;
      p.n = std::strtoull(v, &rest, 10);
      if (rest && *rest == ':') p.code = std::atoi(rest + 1);
    }
    return p;
  }();
  return plan;
}

// Comm::Enter/Leave around a call (a call that overlaps another fails).
class InCall {
 public:
  InCall(const std::shared_ptr<Comm>& comm, const char* fn) : comm_(comm) {
    entered_ = comm_ && comm_->Enter(fn);
  }
  ~InCall() {
    if (entered_) comm_->Leave();
  }
  bool ok() const { return !comm_ || entered_; }

 private:
  std::shared_ptr<Comm> comm_;
  bool entered_ = false;
};

ncclResult_t Enqueue(ncclComm_t handle, uint8_t kind, const void* send, void* recv, size_t count,
                     int dtype, int op, int peer, cudaStream_t stream) {
  static std::atomic<unsigned long long> made{0};
  static const unsigned long long stop_at = EnvCount("SHVD_FAKE_NCCL_STOP_AT_CALL");
  if (++made == stop_at) ::raise(SIGSTOP);
  std::shared_ptr<Comm> comm;
  Call call;
  ncclResult_t rc = Comms().Find(handle, OpName(kind), &comm);
  InCall in_call(comm, OpName(kind));
  if (!in_call.ok()) rc = ncclInvalidUsage;
  if (rc == ncclSuccess) rc = comm->Ready(OpName(kind));
  if (rc == ncclSuccess)
    rc = comm->Prepare(kind, send, recv, count, dtype, op, peer, stream, &call);
  if (rc != ncclSuccess) {
    if (t_depth > 0 && t_group_error == ncclSuccess) t_group_error = rc;
    return rc;
  }
  t_calls.emplace_back(comm, call);
  if (++g_calls == Planned().n && Planned().code != ncclSuccess) comm->Inject(Planned().code);
  static const unsigned long long hang = EnvCount("SHVD_FAKE_NCCL_HANG_CALL");
  if (g_calls == hang) t_hang = comm;
  return t_depth == 0 ? Flush(true) : ncclSuccess;
}

std::string Hostname() {
  const char* env = std::getenv("SHVD_FAKE_NCCL_HOST");
  if (env && *env) return env;
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

}  // namespace
}  // namespace shvd_fake

using namespace shvd_fake;

extern "C" {

unsigned long long shvd_fake_nccl_calls(void) { return g_calls.load(); }

ncclResult_t ncclGetVersion(int* version) {
  if (!version) return Fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
  *version = 22304;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return Fail(ncclInvalidArgument, "ncclGetUniqueId: id is NULL");
  IdLayout layout{};
  std::memcpy(layout.magic, kIdMagic, sizeof kIdMagic);
  if (!StartCoordinator(&layout.port, &layout.nonce))
    return Fail(ncclSystemError, "ncclGetUniqueId: cannot listen on 127.0.0.1");
  std::memset(id, 0, sizeof *id);
  std::memcpy(id->internal, &layout, sizeof layout);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  static std::atomic<unsigned long long> inits{0};
  static const unsigned long long stop_at = EnvCount("SHVD_FAKE_NCCL_STOP_AT_INIT");
  if (++inits == stop_at) ::raise(SIGSTOP);
  if (!comm) return Fail(ncclInvalidArgument, "ncclCommInitRank: comm is NULL");
  if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks) {
    return Fail(ncclInvalidArgument, "ncclCommInitRank: rank " + std::to_string(rank) +
                                         " of nranks " + std::to_string(nranks) +
                                         " is out of range");
  }
  IdLayout layout;
  std::memcpy(&layout, id.internal, sizeof layout);
  if (std::memcmp(layout.magic, kIdMagic, sizeof kIdMagic) != 0) {
    return Fail(ncclInvalidArgument,
                "ncclCommInitRank: the id was not made by this (fake) "
                "ncclGetUniqueId");
  }
  const char* injected = std::getenv("SHVD_FAKE_NCCL_INIT_ERROR");
  if (injected && *injected) {
    return Fail(std::atoi(injected),
                "ncclCommInitRank (rank " + std::to_string(rank) +
                    "): "
                    "fake NCCL: SHVD_FAKE_NCCL_INIT_ERROR injected this failure");
  }
  const int device = shvd_fake_current_device();
  const int physical = shvd_fake_physical_device(device);
  if (physical < 0) return Fail(ncclUnhandledCudaError, "ncclCommInitRank: no CUDA device");
  int fd = ConnectLoopback(layout.port);
  if (fd < 0) {
    return Fail(ncclSystemError, "ncclCommInitRank: cannot reach the coordinator at 127.0.0.1:" +
                                     std::to_string(layout.port) +
                                     " (has the process that called ncclGetUniqueId "
                                     "exited?)");
  }
  Writer join;
  join.Put<uint64_t>(layout.nonce)
      .Put<int32_t>(nranks)
      .Put<int32_t>(rank)
      .Put<int32_t>(device)
      .Put<int32_t>(physical)
      .Put<int32_t>(int32_t(::getpid()))
      .Str(Hostname());
  MsgType type = kJoined;
  std::string reply;
  if (!SendFrame(fd, kJoin, join.data()) || !RecvFrame(fd, &type, &reply) || type != kJoined) {
    ::close(fd);
    return Fail(ncclSystemError, "ncclCommInitRank: the coordinator closed the connection");
  }
  Reader r(reply);
  const ncclResult_t status = r.Get<int32_t>();
  const int home = r.Get<int32_t>();
  const std::string message = r.Str();
  if (status != ncclSuccess) {
    ::close(fd);
    return Fail(status, "ncclCommInitRank (rank " + std::to_string(rank) + "): " + message);
  }
  *comm = Comms().Add(std::make_shared<Comm>(fd, rank, nranks, device, home));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  if (config && (config->magic != kNcclConfigMagic || config->version < 21400 ||
                 config->size < sizeof(ncclConfig_t))) {
    return Fail(ncclInvalidArgument,
                "ncclCommInitRankConfig: the config was not made as "
                "NCCL_CONFIG_INITIALIZER makes one (size, magic 0xcafebeef, version >= 2.14)");
  }
  const ncclResult_t rc = ncclCommInitRank(comm, nranks, id, rank);  // done at once: allowed
  if (rc == ncclSuccess && config && config->blocking == 0) Comms().Peek(*comm)->nonblocking = true;
  return rc;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  InCall in_call(Comms().Peek(comm), "ncclCommDestroy");  // an overlap is reported
  ncclResult_t rc;
  auto c = Comms().Retire(comm, "ncclCommDestroy", &rc);
  if (c) c->Destroy();
  return rc;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  InCall in_call(Comms().Peek(comm), "ncclCommAbort");  // an overlap is reported
  ncclResult_t rc;
  auto c = Comms().Retire(comm, "ncclCommAbort", &rc);
  if (c) c->Abort();
  return rc;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  std::shared_ptr<Comm> c;
  ncclResult_t rc = Comms().Find(comm, "ncclCommGetAsyncError", &c);
  if (rc != ncclSuccess) return rc;
  if (!async_error) return Fail(ncclInvalidArgument, "ncclCommGetAsyncError: asyncError is NULL");
  *async_error = c->AsyncError();
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  thread_local std::string text;  // the pointer stays valid until this thread's next call
  auto c = Comms().Peek(comm);
  text = c ? c->LastError() : std::string();
  if (text.empty()) text = LastErrorText();
  return text.c_str();
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return Enqueue(comm, kAllReduce, send, recv, count, dtype, op, 0, stream);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return Enqueue(comm, kBroadcast, send, recv, count, dtype, 0, root, stream);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, ncclDataType_t dtype,
                           ncclComm_t comm, cudaStream_t stream) {
  return Enqueue(comm, kAllGather, send, recv, send_count, dtype, 0, 0, stream);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count,
                               ncclDataType_t dtype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return Enqueue(comm, kReduceScatter, send, recv, recv_count, dtype, op, 0, stream);
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t dtype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return Enqueue(comm, kSend, send, nullptr, count, dtype, 0, peer, stream);
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t dtype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return Enqueue(comm, kRecv, nullptr, recv, count, dtype, 0, peer, stream);
}

ncclResult_t ncclGroupStart() {
  ++t_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (t_depth == 0)
    return Fail(ncclInvalidUsage, "ncclGroupEnd: not in a group (no matching ncclGroupStart)");
  return --t_depth > 0 ? ncclSuccess : Flush(false);
}

ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t dtype,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
  const char* fn = "ncclRedOpCreatePreMulSum";
  std::shared_ptr<Comm> c;
  ncclResult_t rc = Comms().Find(comm, fn, &c);
  InCall in_call(c, fn);
  if (!in_call.ok()) return ncclInvalidUsage;
  if (rc == ncclSuccess) rc = c->Ready(fn);
  if (rc != ncclSuccess) return rc;
  const size_t size = DtypeSize(dtype);
  if (!op || !scalar || size == 0) {
    return Fail(ncclInvalidArgument, std::string(fn) + ": NULL op or scalar, or invalid datatype");
  }
  if (residence == ncclScalarHostImmediate) {
    uint64_t bytes = 0;
    std::memcpy(&bytes, scalar, size);
    return c->AddOp(dtype, bytes, nullptr, op);
  }
  if (residence == ncclScalarDevice) {
    int dev = -1;
    int kind = shvd_fake_memory_kind(scalar, size, &dev);
    if (kind != kShvdFakeDevice && kind != kShvdFakePinned) {
      return Fail(ncclInvalidArgument, std::string(fn) +
                                           ": an ncclScalarDevice scalar must be "
                                           "in device (or pinned) memory");
    }
    return c->AddOp(dtype, 0, scalar, op);
  }
  return Fail(ncclInvalidArgument,
              std::string(fn) + ": invalid residence " + std::to_string(residence));
}

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  if (op < ncclNumOps)
    return Fail(ncclInvalidArgument, "ncclRedOpDestroy: the op is a builtin or invalid");
  std::shared_ptr<Comm> c;
  ncclResult_t rc = Comms().Find(comm, "ncclRedOpDestroy", &c);
  InCall in_call(c, "ncclRedOpDestroy");
  if (!in_call.ok()) return ncclInvalidUsage;
  return rc != ncclSuccess ? rc : c->DestroyOp(op);
}

}  // extern "C"
