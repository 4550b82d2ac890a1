#include "python/simulate.h"

#include <dirent.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

#include "backends/registry.h"
#include "backends/tcp/mesh.h"
#include "common/traffic.h"
#include "engine/engine.h"

namespace spark_hvd {
namespace sim {
namespace {

using Clock = std::chrono::steady_clock;

double Between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Every rank's thread and the driver meet here between phases. Break() releases every
// waiter for good (a thread could not be started): Arrive then returns false.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  bool Arrive() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t generation = generation_;
    if (++count_ == n_) {
      count_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation || broken_; });
    }
    return !broken_;
  }
  void Break() {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = true;
    cv_.notify_all();
  }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int count_ = 0;
  int64_t generation_ = 0;
  bool broken_ = false;
};

struct Snapshot {
  Clock::time_point at;
  double cpu_s = 0;  // the process's, every thread's
  int64_t cycles = 0;
  int64_t counts[kTrafficKinds][2] = {};  // tcp and heartbeat senders together
  int64_t opened = 0, accepted = 0, failed = 0, dropped = 0;
};

Snapshot Take(const std::vector<std::unique_ptr<Engine>>& engines) {
  Snapshot s;
  s.at = Clock::now();
  rusage use{};
  ::getrusage(RUSAGE_SELF, &use);
  s.cpu_s = static_cast<double>(use.ru_utime.tv_sec + use.ru_stime.tv_sec) +
            static_cast<double>(use.ru_utime.tv_usec + use.ru_stime.tv_usec) * 1e-6;
  for (const auto& e : engines) s.cycles += e->Cycles();
  for (int k = 0; k < kTrafficKinds; ++k) {
    for (TrafficSender sender : {TrafficSender::kTcp, TrafficSender::kHeartbeat}) {
      const TrafficCount& c = Traffic(sender, static_cast<TrafficKind>(k));
      s.counts[k][0] += c.messages.load();
      s.counts[k][1] += c.bytes.load();
    }
  }
  const ConnectionCount& c = Connections();
  s.opened = c.opened.load();
  s.accepted = c.accepted.load();
  s.failed = c.failed.load();
  s.dropped = c.dropped.load();
  return s;
}

Counts Diff(const Snapshot& a, const Snapshot& b) {
  Counts c;
  c.seconds = Between(a.at, b.at);
  c.cpu_s = b.cpu_s - a.cpu_s;
  c.cycles = b.cycles - a.cycles;
  const int control = static_cast<int>(TrafficKind::kControl);
  const int data = static_cast<int>(TrafficKind::kData);
  const int liveness = static_cast<int>(TrafficKind::kLiveness);
  c.control_messages = b.counts[control][0] - a.counts[control][0];
  c.control_bytes = b.counts[control][1] - a.counts[control][1];
  c.data_messages = b.counts[data][0] - a.counts[data][0];
  c.data_bytes = b.counts[data][1] - a.counts[data][1];
  c.liveness_messages = b.counts[liveness][0] - a.counts[liveness][0];
  c.opened = b.opened - a.opened;
  c.accepted = b.accepted - a.accepted;
  c.failed = b.failed - a.failed;
  c.dropped = b.dropped - a.dropped;
  return c;
}

// What every rank's thread shares with the driver.
struct Job {
  Options o;
  Result* result;
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<std::shared_ptr<MemoryStore>> clients;
  std::vector<float> in, out;  // each rank's operand and result
  Barrier barrier;
  std::vector<Clock::time_point> init_called, init_returned, killed_op_end;
  bool go = false;  // every Init succeeded (set by the driver between phases)
  std::mutex mu;
  std::condition_variable submitted_cv;
  int submitted = 0;  // step 3: survivors whose op is queued
  Snapshot before_stop;
  Clock::time_point stopped{};  // step 3: when the killed rank stopped

  explicit Job(const Options& options, Result* r)
      : o(options),
        result(r),
        in(static_cast<size_t>(options.size)),
        out(static_cast<size_t>(options.size)),
        barrier(options.size + 1),
        init_called(static_cast<size_t>(options.size)),
        init_returned(static_cast<size_t>(options.size)),
        killed_op_end(static_cast<size_t>(options.size)) {}

  // Between two phases: every rank's thread and the driver arrive, the driver reads the
  // counters, then everyone goes on.
  void Boundary() {
    barrier.Arrive();
    barrier.Arrive();
  }
};

