// SpinUntil: a bounded busy wait, for shm's rounds (backends/shm/group.h), where a peer
// in step answers within microseconds: a thread that sleeps on a futex pays a wake-up
// instead, which on a loaded machine is a wait for a time slice.
//
// It polls with the CPU's pause instruction and never yields: giving the core away
// (sched_yield) between polls was measured worse on the shared 2-core machine (load 8,
// 4 B allreduce: 150 us of yielding spins, median 395-1416 us per op, against 317-751 us
// with none). Spinning is no help anywhere on such a machine: 20 us pause spins in the
// engine thread (polling for the next request) and in the caller (polling for its
// completion) made a 4 B allreduce slower too (2 ranks: 263 against 183 us; 4 ranks on 2
// cores: 2777-3093 against 1754-2154 us), as a spinner that is preempted mid-spin comes
// back later than a sleeper the kernel wakes. So the engine and the caller block at once,
// and every spin is short and bounded by its caller.
#pragma once

#include <chrono>
#include <cstdint>

namespace spark_hvd {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// True as soon as pred() is; false once `us` microseconds passed without it.
template <class Pred>
bool SpinUntil(Pred&& pred, double us) {
  if (pred()) return true;
  if (us <= 0) return false;
  using Clock = std::chrono::steady_clock;
  const auto end = Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(us * 1e3));
  while (true) {
    for (int i = 0; i < 64; ++i) CpuRelax();
    if (pred()) return true;
    if (Clock::now() >= end) return false;
  }
}

}  // namespace spark_hvd
