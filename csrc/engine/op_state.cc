#include "engine/op_state.h"

#include <chrono>

namespace spark_hvd {

void Completions::Complete(OpState& state, Status status) {
  std::function<void()> on_done;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state.done) return;
    state.status = std::move(status);
    on_done.swap(state.on_done);
    state.done = true;
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
    if (!state->done) {
      state->status = std::move(status);
      on_done.swap(state->on_done);
    }
    state->done = true;
    state.reset();  // before any waiter runs (see op_state.h)
    wake = sleepers_ > 0;
  }
  if (wake) cv_.notify_all();
  if (on_done) on_done();
}

bool Completions::Done(const OpState& state) {
  std::lock_guard<std::mutex> lock(mu_);
  return state.done;
}

bool Completions::Wait(const OpState& state, double timeout_s) {
  auto pred = [&] { return state.done; };
  std::unique_lock<std::mutex> lock(mu_);
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
