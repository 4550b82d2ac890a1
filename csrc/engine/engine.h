// Engine: the one object behind spark_hvd's API (no process-wide mutable state
// besides the single instance of instance.h). Owns the background thread
// that connects the communicators, negotiates (Controller) and executes
// (Executor) every cycle; API threads only enqueue and wait.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/registry.h"
#include "engine/autotune.h"
#include "engine/controller.h"
#include "engine/executor.h"
#include "engine/in_flight.h"
#include "engine/op_state.h"
#include "engine/process_set.h"
#include "engine/tensor_queue.h"
#include "engine/timeline.h"
#include "rendezvous/store.h"

namespace spark_hvd {

struct EngineOptions {
  int32_t rank = 0;
  int32_t size = 1;
  std::string controller = "gloo";  // "gloo" (rendezvous store) or "mpi" (mpirun)
  std::shared_ptr<Store> store;     // the rendezvous store (needed by "gloo" with size > 1)
  std::string store_prefix = "spark_hvd";
  std::string bind_host = "127.0.0.1";  // the address peers reach this rank at
  std::string host;  // this rank's host identity ("" = the host name), BackendOptions::host
  double connect_timeout_s = 60.0;
  std::string timeline_path;
};

class Engine {
 public:
  Engine();  // registers the built-in backends
  ~Engine();

  // Connects and starts the background thread; returns once connected or throws.
  void Init(const EngineOptions& options);
  // Tells peers, fails what is still pending, joins the thread. Idempotent.
  void Shutdown();

  bool initialized() const { return running_.load(); }
  int32_t rank() const { return rank_; }
  int32_t size() const { return size_; }
  const std::string& controller_name() const { return controller_name_; }

  // Validates and queues ops: all of them or, when any is invalid, none (a group
  // is never left half submitted). Each entry gives req, input, output and the
  // owner of the buffers (held until the engine is done with the op), and may bring
  // its state (with on_done set) or leave it to the engine. Returns
  // the ops' states, in order. Throws StatusError on bad input, a name already in
  // flight, before init, or after the engine stopped (with the reason).
  // `wake` false: the caller waits for these ops at once and will run the cycle itself
  // (Drive), so the engine thread is not woken for them.
  std::vector<std::shared_ptr<OpState>> Enqueue(std::vector<TensorEntry> entries, bool wake = true);
  // Called by a thread about to wait for `state`: when the engine thread is not in a
  // cycle and every backend of the job may be called from any thread (tcp, shm), runs the
  // next cycles on this thread (negotiation and execution: the same cycles, in the same
  // lockstep with the peers, as the engine thread's) until the op is done or a few cycles
  // passed, then hands back to the engine thread. Saves the engine thread's wake-up and
  // the caller's at each end of a small blocking op. Returns whether the op is done.
  bool Drive(const OpState& state);
  Completions& completions() { return completions_; }
  // An op's state from the engine's free list (the C API's, which sets on_done).
  std::shared_ptr<OpState> NewOpState() { return op_states_.New(); }
  // Heap allocations of op states, queue entries and queue nodes since the process
  // started: flat over the steps of a job in steady state (tests read it).
  int64_t OpAllocations() const { return op_states_.made() + queue_.made(); }
  // Cycles run by API threads (Drive) since the process started.
  int64_t DrivenCycles() const { return driven_cycles_.load(); }
  // Negotiation cycles run since the process started, on any thread.
  int64_t Cycles() const { return cycles_.load(); }
  std::vector<int32_t> ProcessSetRanks(int32_t id) { return sets_.Ranks(id); }
  std::vector<int32_t> ProcessSetIds() { return sets_.Ids(); }

  // Backends, in priority order; a test or plugin may add one before Init.
  BackendRegistry& registry() { return registry_; }

  // The fusion threshold and cycle time in force, and autotune's switches (autotune.h).
  TuneState Tuned() const { return tuner_.Snapshot(); }
  // The response cache's hits and misses of this rank's requests since init.
  const CacheStats& cache_stats() const { return cache_stats_; }