// One allreduce of rank r's 4-byte operand, as a user's blocking call runs it: enqueue
// without waking the engine thread, Drive, wait.
Status Allreduce(Job& run, int r, const char* name, double* seconds) {
  Engine& e = *run.engines[static_cast<size_t>(r)];
  std::vector<TensorEntry> entries(1);
  Request& q = entries[0].req;
  q.op = OpType::kAllreduce;
  q.name = name;
  q.dtype = DataType::kFloat32;
  q.shape = {1};
  entries[0].input = &run.in[static_cast<size_t>(r)];
  entries[0].output = &run.out[static_cast<size_t>(r)];
  // No owner: the buffers outlive every engine of the run.
  const auto start = Clock::now();
  std::shared_ptr<OpState> state;
  try {
    state = e.Enqueue(std::move(entries), /*wake=*/false)[0];
  } catch (const StatusError& x) {
    return x.status();
  }
  const bool done = e.Drive(*state) || e.completions().Wait(*state, run.o.timeout_s);
  if (seconds != nullptr) *seconds = Between(start, Clock::now());
  if (!done) {
    return Status::Timeout("rank " + std::to_string(r) + "'s allreduce '" + name +
                           "' did not complete within " + std::to_string(run.o.timeout_s) + " s");
  }
  return state->status;
}

Status Check(const Job& run, int r) {
  const double n = run.o.size;
  const float want = static_cast<float>(n * (n + 1) / 2);
  const float got = run.out[static_cast<size_t>(r)];
  if (got == want) return Status::OK();
  return Status::Internal("rank " + std::to_string(r) + "'s allreduce gave " + std::to_string(got) +
                          ", not " + std::to_string(want));
}

int64_t CountDir(const char* path, int64_t* sockets) {
  int64_t n = 0;
  DIR* d = ::opendir(path);
  if (d == nullptr) return -1;
  while (dirent* ent = ::readdir(d)) {
    if (ent->d_name[0] == '.') continue;
    ++n;
    if (sockets != nullptr) {
      char link[64];
      const std::string p = std::string(path) + "/" + ent->d_name;
      const ssize_t len = ::readlink(p.c_str(), link, sizeof(link) - 1);
      if (len > 7 && std::string(link, 7) == "socket:") ++*sockets;
    }
  }
  ::closedir(d);
  return n - (sockets != nullptr ? 1 : 0);  // the directory's own descriptor
}

// Step 3 on the killed rank's thread (its descriptor table: a crash closes its sockets),
// once every survivor's op is queued.
void Stop(Job& run, int r) {
  {
    std::unique_lock<std::mutex> lock(run.mu);
    run.submitted_cv.wait(lock, [&] { return run.submitted == run.o.size - 1; });
  }
  run.before_stop = Take(run.engines);
  run.stopped = Clock::now();
  run.engines[static_cast<size_t>(r)]->SimulateStop(!run.o.freeze);
  if (!run.o.freeze) run.clients[static_cast<size_t>(r)]->MarkLost(r);  // its connection drops
}

// Step 3 on a survivor: one more allreduce, which ends when it finds the killed rank.
void Survive(Job& run, int r) {
  const size_t i = static_cast<size_t>(r);
  Engine& e = *run.engines[i];
  Rank& me = run.result->ranks[i];
  std::vector<TensorEntry> entries(1);
  Request& q = entries[0].req;
  q.name = "sim.after_kill";
  q.shape = {1};
  entries[0].input = &run.in[i];
  entries[0].output = &run.out[i];
  std::shared_ptr<OpState> state;
  try {
    state = e.Enqueue(std::move(entries), /*wake=*/false)[0];
  } catch (const StatusError& x) {
    me.killed_op = x.status();
    run.killed_op_end[i] = Clock::now();
  }
  {
    std::lock_guard<std::mutex> lock(run.mu);
    ++run.submitted;
  }
  run.submitted_cv.notify_all();
  if (state) {
    const bool done = e.Drive(*state) || e.completions().Wait(*state, run.o.timeout_s);
    run.killed_op_end[i] = Clock::now();
    me.killed_op = done ? state->status : Status::Timeout("no error within the timeout");
  }
}

