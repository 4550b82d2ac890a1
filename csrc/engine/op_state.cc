#include "engine/op_state.h"

#include <chrono>

namespace spark_hvd {

void Completions::Complete(OpState& state, Status status) {
  std::function<void()> on_done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state.done) return;
    state.status = std::move(status);
    state.done = true;
    on_done.swap(state.on_done);
  }
  cv_.notify_all();
  if (on_done) on_done();
}

void Completions::Complete(std::shared_ptr<OpState> state, Status status) {
  std::function<void()> on_done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!state->done) {
      state->status = std::move(status);
      state->done = true;
      on_done.swap(state->on_done);
    }
    state.reset();  // before any waiter runs (see op_state.h)
  }
  cv_.notify_all();
  if (on_done) on_done();
}

bool Completions::Done(const OpState& state) {
  std::lock_guard<std::mutex> lock(mu_);
  return state.done;
}

bool Completions::Wait(const OpState& state, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto pred = [&] { return state.done; };
  if (timeout_s < 0) {
    cv_.wait(lock, pred);
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), pred);
}

}  // namespace spark_hvd