  bool StartTimeline(const std::string& path);
  void StopTimeline();

  // Test only (the in-process simulator, python/simulate.h), between two cycles: this
  // rank stops as its process would if killed (crash: its heartbeats stop and close
  // without a goodbye, its engine thread ends at once, failing its ops here and closing
  // the communicators' sockets, telling no peer) or stopped by SIGSTOP (its heartbeats
  // and its engine go silent, every socket left open, until Shutdown, which thaws it
  // first).
  void SimulateStop(bool crash);

 private:
  void Loop(std::promise<Status>* ready);
  // Would executing `r` on this rank do work only the engine thread may do (device work
  // of a set it belongs to, a join, a process-set change)?
  bool RunsOnEngineThread(const Response& r);
  // One cycle over the new requests in incoming_: negotiation, execution. Holds cycle_mu_.
  // Returns false when the engine must stop (then stop_ says why and stopping_ is set).
  bool RunCycle();
  void Connect();
  std::unique_ptr<ProcessSet> MakeProcessSet(int32_t id, std::vector<int32_t> ranks);
  void ChangeProcessSets(const Response& r);
  void FinalizeBackends();  // after every communicator is gone
  // Refuses an invalid request (InvalidArgument naming the tensor) and completes what a
  // request may leave to the engine: alltoall's splits, even when none are given.
  void Validate(Request& req) const;
  Status Stopped() const;

  EngineOptions options_;
  int32_t rank_ = 0;
  int32_t size_ = 1;
  std::string controller_name_;
  std::atomic<bool> running_{false};
  std::atomic<bool> shutdown_requested_{false};
  // This rank has tensors in negotiation: an enqueue then waits for the next
  // cycle (batching with others) instead of starting one at once.
  std::atomic<bool> negotiating_{false};
  // Every backend of this job that runs CPU ops is AnyThread: API threads may Drive.
  bool any_thread_ = false;

  // Whoever runs a cycle (the engine thread or a Driving API thread) holds cycle_mu_;
  // what a cycle uses is guarded by it.
  std::mutex cycle_mu_;
  std::unique_ptr<InFlight> in_flight_;
  std::unique_ptr<Executor> executor_;
  Status stop_;                        // why the loop ends (OK: our own shutdown)
  std::atomic<bool> stopping_{false};  // a cycle ended the job: no more cycles
  using Clock = std::chrono::steady_clock;
  Clock::time_point next_cycle_;                               // when the next cycle is due
  std::chrono::duration<double, std::milli> cycle_wait_{1.0};  // the pause before it
  std::atomic<bool> handed_back_{false};  // a Drive left work for the engine thread
  std::thread::id engine_thread_;         // the loop's thread
  std::atomic<int64_t> driven_cycles_{0};
  std::atomic<int64_t> cycles_{0};
  // A cycle's new requests and result, kept from cycle to cycle (under cycle_mu_): no
  // allocation per cycle.
  std::vector<Request> incoming_;
  CycleResult cr_;

  Completions completions_;
  TensorQueue queue_;
  OpStates op_states_;
  BackendRegistry registry_;
  std::vector<Backend*> backends_;  // the ones this job uses, in priority order
  ProcessSetTable sets_;
  Timeline timeline_;
  Autotuner tuner_;
  CacheStats cache_stats_;
  Communicator* control_ = nullptr;  // the control plane: the global set's, of the first
                                     // backend that can carry it (CarriesControl)
  // The job's heartbeats (net/liveness.h): started before the communicators,
  // left before they are destroyed.
  std::unique_ptr<PeerLiveness> liveness_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  Status failure_;  // why the engine stopped, once it has
  std::thread thread_;
  std::unique_ptr<Controller> controller_;

  // SimulateStop(false): a thread of its own holds cycle_mu_ until Shutdown thaws it.
  std::thread frozen_;
  std::mutex thaw_mu_;
  std::condition_variable thaw_cv_;
  bool thaw_ = false;
};

}  // namespace spark_hvd
