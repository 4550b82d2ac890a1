#include "engine/engine.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "backends/host_adasum.h"
#include "common/alloc_count.h"
#include "common/env.h"
#include "common/logging.h"
#include "engine/executor.h"
#include "net/heartbeat.h"

namespace spark_hvd {
namespace {

// A group comes whole, in one enqueue: the controller relies on every rank's
// members reaching it in the same cycle (groups.h).
void CheckGroupsWhole(const std::vector<TensorEntry>& entries) {
  std::map<std::string, int32_t> count;
  for (const auto& e : entries) {
    if (!e.req.group.empty()) ++count[TensorKey(e.req.process_set, e.req.group)];
  }
  for (const auto& e : entries) {
    const Request& q = e.req;
    if (q.group.empty() || count[TensorKey(q.process_set, q.group)] == q.group_size) continue;
    throw StatusError(
        Status::InvalidArgument(
            "group '" + q.group + "': this call holds " +
            std::to_string(count[TensorKey(q.process_set, q.group)]) + " of its tensors but '" +
            q.name + "' says the group has " + std::to_string(q.group_size) +
            "; submit every tensor of a group in one call (spark_hvd's grouped_* ops do)")
            .WithTensor(q.name));
  }
}

}  // namespace

Engine::Engine() { RegisterBuiltinBackends(&registry_); }

Engine::~Engine() { Shutdown(); }

void Engine::Init(const EngineOptions& options) {
  if (running_.load()) return;
  if (thread_.joinable()) thread_.join();
  options_ = options;
  controller_name_ = options.controller;
  registry_.AddPlugins(env::BackendPlugins());
  rank_ = options.rank;
  size_ = options.size;
  shutdown_requested_ = false;
  failure_ = Status::OK();
  SetLogRank(rank_);
  std::promise<Status> ready;
  auto fut = ready.get_future();
  thread_ = std::thread([this, &ready] {
#ifdef __linux__
    pthread_setname_np(pthread_self(), "shvd_engine");  // top -H, perf (15 chars max)
#endif
    CountAllocations counted;  // _core.engine_allocations() (common/alloc_count.h)
    Loop(&ready);
  });
  Status s = fut.get();
  if (!s.ok()) {
    thread_.join();
    throw StatusError(s);
  }
  if (!options.timeline_path.empty()) StartTimeline(options.timeline_path);
}

std::unique_ptr<ProcessSet> Engine::MakeProcessSet(int32_t id, std::vector<int32_t> ranks) {
  auto set = std::make_unique<ProcessSet>();
  set->id = id;
  set->ranks = std::move(ranks);
  // Each backend splits its own global communicator (collective over the job;
  // ranks outside the set get no communicator).
  for (const auto& link : sets_.Get(0)->comms) {
    auto sub = link.comm->Split(set->ranks, id);
    if (sub) set->comms.push_back({link.backend, std::move(sub)});
  }
  return set;
}

void Engine::Connect() {
  BackendOptions bo;
  bo.rank = rank_;
  bo.size = size_;
  bo.controller = controller_name_;
  bo.cpu_operations = CpuOperationsSetting();
  bo.store = options_.store;
  bo.store_prefix = options_.store_prefix;
  bo.bind_host = options_.bind_host;
  bo.host = options_.host;
  bo.timeout_s = env::TimeoutS();
  bo.connect_timeout_s = options_.connect_timeout_s;
  if (options_.store) {
    bo.lost_ranks = [store = options_.store] { return store->LostRanks(); };
  }
  bo.connect_backend = [this](const std::string& name, const BackendOptions& o) {
    Backend* b = registry_.Find(name);
    if (b == nullptr || !TakesCpuOps(*b)) {
      throw StatusError(Status::InvalidArgument(
          "'" + name +
          "' is not a CPU backend to stage GPU tensors on (SPARK_HVD_GPU_OPERATIONS"
          " takes nccl, or a CPU backend: tcp, gloo, mpi)"));
    }
    return b->Connect(o);
  };
  backends_ = registry_.Select(bo);
  // Heartbeats first, so every communicator can stop waiting on a lost peer. Under
  // MPI the ranks are MPI's (the control plane defines them) and mpirun ends a job
  // whose rank died: no heartbeats there.
  if (controller_name_ != "mpi") {
    LivenessOptions lo;
    lo.rank = bo.rank;
    lo.size = bo.size;
    lo.store = bo.store;
    lo.store_prefix = bo.store_prefix;
    lo.bind_host = bo.bind_host;
    lo.connect_timeout_s = bo.connect_timeout_s;
    lo.lost_ranks = bo.lost_ranks;
    liveness_ = StartHeartbeats(lo);
    bo.liveness = liveness_.get();
  }
  // The control plane connects first: it may define the ranks (MPI's world).
  Backend* control = *std::find_if(backends_.begin(), backends_.end(),
                                   [](Backend* b) { return b->ControlPlane(); });
  std::unique_ptr<Communicator> control_comm = control->Connect(bo);
  rank_ = bo.rank = control_comm->rank();
  size_ = bo.size = control_comm->size();
  SetLogRank(rank_);
  auto global = std::make_unique<ProcessSet>();
  for (int32_t r = 0; r < size_; ++r) global->ranks.push_back(r);
  for (Backend* b : backends_) {
    global->comms.push_back({b, b == control ? std::move(control_comm) : b->Connect(bo)});
    if (b == control) control_ = global->comms.back().comm.get();
  }
  // A communicator ahead of the control plane's that can carry the exchange in this job
  // (shm, when every rank shares a host) takes it over.
  for (const auto& link : global->comms) {
    if (link.comm.get() == control_) break;
    if (link.comm->CarriesControl()) {
      control_ = link.comm.get();
      break;
    }
  }
  sets_.Add(std::move(global));
}

void Engine::Loop(std::promise<Status>* ready) {
  engine_thread_ = std::this_thread::get_id();
  try {
    Connect();
  } catch (const StatusError& e) {
    sets_.Clear();
    FinalizeBackends();
    liveness_.reset();
    ready->set_value(e.status());
    return;
  } catch (const std::exception& e) {
    sets_.Clear();
    FinalizeBackends();
    liveness_.reset();
    ready->set_value(Status::Internal(std::string("engine start failed: ") + e.what()));
    return;
  }
  tuner_.Reset(rank_);
  cache_stats_.Reset();
  {
    std::lock_guard<std::mutex> cycle(cycle_mu_);
    controller_ = std::make_unique<Controller>(rank_, size_, &sets_, &tuner_, &cache_stats_);
    in_flight_ = std::make_unique<InFlight>(&completions_);
    executor_ = std::make_unique<Executor>(rank_, &sets_, &queue_, &completions_, in_flight_.get(),
                                           &timeline_);
  }
  // Drive needs every communicator that runs CPU ops (the control plane's too) to allow
  // calls from any thread; device ops stay on this thread (TakeNewOffThread).
  any_thread_ = std::all_of(backends_.begin(), backends_.end(),
                            [](Backend* b) { return b->AnyThread() || !TakesCpuOps(*b); });
  {
    std::string names;
    for (Backend* b : backends_) names += std::string(names.empty() ? "" : ", ") + b->name();
    SHVD_LOG(kDebug, "engine") << "backends: " << names << "; API threads "
                               << (any_thread_ ? "may" : "may not") << " run cycles";
  }
  stop_ = Status::OK();
  stopping_ = false;
  handed_back_ = false;
  cycle_wait_ = std::chrono::duration<double, std::milli>(tuner_.cycle_time_ms());
  next_cycle_ = Clock::now();
  running_ = true;
  ready->set_value(Status::OK());  // `ready` dies with Init's frame: no use after this

  // Sleep out the cycle unless work arrives: a rank that enqueues while the engine idles
  // starts the next exchange at once (peers join it on their own cycle), so a blocking op
  // does not pay up to a whole cycle of latency. RunCycle sets when the next cycle is due
  // (next_cycle_), whichever thread ran it: a wake-up for work a Driving API thread has
  // already run finds nothing due and sleeps again, so it adds no cycle.
  while (true) {
    Clock::time_point next;
    {
      std::lock_guard<std::mutex> cycle(cycle_mu_);
      if (stopping_.load()) break;
      handed_back_ = false;
      const bool due = Clock::now() >= next_cycle_ || shutdown_requested_.load() ||
                       (!negotiating_.load() && queue_.HasNew());
      if (due) {
        queue_.TakeNew(&incoming_);
        if (!RunCycle()) break;
      }
      next = next_cycle_;
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, next, [this] {
      return shutdown_requested_.load() || stopping_.load() || handed_back_.load() ||
             (!negotiating_.load() && queue_.HasNew());
    });
  }
  // No cycle runs from here on (stopping_ is set, under cycle_mu_, before any driver
  // could start another).
  {
    std::lock_guard<std::mutex> cycle(cycle_mu_);
    stopping_ = true;
  }
  Status stop = stop_;
  InFlight& in_flight = *in_flight_;
  if (!stop.ok() && !shutdown_requested_.load()) {
    // A peer's orderly exit is news only to a rank that still has work in flight.
    if (controller_->HasPending() || stop.code() != StatusCode::kPeerLost) {
      SHVD_LOG(kWarning, "engine") << "stopping: " << stop.message();
    } else {
      SHVD_LOG(kDebug, "engine") << "stopping: " << stop.message();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ =
        stop.ok() ? Status::NotInitialized("spark_hvd was shut down; call init() again") : stop;
    running_ = false;
  }
  // No enqueue gets past the running_ check from here on.
  queue_.FailAll(&completions_, failure_);
  // Device work in flight uses the communicators: finish or abort it first.
  if (stop.ok()) {
    in_flight.Drain(env::TimeoutS());
  } else {
    in_flight.AbortAll(failure_);
  }
  control_ = nullptr;
  // Peers learn that this rank leaves (and which ranks it lost) before its
  // connections close, so they do not count it as lost (liveness.h).
  if (liveness_) {
    const bool lost = stop.code() == StatusCode::kPeerLost || stop.code() == StatusCode::kTimeout;
    liveness_->Leave(lost ? stop.ranks() : std::vector<int32_t>{});
  }
  // After a failure, NCCL communicators are aborted, not destroyed: ncclCommDestroy
  // waits for the other local ranks, and one that failed, or aborted, never comes.
  if (!stop.ok() || !in_flight.failure().ok()) sets_.AbortAll();
  sets_.Clear();
  FinalizeBackends();
  liveness_.reset();
  timeline_.Stop();
  std::lock_guard<std::mutex> cycle(cycle_mu_);
  executor_.reset();
  in_flight_.reset();
}

bool Engine::RunCycle() {
  CountAllocations counted;  // on a Driving API thread too (common/alloc_count.h)
  cycles_.fetch_add(1, std::memory_order_relaxed);
  const auto start = Clock::now();
  const bool want_shutdown = shutdown_requested_.load();
  const CycleResult& cr = cr_;
  Status stop = Status::OK();
  try {
    controller_->Cycle(control_, &incoming_, want_shutdown, &cr_);
  } catch (const StatusError& e) {
    stop = e.status();
  } catch (const std::exception& e) {
    stop = Status::Internal(std::string("negotiation failed: ") + e.what());
  }
  if (stop.ok() && cr.shutdown) {
    if (!want_shutdown) {
      stop =
          Status::PeerLost("rank(s) " + JoinRanks(cr.shutdown_ranks) +
                               " shut down (called shutdown() or exited) while this "
                               "operation was pending on rank " +
                               std::to_string(rank_) + "; every rank must run the same collectives",
                           cr.shutdown_ranks);
    }
    // else our own shutdown(): ops after it are "not initialized"
    stop_ = stop;
    stopping_ = true;
    return false;
  }
  const bool api_thread = std::this_thread::get_id() != engine_thread_;
  for (const Response& r : cr.responses) {
    if (!stop.ok()) break;
    if (api_thread && RunsOnEngineThread(r)) {
      // TakeNewOffThread keeps these on the engine thread; reaching here is a bug.
      stop = Status::Internal(std::string("an API thread was about to run ") + OpTypeName(r.op) +
                              " on device " + std::to_string(r.device) +
                              ", which only the engine thread may run");
      break;
    }
    SHVD_LOG(kTrace, "engine") << "cycle response " << OpTypeName(r.op) << " "
                               << (r.tensors.empty() ? std::string("-") : r.tensors[0].name) << " x"
                               << r.tensors.size() << " error=" << static_cast<int>(r.error);
    try {
      if (r.op == kAddProcessSet || r.op == kRemoveProcessSet) {
        ChangeProcessSets(r);
        continue;
      }
      Status s = executor_->Execute(r);
      if (!s.ok()) {
        // An op that found its communicator aborted fails for the reason the InFlight
        // thread aborted it (a timeout, a peer's error): that is the reason to stop.
        const Status first = in_flight_->failure();
        stop = first.ok() ? s : first;
      }
    } catch (const StatusError& e) {
      stop = e.status();
    }
  }
  if (stop.ok()) stop = in_flight_->failure();  // a device op failed: its communicator is gone
  if (!stop.ok()) {
    stop_ = stop;
    stopping_ = true;
    return false;
  }
  // The next cycle: SPARK_HVD_CYCLE_TIME_MS (or autotune's: the same everywhere) after
  // this one while any rank has work; while every rank is idle the pause doubles up to
  // SPARK_HVD_IDLE_CYCLE_TIME_MS (1 ms cycles cost ~15% of a core per rank on loopback
  // with nothing to do). `idle` comes from exchanged data: all ranks back off together.
  // After a `quiet` cycle (global ops ran, nothing left pending) the next one is the
  // idle pause from now: each rank's next op starts a cycle at once, and a cycle at
  // cycle time while the callers take their results would find nothing (a blocking op
  // cost 2 cycles, now 1: at 64 ranks on tcp 23 ms became 16 ms on 2 cores).
  using Ms = std::chrono::duration<double, std::milli>;
  const Ms cycle(tuner_.cycle_time_ms());
  const Ms idle_cap = std::max(cycle, Ms(env::IdleCycleTimeMs()));
  cycle_wait_ = cr.idle ? std::min(cycle_wait_ * 2, idle_cap) : cr.quiet ? idle_cap : cycle;
  next_cycle_ =
      (cr.quiet ? Clock::now() : start) + std::chrono::duration_cast<Clock::duration>(cycle_wait_);
  negotiating_ = controller_->HasPending();
  return true;
}

bool Engine::RunsOnEngineThread(const Response& r) {
  if (EngineThreadOp(r.op)) return true;
  if (r.device == kCpuDevice || r.error != StatusCode::kOk) return false;  // an error: no work
  // Device work, unless this rank is outside the response's set (the executor skips it:
  // a set of other ranks' GPU op reaches every rank's response list).
  ProcessSet* set = sets_.Get(r.process_set);
  return set != nullptr && set->Contains(rank_);
}

bool Engine::Drive(const OpState& state) {
  // At most this many cycles on the caller's thread: the first usually finds the op
  // ready on every rank; when a peer has not submitted it yet, the next ones wait for
  // that peer's next cycle (its submit, or its engine's idle tick). After that the
  // engine thread paces the cycles again, so two ranks waiting for ops that do not
  // match (a stall) never run cycles back to back.
  constexpr int kCycles = 3;
  if (!any_thread_ || !running_.load() || shutdown_requested_.load()) return false;
  std::unique_lock<std::mutex> cycle(cycle_mu_, std::try_to_lock);
  if (!cycle.owns_lock()) return completions_.Done(state);
  bool done = completions_.Done(state);
  for (int i = 0; i < kCycles && !done; ++i) {
    if (stopping_.load() || shutdown_requested_.load() || !executor_) break;
    if (!queue_.TakeNewOffThread(&incoming_)) break;  // an op for the engine thread
    driven_cycles_.fetch_add(1, std::memory_order_relaxed);
    if (!RunCycle()) break;
    done = completions_.Done(state);
  }
  const bool hand_back = stopping_.load() || negotiating_.load() || queue_.HasNew();
  cycle.unlock();
  if (hand_back) {
    // The engine thread takes over, at next_cycle_ (or stops: stopping_ is set).
    {
      std::lock_guard<std::mutex> lock(mu_);
      handed_back_ = true;
    }
    cv_.notify_one();
  }
  return done;
}

void Engine::FinalizeBackends() {
  // backends_ itself stays until the next Init: Validate reads it without a lock.
  for (Backend* b : backends_) b->Finalize();
}

void Engine::ChangeProcessSets(const Response& r) {
  std::vector<int32_t> ranks(r.extra.begin(), r.extra.end());
  auto e = queue_.Take(r.process_set, r.tensors[0].name);
  int64_t value = -1;
  if (r.op == kAddProcessSet) {
    int32_t id = sets_.NextId();
    sets_.Add(MakeProcessSet(id, ranks));
    value = id;
  } else if (!ranks.empty()) {
    sets_.Remove(ranks[0]);
    value = ranks[0];
  }
  if (e) {
    e->state->value = value;
    completions_.Complete(*e->state, Status::OK());
  }
}

Status Engine::Stopped() const {
  if (!failure_.ok()) return failure_;
  return Status::NotInitialized("spark_hvd is not initialized: call spark_hvd.init() first");
}

void Engine::Validate(Request& req) const {
  auto bad = [&](const std::string& m) {
    throw StatusError(
        Status::InvalidArgument(std::string(OpTypeName(req.op)) + " '" + req.name + "': " + m)
            .WithTensor(req.name));
  };
  if (req.op == OpType::kJoin || req.op == kAddProcessSet || req.op == kRemoveProcessSet) return;
  for (int64_t d : req.shape) {
    if (d < 0) bad("negative dimension in shape " + ShapeString(req.shape));
  }
  if (std::none_of(backends_.begin(), backends_.end(),
                   [&](Backend* b) { return b->Accepts(req.device, req.op, req.dtype); })) {
    bad("no backend of this job runs it on " + std::string(DataTypeName(req.dtype)) +
        " tensors of device " + std::to_string(req.device) +
        (req.device >= 0 ? " (GPU tensors run on NCCL, which has no int16 (cast it first), or "
                           "staged through host memory where NCCL does not load or "
                           "SPARK_HVD_GPU_OPERATIONS names a CPU backend; both need the CUDA "
                           "runtime: spark_hvd.cuda_built())"
                         : ""));
  }
  auto* self = const_cast<Engine*>(this);
  bool member = false;
  const size_t set_size = self->sets_.Membership(req.process_set, rank_, &member);
  if (set_size == 0) {
    bad("process set " + std::to_string(req.process_set) +
        " does not exist; create it with add_process_set() on every rank first");
  }
  if (!member) {
    bad("rank " + std::to_string(rank_) + " is not a member of process set " +
        std::to_string(req.process_set));
  }
  const bool is_reduction = req.op == OpType::kAllreduce || req.op == OpType::kReducescatter;
  if (is_reduction && req.dtype == DataType::kBool &&
      (req.reduce_op == ReduceOp::kAverage || req.prescale != 1.0 || req.postscale != 1.0)) {
    bad("Average and scale factors are not defined for bool tensors; use Sum (logical or), "
        "Min or Product (logical and) or Max");
  }
  if (is_reduction && req.reduce_op == ReduceOp::kAdasum) {
    // Horovod's rules for Adasum on CPU; host_adasum.h has the algorithm.
    const size_t n = set_size;
    if (req.op == OpType::kReducescatter) bad("reducescatter does not support op=Adasum");
    if (!AdasumDataType(req.dtype)) {
      bad("op=Adasum needs a floating-point tensor (float16, bfloat16, float32 or float64), "
          "got " +
          std::string(DataTypeName(req.dtype)));
    }
    if ((n & (n - 1)) != 0) {
      bad("op=Adasum needs a power-of-two number of ranks, as in Horovod; process set " +
          std::to_string(req.process_set) + " has " + std::to_string(n) +
          " ranks: run 1, 2, 4, 8, ... ranks, or reduce over a process set of such a size");
    }
    if (req.device != kCpuDevice) {
      bad("op=Adasum runs on host memory; GPU tensors go through spark_hvd.torch, which "
          "stages them through host memory (device " +
          std::to_string(req.device) + ")");
    }
  }
  if (req.op == OpType::kBroadcast &&
      (req.root < 0 || req.root >= static_cast<int32_t>(set_size))) {
    bad("root_rank " + std::to_string(req.root) + " is out of range for " +
        std::to_string(set_size) + " ranks");
  }
  if ((req.op == OpType::kAllgather || req.op == OpType::kAlltoall ||
       req.op == OpType::kReducescatter) &&
      req.shape.empty()) {
    bad("needs a tensor with at least one dimension (got a scalar)");
  }
  if (req.op == OpType::kAlltoall) {
    if (req.splits.empty() && !req.shape.empty()) {
      // No splits: the first dimension split evenly (every framework passes none for
      // Horovod's splits=None; this is the one place that checks and fills them).
      const auto n = static_cast<int64_t>(set_size);
      if (req.shape[0] % n != 0) {
        bad("without splits, the first dimension (" + std::to_string(req.shape[0]) +
            ") must divide evenly by the number of ranks (" + std::to_string(n) +
            "); pass splits=");
      }
      req.splits.assign(set_size, req.shape[0] / n);
    }
    if (req.splits.size() != set_size) {
      bad("splits has " + std::to_string(req.splits.size()) + " entries; it needs one per rank (" +
          std::to_string(set_size) + ")");
    }
    int64_t sum = 0;
    for (int64_t s : req.splits) {
      if (s < 0) bad("splits must not be negative");
      sum += s;
    }
    // Horovod's rule: the splits may cover fewer rows than the tensor has (the rest are
    // not sent), never more.
    if (sum > req.shape[0]) {
      bad("splits add up to " + std::to_string(sum) + ", more rows than the first dimension (" +
          std::to_string(req.shape[0]) + "); give splits whose sum is at most it");
    }
  }
}

std::vector<std::shared_ptr<OpState>> Engine::Enqueue(std::vector<TensorEntry> entries, bool wake) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!running_.load() || shutdown_requested_.load()) throw StatusError(Stopped());
  }
  std::vector<std::shared_ptr<OpState>> states;
  const int64_t now = NowMicros();
  for (auto& e : entries) {
    e.req.rank = rank_;
    Validate(e.req);
    if (!e.state) e.state = op_states_.New();  // the C API brings its own
    e.enqueue_us = now;
    states.push_back(e.state);
  }
  CheckGroupsWhole(entries);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!running_.load() || shutdown_requested_.load()) throw StatusError(Stopped());
    queue_.Add(std::move(entries));
  }
  // A caller that Drives wakes the engine thread itself if it cannot run the cycle.
  if ((wake || !any_thread_) && !negotiating_.load()) cv_.notify_one();
  return states;
}

