#include "engine/op_state.h"

#include <algorithm>
#include <chrono>

#include "common/spin.h"

namespace spark_hvd {
namespace {

// How long a waiter spins before it blocks (common/spin.h).
constexpr double kWaitSpinUs = 20.0;

}  // namespace

void Completions::Complete(OpState& state, Status status) {
  std::function<void()> on_done;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state.done.load(std::memory_order_relaxed)) return;
    state.status = std::move(status);
    on_done.swap(state.on_done);
    state.done.store(true, std::memory_order_release);  // a spinner may read status now
    wake = sleepers_ > 0;
  }
  if (wake) cv_.notify_all();
  if (on_done) on_done();
}

void Completions::Complete(std::shared_ptr<OpState> state, Status status) {
  std::function<void()> on_done;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!state->done.load(std::memory_order_relaxed)) {
      state->status = std::move(status);
      on_done.swap(state->on_done);
    }
    state->done.store(true, std::memory_order_release);
    // Before any waiter runs (see op_state.h): one that saw done while spinning takes
    // mu_ before it returns, so it finds this reference gone.
    state.reset();
    wake = sleepers_ > 0;
  }
  if (wake) cv_.notify_all();
  if (on_done) on_done();
}

bool Completions::Done(const OpState& state) {
  std::lock_guard<std::mutex> lock(mu_);
  return state.done.load(std::memory_order_relaxed);
}

bool Completions::Wait(const OpState& state, double timeout_s) {
  auto pred = [&] { return state.done.load(std::memory_order_acquire); };
  const double spin_us = timeout_s < 0 ? kWaitSpinUs : std::min(kWaitSpinUs, timeout_s * 1e6);
  const bool spun = SpinUntil(pred, spin_us);
  std::unique_lock<std::mutex> lock(mu_);  // after a spin too: the completer is out
  if (spun) return true;
  ++sleepers_;
  bool done = true;
  if (timeout_s < 0) {
    cv_.wait(lock, pred);
  } else {
    done = cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), pred);
  }
  --sleepers_;
  return done;
}

}  // namespace spark_hvd
