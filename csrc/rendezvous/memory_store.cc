#include "rendezvous/memory_store.h"

#include <chrono>
#include <sstream>

#include "common/types.h"

namespace spark_hvd {

const char* StoreOpName(StoreOp op) {
  switch (op) {
    case StoreOp::kSet:
      return "SET";
    case StoreOp::kGet:
      return "GET";
    case StoreOp::kWait:
      return "WAIT";
    case StoreOp::kMultiGet:
      return "MGET";
    case StoreOp::kLostRanks:
      return "LOST";
    case StoreOp::kSetMultiGet:
      return "SETMGET";
  }
  return "?";
}

int64_t StoreRequests::total() const {
  int64_t n = 0;
  for (int64_t c : by_op) n += c;
  return n;
}

MemoryStore::MemoryStore() : data_(std::make_shared<Data>()) {}

MemoryStore::MemoryStore(std::shared_ptr<Data> data) : data_(std::move(data)) {}

std::shared_ptr<MemoryStore> MemoryStore::Client() const {
  return std::shared_ptr<MemoryStore>(new MemoryStore(data_));
}

StoreRequests MemoryStore::Requests() const {
  StoreRequests r;
  for (size_t i = 0; i < r.by_op.size(); ++i) r.by_op[i] = requests_[i].load();
  return r;
}

void MemoryStore::Set(const std::string& key, const std::string& value) {
  Count(StoreOp::kSet);
  std::lock_guard<std::mutex> lock(data_->mu);
  Put(key, value);
}

void MemoryStore::Put(const std::string& key, const std::string& value) {
  const bool is_new = data_->values.count(key) == 0;
  data_->values[key] = value;
  if (!is_new) return;
  auto it = data_->waiters.find(key);
  if (it == data_->waiters.end()) return;
  for (Waiter* w : it->second) {
    if (--w->missing == 0) w->cv.notify_one();  // only a request whose keys are all there
  }
  data_->waiters.erase(it);
}

void MemoryStore::Await(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                        double timeout_s, bool watch) {
  Data& d = *data_;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
  Waiter w;
  w.watch = watch;
  for (const auto& k : keys) {
    if (d.values.count(k) == 0 && d.waiters[k].insert(&w).second) ++w.missing;
  }
  if (watch) d.watchers.insert(&w);
  auto lost = [&] { return watch && !d.lost.empty(); };
  w.cv.wait_until(lock, deadline, [&] { return w.missing == 0 || lost(); });
  for (const auto& k : keys) {  // off the keys still missing
    auto it = d.waiters.find(k);
    if (it == d.waiters.end()) continue;
    it->second.erase(&w);
    if (it->second.empty()) d.waiters.erase(it);
  }
  d.watchers.erase(&w);
  if (w.missing == 0) return;
  std::string missing;
  int shown = 0;
  for (const auto& k : keys) {
    if (d.values.count(k) != 0) continue;
    if (++shown > 8) {
      missing += ", ...";
      break;
    }
    missing += (missing.empty() ? "'" : ", '") + k + "'";
  }
  if (lost()) {
    std::vector<int32_t> ranks(d.lost.begin(), d.lost.end());
    throw StatusError(Status::PeerLost("rank" + std::string(ranks.size() > 1 ? "s " : " ") +
                                           JoinRanks(ranks) +
                                           " lost while waiting for rendezvous keys " + missing,
                                       ranks));
  }
  std::ostringstream after;
  after << timeout_s;
  throw StatusError(Status::Timeout("timed out after " + after.str() +
                                    " s waiting for rendezvous keys " + missing));
}

std::string MemoryStore::Get(const std::string& key, double timeout_s) {
  Count(StoreOp::kGet);
  std::unique_lock<std::mutex> lock(data_->mu);
  Await(lock, {key}, timeout_s, false);
  return data_->values[key];
}

void MemoryStore::Wait(const std::vector<std::string>& keys, double timeout_s) {
  Count(StoreOp::kWait);
  std::unique_lock<std::mutex> lock(data_->mu);
  Await(lock, keys, timeout_s, false);
}

std::vector<std::string> MemoryStore::MultiGet(const std::vector<std::string>& keys,
                                               double timeout_s, bool fail_on_lost) {
  Count(StoreOp::kMultiGet);
  std::unique_lock<std::mutex> lock(data_->mu);
  return Values(lock, keys, timeout_s, fail_on_lost);
}

std::vector<std::string> MemoryStore::SetAndMultiGetRequest(const std::string& key,
                                                            const std::string& value,
                                                            const std::vector<std::string>& keys,
                                                            double timeout_s, bool fail_on_lost) {
  Count(StoreOp::kSetMultiGet);
  std::unique_lock<std::mutex> lock(data_->mu);
  Put(key, value);
  return Values(lock, keys, timeout_s, fail_on_lost);
}

std::vector<std::string> MemoryStore::Values(std::unique_lock<std::mutex>& lock,
                                             const std::vector<std::string>& keys, double timeout_s,
                                             bool watch) {
  Await(lock, keys, timeout_s, watch);
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(data_->values[k]);
  return out;
}

std::vector<int> MemoryStore::LostRanks() {
  Count(StoreOp::kLostRanks);
  std::lock_guard<std::mutex> lock(data_->mu);
  return std::vector<int>(data_->lost.begin(), data_->lost.end());
}

void MemoryStore::MarkLost(int rank) {
  std::lock_guard<std::mutex> lock(data_->mu);
  if (!data_->lost.insert(rank).second) return;
  for (Waiter* w : data_->watchers) w->cv.notify_one();
}

}  // namespace spark_hvd