void Engine::Shutdown() {
  if (frozen_.joinable()) {  // SimulateStop(false), tests only
    {
      std::lock_guard<std::mutex> lock(thaw_mu_);
      thaw_ = true;
    }
    thaw_cv_.notify_all();
    frozen_.join();
    thaw_ = false;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  running_ = false;
  {
    // Whatever stopped the engine before, after our own shutdown() the answer is
    // "not initialized".
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = Status::NotInitialized("spark_hvd was shut down; call spark_hvd.init() again");
  }
  timeline_.Stop();
  options_.store.reset();  // may hold a Python object: drop it while the interpreter is alive
}

void Engine::SimulateStop(bool crash) {
  if (!crash) {
    if (frozen_.joinable()) return;
    std::promise<void> held;
    std::future<void> frozen = held.get_future();
    frozen_ = std::thread([this, &held] {
      std::unique_lock<std::mutex> cycle(cycle_mu_);  // no cycle runs until the thaw
      if (auto* beats = dynamic_cast<Heartbeats*>(liveness_.get())) beats->SimulateStop(false);
      held.set_value();
      std::unique_lock<std::mutex> lock(thaw_mu_);
      thaw_cv_.wait(lock, [this] { return thaw_; });
    });
    frozen.wait();
    return;
  }
  {
    std::lock_guard<std::mutex> cycle(cycle_mu_);  // no cycle runs from here on
    if (!running_.load() || stopping_.load()) return;
    if (auto* beats = dynamic_cast<Heartbeats*>(liveness_.get())) beats->SimulateStop(true);
    stop_ = Status::Internal("rank " + std::to_string(rank_) +
                             " crashed (Engine::SimulateStop, a test's simulated death)");
    stopping_ = true;  // the loop ends without a cycle; Leave does nothing now
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
  }  // the loop is in its wait or sees stopping_
  cv_.notify_all();
}

bool Engine::StartTimeline(const std::string& path) { return timeline_.Start(path, rank_); }

void Engine::StopTimeline() { timeline_.Stop(); }

}  // namespace spark_hvd
