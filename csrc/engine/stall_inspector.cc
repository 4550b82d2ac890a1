#include "engine/stall_inspector.h"

#include <algorithm>
#include <string>

#include "common/env.h"
#include "common/logging.h"
#include "engine/timeline.h"

namespace spark_hvd {

int64_t StallInspector::Cutoff(const MessageTable& table, ResponseCache& cache) const {
  const double shutdown_s = env::StallShutdownTimeS();
  if (rank_ != 0 || shutdown_s <= 0) return -1;
  const int64_t limit_us = NowMicros() - static_cast<int64_t>(shutdown_s * 1e6);
  int64_t cutoff = -1;
  for (const auto& kv : table) {
    if (kv.second.first_us <= limit_us) cutoff = std::max(cutoff, kv.second.first_cycle);
  }
  for (int64_t s = 0; s < cache.capacity(); ++s) {
    const CacheSlot& cs = cache.slot(s);
    if (cs.valid && cs.first_bit_cycle >= 0 && cs.first_bit_us <= limit_us) {
      cutoff = std::max(cutoff, cs.first_bit_cycle);
    }
  }
  return cutoff;
}

bool StallInspector::WantsRecords(const ResponseCache& cache) const {
  const double check_s = env::StallCheckTimeS();
  if (rank_ != 0 || check_s <= 0) return false;
  const int64_t now = NowMicros();
  for (int64_t s = 0; s < cache.capacity(); ++s) {
    const CacheSlot& cs = cache.slot(s);
    if (cs.valid && cs.first_bit_cycle >= 0 && !cs.reported &&
        now - cs.first_bit_us > check_s * 1e6) {
      return true;
    }
  }
  return false;
}

void StallInspector::Report(const Request& first, int32_t process_set,
                            const std::vector<int32_t>& got, const std::vector<int32_t>& missing,
                            int64_t since_us, bool warn, bool expire, ResponseList* out) const {
  const std::string text = "tensor '" + first.name + "' (" + OpTypeName(first.op) +
                           ", process set " + std::to_string(process_set) +
                           ") was submitted by ranks " + RankList(got) + " but not yet by ranks " +
                           RankList(missing);
  if (warn) {
    SHVD_LOG(kWarning, "stall")
        << text << " after " << (NowMicros() - since_us) / 1000000
        << " s. A rank may have skipped this op, called it under another name, or be stuck. "
           "(SPARK_HVD_STALL_CHECK_TIME_S sets this warning's delay; "
           "SPARK_HVD_STALL_SHUTDOWN_TIME_S turns stalls into errors.)";
  }
  if (expire) {
    Response r;
    r.op = first.op;
    r.process_set = process_set;
    r.tensors.push_back({first.name, first.shape, {}});
    r.error = StatusCode::kTimeout;
    r.error_ranks = missing;
    r.error_message = text + " after SPARK_HVD_STALL_SHUTDOWN_TIME_S=" +
                      std::to_string(env::StallShutdownTimeS()) + " s";
    out->push_back(std::move(r));
  }
}

void StallInspector::Inspect(int64_t cutoff, const CycleRecords& records,
                             const std::vector<bool>& joined, MessageTable* table,
                             ResponseCache* cache, ResponseList* out) {
  const double check_s = env::StallCheckTimeS();
  const int64_t now = NowMicros();
  auto overdue = [&](bool reported, int64_t since_us) {
    return check_s > 0 && rank_ == 0 && !reported && now - since_us > check_s * 1e6;
  };
  // Members of `set_id` that have (has(m)) or have not submitted, joined ranks aside.
  auto split = [&](int32_t set_id, auto has, std::vector<int32_t>* got,
                   std::vector<int32_t>* missing) {
    ProcessSet* set = sets_->Get(set_id);
    if (set == nullptr) return;
    for (int32_t m : set->ranks) {
      if (has(m))
        got->push_back(m);
      else if (!joined[static_cast<size_t>(m)])
        missing->push_back(m);
    }
  };

  // Tensors submitted in full (the message table).
  for (auto it = table->begin(); it != table->end();) {
    TableEntry& te = it->second;
    const Request& first = te.requests.begin()->second;
    const bool warn = overdue(te.reported, te.first_us);
    const bool expire = cutoff >= 0 && te.first_cycle <= cutoff;
    if (!warn && !expire) {
      ++it;
      continue;
    }
    std::vector<int32_t> got, missing;
    split(first.process_set, [&](int32_t m) { return te.requests.count(m) > 0; }, &got, &missing);
    te.reported = te.reported || warn;
    Report(first, first.process_set, got, missing, te.first_us, warn, expire, out);
    if (expire) {
      const Request* grouped = GroupedRequest(te);
      out->back().group = grouped != nullptr ? grouped->group : "";
    }
    it = expire ? table->erase(it) : std::next(it);
  }
  // Cached tensors: some ranks set the bit, others did not yet. Which ones only every
  // rank's record tells.
  if (!records.full) return;
  for (int64_t slot = 0; slot < cache->capacity(); ++slot) {
    CacheSlot& cs = cache->slot(slot);
    if (!cs.valid || cs.first_bit_cycle < 0) continue;
    const bool warn = overdue(cs.reported, cs.first_bit_us);
    const bool expire = cutoff >= 0 && cs.first_bit_cycle <= cutoff;
    if (!warn && !expire) continue;
    std::vector<int32_t> got, missing;
    split(cs.process_set, [&](int32_t m) { return records.Bit(m, slot); }, &got, &missing);
    cs.reported = cs.reported || warn;
    Report(cs.first, cs.process_set, got, missing, cs.first_bit_us, warn, expire, out);
    if (expire) cs.first_bit_cycle = -1;
  }
}

}  // namespace spark_hvd
