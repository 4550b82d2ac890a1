#include "engine/tensor_queue.h"

#include <set>

namespace spark_hvd {

void TensorQueue::Add(std::vector<TensorEntry> entries) {
  std::lock_guard<std::mutex> lock(mu_);
  std::set<std::string> keys;
  bool join = false;
  for (const auto& e : entries) {
    auto where = [&e] {  // built for an error only: no allocation per op
      return "on rank " + std::to_string(e.req.rank) + " in process set " +
             std::to_string(e.req.process_set);
    };
    if (e.req.op == OpType::kJoin) {
      if (join_ || join) {
        throw StatusError(Status::InvalidArgument("join() is already pending " + where()));
      }
      join = true;
      continue;
    }
    const std::string key = TensorKey(e.req);
    if (entries_.count(key) || !keys.insert(key).second) {
      throw StatusError(Status::InvalidArgument(
          "a tensor named '" + e.req.name + "' is already in flight " + where() +
          "; names of concurrent operations must be unique (omit name= to get a generated "
          "one, or synchronize the first operation before reusing its name)"));
    }
  }
  for (auto& e : entries) {
    new_.push_back(e.req);
    auto owned = std::make_unique<TensorEntry>(std::move(e));
    if (owned->req.op == OpType::kJoin) {
      join_ = std::move(owned);
    } else {
      const std::string key = TensorKey(owned->req);
      entries_[key] = std::move(owned);
    }
  }
  has_new_.store(!new_.empty(), std::memory_order_seq_cst);
}

std::vector<Request> TensorQueue::TakeNew() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Request> out;
  out.swap(new_);
  has_new_.store(false, std::memory_order_seq_cst);
  return out;
}

std::unique_ptr<TensorEntry> TensorQueue::Take(int32_t process_set, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(TensorKey(process_set, name));
  if (it == entries_.end()) return nullptr;
  auto e = std::move(it->second);
  entries_.erase(it);
  return e;
}

std::unique_ptr<TensorEntry> TensorQueue::TakeJoin() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::move(join_);
}

void TensorQueue::FailAll(Completions* completions, const Status& status) {
  std::map<std::string, std::unique_ptr<TensorEntry>> entries;
  std::unique_ptr<TensorEntry> join;
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries.swap(entries_);
    join = std::move(join_);
    new_.clear();
    has_new_.store(false, std::memory_order_seq_cst);
  }
  for (auto& kv : entries) {
    completions->Complete(*kv.second->state, status.WithTensor(kv.second->req.name));
  }
  if (join) completions->Complete(*join->state, status);
  // The entries (and the buffers their owners hold) are released here, outside the lock.
}

}  // namespace spark_hvd
