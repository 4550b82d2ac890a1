#include "engine/controller.h"

#include <algorithm>
#include <cstring>

#include "common/env.h"
#include "common/logging.h"
#include "common/traffic.h"
#include "engine/fusion.h"
#include "engine/groups.h"
#include "engine/timeline.h"

namespace spark_hvd {
namespace {

bool Cacheable(const Request& r) {
  return r.group.empty() &&
         (r.op == OpType::kAllreduce || r.op == OpType::kAllgather || r.op == OpType::kBroadcast ||
          r.op == OpType::kAlltoall || r.op == OpType::kReducescatter);
}

// The same shape after the first dimension (and the same rank)?
bool SameTail(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  return a.size() == b.size() && (a.empty() || std::equal(a.begin() + 1, a.end(), b.begin() + 1));
}

}  // namespace

bool CycleRecords::AnyFlagOrBit() const {
  if ((header.flags & (kFlagShutdown | kFlagJoined)) != 0) return true;
  const char* some = summary.data() + sizeof(CycleHeader) + bit_bytes;
  for (int64_t b = 0; b < bit_bytes; ++b) {
    if (some[b] != 0) return true;
  }
  return false;
}

namespace {

// Folds one rank's summary into another's (step 2): flags ORed, the header's numbers
// their maxima, the ready bits ANDed and the some-rank bits ORed. Commutative and
// associative, as AllreduceFixed needs.
void CombineSummaries(int64_t bit_bytes, char* acc, const char* other) {
  CycleHeader a, b;
  std::memcpy(&a, acc, sizeof(a));
  std::memcpy(&b, other, sizeof(b));
  a.flags |= b.flags;
  a.uncached_bytes = std::max(a.uncached_bytes, b.uncached_bytes);
  a.stall_cutoff = std::max(a.stall_cutoff, b.stall_cutoff);
  a.fusion_threshold_kib = std::max(a.fusion_threshold_kib, b.fusion_threshold_kib);
  a.cycle_time_us = std::max(a.cycle_time_us, b.cycle_time_us);
  std::memcpy(acc, &a, sizeof(a));
  char* every = acc + sizeof(CycleHeader);
  const char* every_b = other + sizeof(CycleHeader);
  for (int64_t i = 0; i < bit_bytes; ++i) every[i] &= every_b[i];
  char* some = every + bit_bytes;
  const char* some_b = every_b + bit_bytes;
  for (int64_t i = 0; i < bit_bytes; ++i) some[i] |= some_b[i];
}

}  // namespace

Controller::Controller(int32_t rank, int32_t size, ProcessSetTable* sets, Autotuner* tuner,
                       CacheStats* stats)
    : rank_(rank),
      size_(size),
      sets_(sets),
      tuner_(tuner),
      stats_(stats),
      cache_(env::CacheCapacity()),
      stalls_(rank, sets),
      joined_(static_cast<size_t>(size), false),
      join_cycle_(static_cast<size_t>(size), -1),
      cached_key_(static_cast<size_t>(cache_.capacity())) {
  spare_local_.reserve(kKeepNodes);
  key_.reserve(64);
}

void Controller::File(Request&& req) {
  if (req.op == OpType::kJoin) {
    join_pending_ = true;
    return;
  }
  AssignTensorKey(&key_, req.process_set, req.name);
  const bool cacheable = Cacheable(req);
  int64_t slot = cacheable ? cache_.Find(key_) : -1;
  if (slot >= 0 && cache_.Matches(slot, req)) {
    AssignKept(&cached_key_[static_cast<size_t>(slot)], key_);
    ++stats_->hits;
  } else {
    to_send_.push_back(key_);
    if (cacheable) ++stats_->misses;
  }
  auto it = local_.find(key_);
  if (it != local_.end()) {
    it->second = std::move(req);
  } else if (spare_local_.empty()) {
    std::string key;
    AssignKept(&key, key_);  // as roomy as a refilled one: later keys fit it
    local_.emplace(std::move(key), std::move(req));
  } else {  // a node of an answered request, refilled
    LocalMap::node_type node = std::move(spare_local_.back());
    spare_local_.pop_back();
    AssignKept(&node.key(), key_);
    node.mapped() = std::move(req);
    local_.insert(std::move(node));
  }
}

void Controller::Active(const ProcessSet& set, std::vector<int32_t>* out) const {
  out->clear();
  for (int32_t r : set.ranks) {
    if (!joined_[static_cast<size_t>(r)]) out->push_back(r);
  }
}

bool Controller::RefuseJoined(const ProcessSet& set, Response* r) const {
  if (r->active.size() == set.ranks.size()) return false;
  std::vector<int32_t> joined;
  for (int32_t m : set.ranks) {
    if (joined_[static_cast<size_t>(m)]) joined.push_back(m);
  }
  const std::string what = "tensor '" + r->tensors[0].name + "' (" + OpTypeName(r->op) + ")";
  // As Horovod: only allreduce (the joined ranks add zeros) and barrier go on.
  if (r->op != OpType::kAllreduce && r->op != OpType::kBarrier) {
    r->error = StatusCode::kInvalidArgument;
    r->error_message = what + " is not supported while ranks " + RankList(joined) +
                       " have joined (as in Horovod); only allreduce and barrier are";
    return true;
  }
  if (r->reduce_op == ReduceOp::kAdasum) {
    r->error = StatusCode::kInvalidArgument;
    r->error_message =
        what + ": Adasum is not supported while ranks " + RankList(joined) + " have joined";
    return true;
  }
  return false;
}

void Controller::Build(const std::map<int32_t, Request>& requests, const ProcessSet* set,
                       Response* out) const {
  const Request& first = requests.begin()->second;
  Response& r = *out;
  r.op = first.op;
  r.dtype = first.dtype;
  r.reduce_op = first.reduce_op;
  r.prescale = first.prescale;
  r.postscale = first.postscale;
  r.root = first.root;
  r.process_set = first.process_set;
  r.device = first.device;
  Active(*set, &r.active);
  r.extra.clear();
  r.error = StatusCode::kOk;
  r.error_message.clear();
  r.error_ranks.clear();
  r.group.clear();
  // The tensor goes in first: an error response must still name it, so every
  // rank fails its own entry instead of waiting for it forever.
  r.tensors.clear();
  ResponseTensor& t = r.tensors.Add();
  AssignKept(&t.name, first.name);  // within the kept capacities: no allocation
  t.shape = first.shape;
  t.rank_dims.clear();

  auto what = [&] { return "tensor '" + first.name + "' (" + OpTypeName(first.op) + ")"; };
  auto mismatch = [&](const std::string& field, const std::string& a, int32_t rb,
                      const std::string& b) {
    r.error = StatusCode::kMismatch;
    r.error_ranks = {first.rank, rb};
    r.error_message = what() + ": " + field + " differs between ranks: rank " +
                      std::to_string(first.rank) + " has " + a + ", rank " + std::to_string(rb) +
                      " has " + b + ". Every rank must submit the same " + field + " for a name.";
  };
  for (const auto& kv : requests) {
    const Request& q = kv.second;
    if (q.op != first.op) {
      mismatch("operation", OpTypeName(first.op), q.rank, OpTypeName(q.op));
    } else if (q.dtype != first.dtype) {
      mismatch("dtype", DataTypeName(first.dtype), q.rank, DataTypeName(q.dtype));
    } else if (q.reduce_op != first.reduce_op) {
      mismatch("reduce op", ReduceOpName(first.reduce_op), q.rank, ReduceOpName(q.reduce_op));
    } else if (q.prescale != first.prescale || q.postscale != first.postscale) {
      mismatch("prescale/postscale factors",
               std::to_string(first.prescale) + "/" + std::to_string(first.postscale), q.rank,
               std::to_string(q.prescale) + "/" + std::to_string(q.postscale));
    } else if ((q.device >= 0) != (first.device >= 0)) {  // each rank has its own GPU
      mismatch("device", first.device >= 0 ? "a GPU" : "the CPU", q.rank,
               q.device >= 0 ? "a GPU" : "the CPU");
    } else if (q.op == OpType::kBroadcast && q.root != first.root) {
      mismatch("root rank", std::to_string(first.root), q.rank, std::to_string(q.root));
    } else if ((q.op == OpType::kAllgather || q.op == OpType::kAlltoall) &&
               !SameTail(q.shape, first.shape)) {
      mismatch("shape after the first dimension", ShapeString(first.shape), q.rank,
               ShapeString(q.shape));
    } else if ((q.op == OpType::kAllreduce || q.op == OpType::kBroadcast ||
                q.op == OpType::kReducescatter) &&
               q.shape != first.shape) {
      mismatch("shape", ShapeString(first.shape), q.rank, ShapeString(q.shape));
    } else if ((q.op == kAddProcessSet || q.op == kRemoveProcessSet) && q.splits != first.splits) {
      std::vector<int32_t> a(first.splits.begin(), first.splits.end());
      std::vector<int32_t> b(q.splits.begin(), q.splits.end());
      mismatch("process set ranks", RankList(a), q.rank, RankList(b));
    } else if (q.group != first.group) {
      auto group = [](const std::string& g) {
        return g.empty() ? "no group" : "group '" + g + "'";
      };
      mismatch("group", group(first.group), q.rank, group(q.group));
    } else if (q.group_size != first.group_size) {
      mismatch("group size (tensors in group '" + first.group + "')",
               std::to_string(first.group_size), q.rank, std::to_string(q.group_size));
    }
    if (r.error != StatusCode::kOk) return;
  }

  if (RefuseJoined(*set, &r)) return;

  const size_t n = set->ranks.size();
  if (first.op == OpType::kAllgather) {
    t.rank_dims.assign(n, 0);
    for (const auto& kv : requests) {
      int32_t sr = set->SetRank(kv.first);
      if (sr >= 0 && !joined_[static_cast<size_t>(kv.first)]) {
        t.rank_dims[static_cast<size_t>(sr)] = kv.second.shape.empty() ? 1 : kv.second.shape[0];
      }
    }
  } else if (first.op == OpType::kAlltoall) {
    t.rank_dims.assign(n * n, 0);
    for (const auto& kv : requests) {
      int32_t sr = set->SetRank(kv.first);
      if (sr < 0) continue;
      if (kv.second.splits.size() != n) {
        r.error = StatusCode::kInvalidArgument;
        r.error_message = what() + ": rank " + std::to_string(kv.first) + " gave " +
                          std::to_string(kv.second.splits.size()) + " splits for " +
                          std::to_string(n) + " ranks";
        return;
      }
      for (size_t j = 0; j < n; ++j)
        t.rank_dims[static_cast<size_t>(sr) * n + j] = kv.second.splits[j];
    }
  } else if (first.op == kAddProcessSet || first.op == kRemoveProcessSet) {
    r.extra.assign(first.splits.begin(), first.splits.end());
  }
}

void Controller::Cycle(Communicator* control, std::vector<Request>* incoming, bool shutdown,
                       CycleResult* out) {
  ++cycle_;
  for (auto& r : *incoming) File(std::move(r));
  incoming->clear();
  Exchange(control, shutdown);
  const CycleRecords& records = records_;

  CycleResult& result = *out;
  result.responses.clear();
  result.shutdown = false;
  result.shutdown_ranks.clear();
  result.idle = false;
  if (records.header.flags & kFlagShutdown) {  // a shutdown makes the cycle full
    for (int32_t r = 0; r < size_; ++r) {
      if (records.headers[r].flags & kFlagShutdown) result.shutdown_ranks.push_back(r);
    }
    result.shutdown = true;
    return;
  }
  tuner_->Apply(records.header, cycle_);
  if (records.full) {
    ApplyJoins(records);
    ApplyRequests(records);
  }
  ResponseList& ready = ready_;
  ready.clear();
  const bool partial_bits = ReadyCached(records, &ready);
  ReadyTable(&ready);
  ReadyJoin(&ready);
  const size_t before_stalls = ready.size();
  stalls_.Inspect(records.header.stall_cutoff, records, joined_, &table_, &cache_, &ready);
  FailWholeGroups(&table_, &ready, before_stalls);
  Answered(ready);
  result.idle =
      !records.AnyFlagOrBit() && records.uncached.empty() && ready.empty() && table_.empty();
  result.quiet = !result.idle && !partial_bits && table_.empty() && joined_count_ == 0;
  for (size_t i = 0; result.quiet && i < ready.size(); ++i) {
    result.quiet = ready[i].process_set == 0;
  }
  FuseResponses(ready, tuner_->fusion_threshold_bytes(), &result.responses);
  tuner_->Measure(result.responses);
}

void Controller::Exchange(Communicator* control, bool shutdown) {
  ScopedTrafficKind kind(TrafficKind::kControl);  // what the exchange sends (common/traffic.h)
  Writer& payload = payload_;
  payload.Clear();
  for (const auto& key : to_send_) {
    auto it = local_.find(key);
    if (it != local_.end()) WriteRequest(payload, it->second);
  }
  to_send_.clear();
  CycleRecords& x = records_;
  const int64_t bit_bytes = ((cache_.capacity() + 63) / 64) * 8;
  const int64_t header_bytes = static_cast<int64_t>(sizeof(CycleHeader));

  // Step 2: this rank's summary.
  const int64_t cutoff = stalls_.Cutoff(table_, cache_);
  CycleHeader h{0, static_cast<uint32_t>(payload.data().size()), cutoff, 0, 0};
  tuner_->Publish(&h);
  if (shutdown) h.flags |= kFlagShutdown;
  if (join_pending_) h.flags |= kFlagJoined;
  if (shutdown || h.uncached_bytes > 0 || join_pending_ != joined_[static_cast<size_t>(rank_)] ||
      cutoff >= 0 || stalls_.WantsRecords(cache_)) {
    h.flags |= kFlagFull;
  }
  x.bit_bytes = bit_bytes;
  x.summary.assign(static_cast<size_t>(header_bytes + 2 * bit_bytes), 0);
  std::memcpy(x.summary.data(), &h, sizeof(h));
  char* every = x.summary.data() + header_bytes;
  char* some = every + bit_bytes;
  // The join state this cycle applies (a change makes the cycle full, and ApplyJoins
  // then sets joined_ from it), not the one of the cycle before.
  const bool joined = join_pending_;
  for (int64_t slot = 0; slot < cache_.capacity(); ++slot) {
    const bool mine = !cached_key_[static_cast<size_t>(slot)].empty();
    bool ready = true;  // an empty slot, or one of a set this rank is not in: no say
    const CacheSlot& cs = cache_.slot(slot);
    if (cs.valid && !joined) {
      const ProcessSet* set = sets_->Get(cs.process_set);
      ready = mine || set == nullptr || !set->Contains(rank_);
    }
    if (ready) every[slot / 8] |= static_cast<char>(1 << (slot % 8));
    if (mine) some[slot / 8] |= static_cast<char>(1 << (slot % 8));
  }
  // This rank's own record (step 3), before the reduction combines the summary in place.
  x.record_bytes = header_bytes + bit_bytes;
  std::vector<char>& mine = mine_;
  mine.assign(static_cast<size_t>(x.record_bytes), 0);
  std::memcpy(mine.data(), &h, sizeof(h));
  std::memcpy(mine.data() + header_bytes, some, static_cast<size_t>(bit_bytes));
  Status s = control->AllreduceFixed(
      x.summary.data(), header_bytes + 2 * bit_bytes, [bit_bytes](void* acc, const void* other) {
        CombineSummaries(bit_bytes, static_cast<char*>(acc), static_cast<const char*>(other));
      });
  if (!s.ok()) throw StatusError(s);
  std::memcpy(&x.header, x.summary.data(), sizeof(CycleHeader));

  // Step 3: every rank's own record, only when some rank asked for them.
  x.full = (x.header.flags & kFlagFull) != 0;
  x.uncached.clear();
  if (!x.full) return;
  x.records.resize(static_cast<size_t>(x.record_bytes * size_));
  s = control->AllgatherFixed(mine.data(), x.records.data(), x.record_bytes);
  if (!s.ok()) throw StatusError(s);
  x.headers.resize(static_cast<size_t>(size_));
  x.uncached_bytes.resize(static_cast<size_t>(size_));
  int64_t total = 0;
  for (int32_t r = 0; r < size_; ++r) {
    std::memcpy(&x.headers[r], x.records.data() + r * x.record_bytes, sizeof(CycleHeader));
    x.uncached_bytes[r] = x.headers[r].uncached_bytes;
    total += x.uncached_bytes[r];
  }
  // Step 4: the requests sent in full.
  if (total > 0) {
    x.uncached.resize(static_cast<size_t>(total));
    s = control->Allgatherv(payload.data().data(), &x.uncached[0], x.uncached_bytes);
    if (!s.ok()) throw StatusError(s);
  }
}

void Controller::ApplyJoins(const CycleRecords& records) {
  joined_count_ = 0;
  for (int32_t r = 0; r < size_; ++r) {
    const bool j = (records.headers[r].flags & kFlagJoined) != 0;
    if (j && !joined_[r]) join_cycle_[r] = cycle_;
    joined_[r] = j;
    joined_count_ += j ? 1 : 0;
  }
}

void Controller::ApplyRequests(const CycleRecords& records) {
  int64_t offset = 0;
  for (int32_t r = 0; r < size_; ++r) {
    Reader rd(records.uncached.data() + offset, static_cast<size_t>(records.uncached_bytes[r]));
    offset += records.uncached_bytes[r];
    while (!rd.done()) {
      Request req = ReadRequest(rd);
      const std::string key = TensorKey(req);
      const int64_t slot = cache_.Find(key);
      if (slot >= 0) {
        cache_.Erase(slot);
        std::string& mine = cached_key_[static_cast<size_t>(slot)];
        if (!mine.empty()) {
          to_send_.push_back(mine);  // resend in full next cycle
          mine.clear();
        }
      }
      TableEntry& te = table_[key];
      if (te.requests.empty()) {
        te.seq = seq_++;
        te.first_cycle = cycle_;
        te.first_us = NowMicros();
      }
      te.requests[req.rank] = std::move(req);
    }
  }
}

bool Controller::ReadyCached(const CycleRecords& records, ResponseList* ready) {
  bool partial_bits = false;
  for (int64_t slot = 0; slot < cache_.capacity(); ++slot) {
    CacheSlot& cs = cache_.slot(slot);
    if (!cs.valid) continue;
    ProcessSet* set = sets_->Get(cs.process_set);
    if (set == nullptr) {
      cache_.Erase(slot);
      continue;
    }
    bool anyone_active = joined_count_ == 0;  // no loop over the ranks in steady state
    for (size_t i = 0; !anyone_active && i < set->ranks.size(); ++i) {
      anyone_active = !joined_[static_cast<size_t>(set->ranks[i])];
    }
    const bool any = records.Some(slot);
    const bool every = anyone_active && records.Every(slot);
    partial_bits = partial_bits || (any && !every);
    if (any && cs.first_bit_cycle < 0) {
      cs.first_bit_cycle = cycle_;
      cs.first_bit_us = NowMicros();
    }
    if (every) {
      // Checked when cached: a copy into a kept response (no allocation, no loop over the
      // members' requests); with ranks joined, the active ones and the ops that go on.
      Response& r = ready->Add();
      r = cs.response;
      if (joined_count_ != 0) {
        Active(*set, &r.active);
        RefuseJoined(*set, &r);
      }
      cs.first_bit_cycle = -1;
      cs.reported = false;
    }
  }
  return partial_bits;
}

void Controller::ReadyTable(ResponseList* ready) {
  // Entries every active member submitted, in first-seen order.
  std::vector<std::pair<int64_t, std::string>> order;
  for (const auto& kv : table_) order.emplace_back(kv.second.seq, kv.first);
  std::sort(order.begin(), order.end());
  GroupsReady groups;
  for (const auto& o : order) {
    TableEntry& te = table_[o.second];
    const Request& first = te.requests.begin()->second;
    ProcessSet* set = sets_->Get(first.process_set);
    Response resp;
    if (set == nullptr) {
      resp.op = first.op;
      resp.process_set = first.process_set;
      resp.tensors.push_back({first.name, first.shape, {}});
      resp.error = StatusCode::kInvalidArgument;
      resp.error_message = "process set " + std::to_string(first.process_set) +
                           " does not exist (removed?) for tensor '" + first.name + "'";
    } else {
      std::vector<int32_t> active;
      Active(*set, &active);
      bool every = !active.empty();
      for (int32_t a : active) every = every && te.requests.count(a) > 0;
      if (!every) continue;
      Build(te.requests, set, &resp);
      if (resp.error == StatusCode::kOk && Cacheable(first) &&
          te.requests.size() == set->ranks.size() && resp.active.size() == set->ranks.size()) {
        cache_.Put(te.requests, rank_, resp);
      }
    }
    if (const Request* grouped = GroupedRequest(te)) {
      groups.Add(*grouped, std::move(resp), ready);
    } else {
      ready->push_back(std::move(resp));
    }
    table_.erase(o.second);
  }
  groups.Close(&table_, ready);
}

void Controller::ReadyJoin(ResponseList* ready) {
  if (joined_count_ != size_) return;
  int32_t last = 0;
  for (int32_t r = 0; r < size_; ++r) {
    if (join_cycle_[r] >= join_cycle_[last]) last = r;
  }
  Response j;
  j.op = OpType::kJoin;
  j.extra = {last};
  ready->push_back(std::move(j));
}

void Controller::Answered(const ResponseList& responses) {
  for (const Response& r : responses) {
    if (r.op == OpType::kJoin) join_pending_ = false;
    for (const auto& t : r.tensors) {
      AssignTensorKey(&key_, r.process_set, t.name);
      auto it = local_.find(key_);
      if (it == local_.end()) continue;
      LocalMap::node_type node = local_.extract(it);  // kept for File to refill
      if (spare_local_.size() < kKeepNodes) spare_local_.push_back(std::move(node));
    }
  }
  for (std::string& key : cached_key_) {
    if (!key.empty() && !local_.count(key)) key.clear();
  }
}

}  // namespace spark_hvd
