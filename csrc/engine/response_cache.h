// ResponseCache: tensors negotiated before get a slot; when a rank submits the
// same request again it sends one bit (its slot) instead of the request. Every
// rank updates its cache at the same point of the same cycle from the same
// exchanged data, so slot numbers agree everywhere without extra messages.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/message.h"

namespace spark_hvd {

// A cached tensor: what a hit needs, whatever the set's size (no per-member request kept:
// a hit copies `response`, checked once when every member's request was there).
struct CacheSlot {
  bool valid = false;
  int32_t process_set = 0;
  Request first;      // the lowest member's request: the tensor's name and op (stall reports)
  Request mine;       // this rank's, which its next submission must match (rank -1: none)
  Response response;  // with every member active
  int64_t first_bit_cycle = -1;  // first cycle any rank set this bit (stall inspection)
  int64_t first_bit_us = 0;
  bool reported = false;
};

// This rank's requests since init, counted as the controller files them (step 1):
// `hits` went as a cache bit, `misses` (cacheable ops only) in full. Written by the
// engine thread, read from any (`_core.cache_stats()`).
struct CacheStats {
  std::atomic<int64_t> hits{0};
  std::atomic<int64_t> misses{0};
  void Reset() { hits = 0, misses = 0; }
};

class ResponseCache {
 public:
  explicit ResponseCache(int64_t capacity) : slots_(static_cast<size_t>(capacity)) {}

  int64_t capacity() const { return static_cast<int64_t>(slots_.size()); }
  // Slot holding the tensor with this TensorKey, or -1.
  int64_t Find(const std::string& key) const;
  // Is `req` (from its rank) exactly what that rank submitted when `slot` was cached?
  bool Matches(int64_t slot, const Request& req) const;
  // Caches a negotiated tensor (every member's request, `rank`'s among them when it is a
  // member, and their checked response); returns its slot, or -1 when full.
  int64_t Put(const std::map<int32_t, Request>& requests, int32_t rank, const Response& response);
  void Erase(int64_t slot);
  CacheSlot& slot(int64_t i) { return slots_[static_cast<size_t>(i)]; }
  const CacheSlot& slot(int64_t i) const { return slots_[static_cast<size_t>(i)]; }

 private:
  std::vector<CacheSlot> slots_;
  std::unordered_map<std::string, int64_t> by_name_;  // by TensorKey
  int64_t next_free_hint_ = 0;
};

}  // namespace spark_hvd
