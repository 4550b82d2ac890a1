// SpinUntil: a bounded busy wait, for the waits of a small op (a peer's round on shm,
// the engine's next request, the caller's completion), whose answer often comes within
// microseconds when the other side is on a core: a thread that sleeps on a futex pays a
// wake-up instead, which on a loaded machine is a wait for a time slice.
//
// It polls with the CPU's pause instruction and never yields: giving the core away
// (sched_yield) between polls was measured worse on the shared 2-core machine (load 8,
// 4 B allreduce: 150 us of yielding spins, median 395-1416 us per op, against 317-751 us
// with none), as the yielder waits behind every other runnable thread to come back. So
// every spin is short (tens of microseconds, bounded by its caller); beyond it the caller
// blocks, and a machine with more runnable threads than cores (4 ranks on 2 cores) loses
// at most that per wait.
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
