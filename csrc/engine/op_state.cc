#include "engine/op_state.h"

#include <chrono>

namespace spark_hvd {

int64_t HandleTable::Add(std::shared_ptr<OpState> state) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t h = next_++;
  states_[h] = std::move(state);
  return h;
}

std::shared_ptr<OpState> HandleTable::Get(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = states_.find(handle);
  return it == states_.end() ? nullptr : it->second;
}

void HandleTable::Complete(OpState& state, Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state.done) return;
    state.status = std::move(status);
    state.done = true;
  }
  cv_.notify_all();
}

bool HandleTable::Poll(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = states_.find(handle);
  return it == states_.end() || it->second->done;
}

bool HandleTable::Wait(int64_t handle, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = states_.find(handle);
  if (it == states_.end()) return true;
  auto state = it->second;
  auto pred = [&] { return state->done; };
  if (timeout_s < 0) {
    cv_.wait(lock, pred);
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), pred);
}

void HandleTable::Release(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  states_.erase(handle);
}

}  // namespace spark_hvd
