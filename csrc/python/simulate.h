// The in-process simulator (issue #33): `size` ranks of one job as real engines in
// this process (Engine, Controller, the tcp mesh and its PeerLinks, heartbeats: the code
// users run), one thread per rank driving its engine as a user's blocking allreduce
// does (Enqueue, Engine::Drive, wait), meeting through a MemoryStore
// (rendezvous/memory_store.h) where processes would meet through the rendezvous service.
// So ranks beyond what this machine runs as processes are measured with exact counts.
// Only _core._simulate (bindings.cc) calls it.
//
// A run, each phase ended by a barrier of every rank's thread and this one:
//  1. Init on every rank's thread at once (Init is collective);
//  2. `warmup` cached 4-byte float32 allreduces per rank (the first one is a cache miss),
//     then `ops` more, each checked against n (n + 1) / 2; then, with idle_s, that long
//     with no op anywhere (cycles and heartbeats only);
//  3. with kill >= 0: every other rank submits one more allreduce, and once all have,
//     rank `kill` dies (Engine::SimulateStop: its sockets close without a goodbye, its
//     threads stop, the store marks it lost as the service would see its connection
//     drop) or, with freeze, stops as under SIGSTOP (its threads stop, its sockets stay
//     open); each survivor records the error its op ends with, whom it names and when;
//  4. Shutdown on every rank's thread, every thread joined.
// Traffic counters are process-wide (common/traffic.h): per-rank figures are totals over
// the phase divided by the rank count (exact totals, so exact means); cycles are each
// engine's own. Store requests are per rank (each rank has its own client).
//
// Each rank's thread has a descriptor table of its own (unshare(CLONE_FILES), shared with
// the engine threads it starts), as a process has: RLIMIT_NOFILE bounds each rank, not
// the whole job (both ends of every connection are in this process: 25,600 descriptors
// at 1,024 ranks), a crash closes that rank's sockets alone, and its descriptors are
// counted apart. What differs from real processes: one process and its cores for every
// rank, threads instead of processes, one address space, and the MemoryStore instead of
// the Python rendezvous service. SPARK_HVD_CPU_OPERATIONS must be tcp (the settings are
// the process's, read once).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "rendezvous/memory_store.h"

namespace spark_hvd {
namespace sim {

struct Options {
  int32_t size = 8;
  int32_t ops = 50;
  int32_t warmup = 3;
  int32_t kill = -1;      // the rank that dies in step 3 (-1: none)
  bool freeze = false;    // it stops (SIGSTOP) rather than dies
  double idle_s = 0;      // after step 2, every rank idle this long (Result::idle)
  double timeout_s = 60;  // Init's connect timeout, and each wait for an op
  std::string bind_host = "127.0.0.1";
};

// Process-wide counters over one phase (after minus before).
struct Counts {
  double seconds = 0;
  double cpu_s = 0;    // the process's CPU time (user + system), every thread's
  int64_t cycles = 0;  // summed over the engines
  int64_t control_messages = 0, control_bytes = 0;
  int64_t data_messages = 0, data_bytes = 0;
  int64_t liveness_messages = 0;
  int64_t opened = 0, accepted = 0, failed = 0, dropped = 0;  // connections
};

// What /proc says of this process.
struct Resources {
  int64_t fds = 0, sockets = 0, threads = 0, rss_bytes = 0;
};

struct Rank {
  double init_s = 0;             // its Init call to its return
  int64_t fds = 0, sockets = 0;  // in its descriptor table after init, beyond the copy
  Status init;                   // why its Init failed
  StoreRequests init_requests;
  StoreRequests requests;     // by the end of step 3
  std::vector<double> op_s;   // each op of step 2 after warm-up: submit to wait's return
  Status ops;                 // the first op of step 2 that failed or came out wrong
  Status killed_op;           // step 3, a survivor: how its op ended
  double named_after_s = -1;  // step 3: its op's end, seconds after the crash or freeze
};

struct Result {
  Options options;
  double init_s = 0;  // from the last Init call to the last Init's return
  Resources before, after_init, after_shutdown;  // the driver's table (and every thread)
  Counts init, steady;                           // steady: the `ops` allreduces
  Counts idle;                                   // idle_s with no op anywhere, after them
  Counts killed;  // step 3, from the crash (or freeze) to the last survivor's error
  double shutdown_s = 0;
  std::vector<Rank> ranks;
  std::string error;  // what went wrong, if anything ("" otherwise)
};

// Runs steps 1 to 4 (blocking; no Python). Throws StatusError(kInvalidArgument) before
// starting when the options cannot work here: CPU operations not on tcp, fewer than 2
// ranks, or more descriptors needed per rank than RLIMIT_NOFILE's hard limit (the soft
// one is raised to what a rank needs).
Result Run(const Options& options);

}  // namespace sim
}  // namespace spark_hvd