void RankThread(Job& run, int r) {
  const size_t i = static_cast<size_t>(r);
  Engine& e = *run.engines[i];
  Rank& me = run.result->ranks[i];
  // A descriptor table of its own, as a process has (the engine's threads, started from
  // this one, share it): RLIMIT_NOFILE bounds each rank rather than all of them, and
  // this rank's descriptors are counted apart.
  if (::unshare(CLONE_FILES) != 0) {
    me.init = Status::Internal("unshare(CLONE_FILES): " + std::string(std::strerror(errno)));
  }
  int64_t sockets0 = 0;
  const int64_t fds0 = CountDir("/proc/thread-self/fd", &sockets0);
  if (!run.barrier.Arrive()) return;  // every thread started
  // Step 1.
  EngineOptions eo;
  eo.rank = r;
  eo.size = run.o.size;
  eo.store = run.clients[i];
  eo.store_prefix = "sim";
  eo.bind_host = run.o.bind_host;
  eo.connect_timeout_s = run.o.timeout_s;
  run.init_called[i] = Clock::now();
  try {
    if (me.init.ok()) e.Init(eo);
  } catch (const StatusError& x) {
    me.init = x.status();
  }
  run.init_returned[i] = Clock::now();
  me.init_s = Between(run.init_called[i], run.init_returned[i]);
  me.init_requests = run.clients[i]->Requests();
  me.fds = CountDir("/proc/thread-self/fd", &me.sockets) - fds0;
  me.sockets -= sockets0;
  run.Boundary();
  // Step 2.
  run.in[i] = static_cast<float>(r + 1);
  for (int k = 0; run.go && me.ops.ok() && k < run.o.warmup; ++k) {
    me.ops = Allreduce(run, r, "sim.allreduce", nullptr);
    if (me.ops.ok()) me.ops = Check(run, r);
  }
  run.Boundary();
  me.op_s.reserve(static_cast<size_t>(run.o.ops));
  for (int k = 0; run.go && me.ops.ok() && k < run.o.ops; ++k) {
    double s = 0;
    me.ops = Allreduce(run, r, "sim.allreduce", &s);
    if (me.ops.ok()) me.ops = Check(run, r);
    me.op_s.push_back(s);
  }
  run.Boundary();
  // Step 3.
  if (run.go && run.o.kill == r) Stop(run, r);
  if (run.go && run.o.kill >= 0 && run.o.kill != r) Survive(run, r);
  run.Boundary();
  me.requests = run.clients[i]->Requests();
  // Step 4.
  e.Shutdown();
}

// What each rank's descriptor table (RankThread) holds after init: its end of its mesh
// connections (AlgorithmPeers) and of its two heartbeat connections, its two listeners,
// the heartbeats' two eventfds, and the copy of the process's own (`held`).
void EnsureDescriptors(int n, int64_t held) {
  size_t peers = 0;
  for (int r = 0; r < n; ++r) peers = std::max(peers, AlgorithmPeers(r, n).size());
  const int64_t need = static_cast<int64_t>(peers) + (n > 2 ? 2 : 1) + 2 + 2 + held + 8;
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_cur == RLIM_INFINITY || static_cast<int64_t>(lim.rlim_cur) >= need) return;
  if (lim.rlim_max != RLIM_INFINITY && static_cast<int64_t>(lim.rlim_max) < need) {
    throw StatusError(Status::InvalidArgument(
        "a simulated rank of " + std::to_string(n) + " needs about " + std::to_string(need) +
        " file descriptors (its connections, listeners and eventfds, and a copy of the " +
        std::to_string(held) + " this process holds), more than its hard limit of " +
        std::to_string(lim.rlim_max) + " (ulimit -Hn)"));
  }
  lim.rlim_cur = static_cast<rlim_t>(need);
  ::setrlimit(RLIMIT_NOFILE, &lim);
}

// What /proc says of this process (its first descriptor table, every thread).
Resources Measure() {
  Resources r;
  r.fds = CountDir("/proc/self/fd", &r.sockets);
  r.threads = CountDir("/proc/self/task", nullptr);
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    long size = 0, resident = 0;
    if (std::fscanf(f, "%ld %ld", &size, &resident) == 2) {
      r.rss_bytes = static_cast<int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
    }
    std::fclose(f);
  }
  return r;
}

}  // namespace

