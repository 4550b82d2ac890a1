#include "engine/tensor_queue.h"

#include <algorithm>

namespace spark_hvd {
namespace {

// An op whose execution must stay on the engine thread (device work, process sets' new
// communicators, join).
bool ThreadBound(const Request& r) { return r.device != kCpuDevice || EngineThreadOp(r.op); }

}  // namespace

void ReleaseThenComplete(std::vector<EntryPtr>* entries, const Status& status,
                         Completions* completions, std::vector<std::shared_ptr<OpState>>* states) {
  states->clear();
  for (auto& e : *entries) {
    if (e) states->push_back(std::move(e->state));
  }
  entries->clear();  // the buffers may go now
  for (auto& state : *states) completions->Complete(std::move(state), status);
  states->clear();
}

void TensorQueue::Add(std::vector<TensorEntry> entries) {
  std::lock_guard<std::mutex> lock(mu_);
  auto where = [](const Request& r) {  // built for an error only: no allocation per op
    return "on rank " + std::to_string(r.rank) + " in process set " + std::to_string(r.process_set);
  };
  auto in_flight = [&](const Request& r) {
    return StatusError(Status::InvalidArgument(
        "a tensor named '" + r.name + "' is already in flight " + where(r) +
        "; names of concurrent operations must be unique (omit name= to get a generated "
        "one, or synchronize the first operation before reusing its name)"));
  };
  // 1. Refuse the whole submission before adding anything: a second join, a name already
  //    queued, or a name twice in this submission (sorted, then neighbours compared).
  bool join = false;
  seen_.clear();
  for (const auto& e : entries) {
    if (e.req.op == OpType::kJoin) {
      if (join_ || join) {
        throw StatusError(Status::InvalidArgument("join() is already pending " + where(e.req)));
      }
      join = true;
      continue;
    }
    if (entries_.count(KeyRef{e.req.process_set, e.req.name})) throw in_flight(e.req);
    seen_.push_back(&e.req);
  }
  if (seen_.size() > 1) {
    auto less = [](const Request* a, const Request* b) { return KeyLess()(*a, *b); };
    std::sort(seen_.begin(), seen_.end(), less);
    for (size_t i = 1; i < seen_.size(); ++i) {
      if (!less(seen_[i - 1], seen_[i])) throw in_flight(*seen_[i]);
    }
  }
  // 2. Add them, each in a node and an entry kept from an earlier op where there is one.
  for (auto& e : entries) {
    new_.push_back(e.req);
    if (ThreadBound(e.req)) ++thread_bound_;
    EntryPtr owned(new (entry_list_->Get(sizeof(TensorEntry))) TensorEntry(std::move(e)),
                   EntryRecycler(entry_list_));
    if (owned->req.op == OpType::kJoin) {
      join_ = std::move(owned);
      continue;
    }
    if (spare_.empty()) {
      nodes_made_.fetch_add(1, std::memory_order_relaxed);
      Key key{owned->req.process_set, owned->req.name};
      entries_.emplace(std::move(key), std::move(owned));
      continue;
    }
    Map::node_type node = std::move(spare_.back());
    spare_.pop_back();
    node.key().process_set = owned->req.process_set;
    node.key().name = owned->req.name;  // within the kept capacity for names as long
    node.mapped() = std::move(owned);
    entries_.insert(std::move(node));
  }
  has_new_.store(!new_.empty(), std::memory_order_seq_cst);
}

bool TensorQueue::TakeNewOffThread(std::vector<Request>* out) {
  out->clear();
  std::lock_guard<std::mutex> lock(mu_);
  if (thread_bound_ > 0) return false;
  out->swap(new_);  // new_ keeps out's old capacity
  has_new_.store(false, std::memory_order_seq_cst);
  return true;
}

void TensorQueue::TakeNew(std::vector<Request>* out) {
  out->clear();
  std::lock_guard<std::mutex> lock(mu_);
  out->swap(new_);
  has_new_.store(false, std::memory_order_seq_cst);
}

EntryPtr TensorQueue::Take(int32_t process_set, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(KeyRef{process_set, name});
  if (it == entries_.end()) return nullptr;
  Map::node_type node = entries_.extract(it);
  EntryPtr e = std::move(node.mapped());
  if (ThreadBound(e->req)) --thread_bound_;
  if (spare_.size() < kKeep) {
    if (spare_.capacity() == 0) spare_.reserve(kKeep);
    spare_.push_back(std::move(node));
  }
  return e;
}

EntryPtr TensorQueue::TakeJoin() {
  std::lock_guard<std::mutex> lock(mu_);
  if (join_) --thread_bound_;
  return std::move(join_);
}

void TensorQueue::FailAll(Completions* completions, const Status& status) {
  Map entries;
  EntryPtr join;
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries.swap(entries_);
    join = std::move(join_);
    new_.clear();
    has_new_.store(false, std::memory_order_seq_cst);
    thread_bound_ = 0;
  }
  for (auto& kv : entries) {
    completions->Complete(*kv.second->state, status.WithTensor(kv.second->req.name));
  }
  if (join) completions->Complete(*join->state, status);
  // The entries (and the buffers their owners hold) are released here, outside the lock.
}

}  // namespace spark_hvd
