#include "engine/response_cache.h"

namespace spark_hvd {

int64_t ResponseCache::Find(const std::string& key) const {
  auto it = by_name_.find(key);
  return it == by_name_.end() ? -1 : it->second;
}

bool ResponseCache::Matches(int64_t slot, const Request& req) const {
  if (slot < 0 || slot >= capacity()) return false;
  const CacheSlot& s = slots_[static_cast<size_t>(slot)];
  if (!s.valid) return false;
  return s.mine.rank == req.rank && s.mine.Signature(req);
}

int64_t ResponseCache::Put(const std::map<int32_t, Request>& requests, int32_t rank,
                           const Response& response) {
  if (requests.empty() || slots_.empty()) return -1;
  const std::string name = TensorKey(requests.begin()->second);
  if (by_name_.count(name)) return -1;
  // Deterministic: lowest free slot at or after the hint, wrapping once.
  for (int64_t k = 0; k < capacity(); ++k) {
    int64_t i = (next_free_hint_ + k) % capacity();
    CacheSlot& s = slots_[static_cast<size_t>(i)];
    if (s.valid) continue;
    s.valid = true;
    s.process_set = requests.begin()->second.process_set;
    s.first = requests.begin()->second;
    auto mine = requests.find(rank);
    s.mine = mine != requests.end() ? mine->second : Request();
    if (mine == requests.end()) s.mine.rank = -1;
    s.response = response;
    s.first_bit_cycle = -1;
    by_name_[name] = i;
    next_free_hint_ = (i + 1) % capacity();
    return i;
  }
  return -1;
}

void ResponseCache::Erase(int64_t slot) {
  CacheSlot& s = slots_[static_cast<size_t>(slot)];
  if (!s.valid) return;
  by_name_.erase(TensorKey(s.first));
  s = CacheSlot();
}

}  // namespace spark_hvd