Result Run(const Options& options) {
  const int n = options.size;
  if (n < 2) throw StatusError(Status::InvalidArgument("simulate at least 2 ranks"));
  if (options.kill >= n) {
    throw StatusError(Status::InvalidArgument("kill=" + std::to_string(options.kill) +
                                              " is not a rank of " + std::to_string(n)));
  }
  if (CpuOperationsSetting() != "tcp") {
    throw StatusError(Status::InvalidArgument(
        "the simulator runs the tcp backend: set SPARK_HVD_CPU_OPERATIONS=tcp before the "
        "core first reads its settings (got '" +
        CpuOperationsSetting() + "')"));
  }
  Result result;
  result.options = options;
  result.ranks.resize(static_cast<size_t>(n));
  result.before = Measure();
  EnsureDescriptors(n, result.before.fds);
  Job run(options, &result);
  auto store = std::make_shared<MemoryStore>();
  for (int r = 0; r < n; ++r) {
    run.clients.push_back(store->Client());
    run.engines.push_back(std::make_unique<Engine>());
  }
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  try {
    for (int r = 0; r < n; ++r) threads.emplace_back(RankThread, std::ref(run), r);
  } catch (const std::system_error& e) {
    run.barrier.Break();
    for (auto& t : threads) t.join();
    throw StatusError(Status::InvalidArgument("could not start thread " +
                                              std::to_string(threads.size()) + " of " +
                                              std::to_string(n) + ": " + e.what()));
  }
  const Snapshot s0 = Take(run.engines);
  run.barrier.Arrive();  // every thread started: Init
  run.barrier.Arrive();  // after step 1
  const Snapshot s1 = Take(run.engines);
  result.after_init = Measure();
  result.init = Diff(s0, s1);
  Clock::time_point last_call = run.init_called[0], last_return = run.init_returned[0];
  run.go = true;
  for (int r = 0; r < n; ++r) {
    const Rank& x = result.ranks[static_cast<size_t>(r)];
    last_call = std::max(last_call, run.init_called[static_cast<size_t>(r)]);
    last_return = std::max(last_return, run.init_returned[static_cast<size_t>(r)]);
    if (!x.init.ok() && run.go) {
      run.go = false;
      result.error = "rank " + std::to_string(r) + "'s init failed: " + x.init.message();
    }
  }
  result.init_s = Between(last_call, last_return);
  run.barrier.Arrive();
  run.barrier.Arrive();  // the warm-up done
  const Snapshot s2 = Take(run.engines);
  run.barrier.Arrive();
  run.barrier.Arrive();  // the steady ops done
  const Snapshot s3 = Take(run.engines);
  result.steady = Diff(s2, s3);
  if (options.idle_s > 0) {  // every rank's thread waits at the barrier: the engines idle
    std::this_thread::sleep_for(std::chrono::duration<double>(options.idle_s));
    result.idle = Diff(s3, Take(run.engines));
  }
  for (int r = 0; r < n && result.error.empty(); ++r) {
    const Status& s = result.ranks[static_cast<size_t>(r)].ops;
    if (!s.ok()) result.error = "rank " + std::to_string(r) + "'s allreduce: " + s.message();
  }
  run.go = run.go && result.error.empty();
  run.barrier.Arrive();
  run.barrier.Arrive();  // step 3 done: the killed rank stopped, every survivor's op ended
  if (run.stopped != Clock::time_point{}) {
    result.killed = Diff(run.before_stop, Take(run.engines));
    for (int r = 0; r < n; ++r) {
      if (r == options.kill) continue;
      result.ranks[static_cast<size_t>(r)].named_after_s =
          Between(run.stopped, run.killed_op_end[static_cast<size_t>(r)]);
    }
  }
  const auto stop = Clock::now();
  run.barrier.Arrive();  // step 4
  for (auto& t : threads) t.join();
  result.shutdown_s = Between(stop, Clock::now());
  run.engines.clear();
  run.clients.clear();
  store.reset();
  // A joined thread's /proc entry can outlive the join by a moment (the kernel wakes the
  // joiner before it releases the task): counted once they are gone, or after a second.
  const auto settle = Clock::now() + std::chrono::seconds(1);
  result.after_shutdown = Measure();
  while (result.after_shutdown.threads > result.before.threads && Clock::now() < settle) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    result.after_shutdown = Measure();
  }
  return result;
}

}  // namespace sim
}  // namespace spark_hvd
