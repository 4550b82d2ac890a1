#include "engine/controller.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "common/env.h"
#include "common/logging.h"
#include "engine/timeline.h"

namespace spark_hvd {
namespace {

struct Header {
  uint32_t flags;
  uint32_t uncached_bytes;
  int64_t stall_cutoff;  // rank 0 only: fail tensors pending since this cycle; -1 = none
};
constexpr uint32_t kFlagShutdown = 1;
constexpr uint32_t kFlagJoined = 2;

bool Cacheable(const Request& r) {
  return r.group.empty() &&
         (r.op == OpType::kAllreduce || r.op == OpType::kAllgather || r.op == OpType::kBroadcast ||
          r.op == OpType::kAlltoall || r.op == OpType::kReducescatter);
}

std::string RankList(const std::vector<int32_t>& ranks) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? "," : "") << ranks[i];
  os << "]";
  return os.str();
}

std::vector<int64_t> Tail(const std::vector<int64_t>& shape) {
  return shape.empty() ? shape : std::vector<int64_t>(shape.begin() + 1, shape.end());
}

}  // namespace

Controller::Controller(int32_t rank, int32_t size, ProcessSetTable* sets, HandleTable* handles)
    : rank_(rank),
      size_(size),
      sets_(sets),
      handles_(handles),
      cache_(env::CacheCapacity()),
      joined_(static_cast<size_t>(size), false),
      join_cycle_(static_cast<size_t>(size), -1) {}

void Controller::Fail(TensorEntry& e, const Status& s) {
  if (e.state) handles_->Complete(*e.state, s);
}

void Controller::File(TensorEntry e) {
  if (e.req.op == OpType::kJoin) {
    if (join_entry_) {
      Fail(e, Status::InvalidArgument("join() is already pending on rank " +
                                      std::to_string(rank_)));
      return;
    }
    join_entry_ = std::make_unique<TensorEntry>(std::move(e));
    return;
  }
  const std::string key = TensorKey(e.req);
  if (pending_.count(key)) {
    Fail(e, Status::InvalidArgument(
                "a tensor named '" + e.req.name + "' is already in flight on rank " +
                std::to_string(rank_) + " in process set " + std::to_string(e.req.process_set) +
                "; names of concurrent operations must be unique (omit name= to get a generated one)"));
    return;
  }
  int64_t slot = Cacheable(e.req) ? cache_.Find(key) : -1;
  if (slot >= 0 && cache_.Matches(slot, e.req)) {
    cached_local_[slot] = key;
  } else {
    to_send_.push_back(key);
  }
  pending_[key] = std::make_unique<TensorEntry>(std::move(e));
}

std::vector<int32_t> Controller::Active(const ProcessSet& set) const {
  std::vector<int32_t> active;
  for (int32_t r : set.ranks) {
    if (!joined_[static_cast<size_t>(r)]) active.push_back(r);
  }
  return active;
}

Response Controller::Build(const std::map<int32_t, Request>& requests, const ProcessSet* set) const {
  const Request& first = requests.begin()->second;
  Response r;
  r.op = first.op;
  r.dtype = first.dtype;
  r.reduce_op = first.reduce_op;
  r.prescale = first.prescale;
  r.postscale = first.postscale;
  r.root = first.root;
  r.process_set = first.process_set;
  r.device = first.device;
  r.active = Active(*set);
  // The tensor goes in first: an error response must still name it, so every
  // rank fails its own entry instead of waiting for it forever.
  r.tensors.push_back({first.name, first.shape, {}});
  ResponseTensor& t = r.tensors.back();

  const std::string what = "tensor '" + first.name + "' (" + OpTypeName(first.op) + ")";
  auto mismatch = [&](const std::string& field, const std::string& a, int32_t rb,
                      const std::string& b) {
    r.error = StatusCode::kMismatch;
    r.error_message = what + ": " + field + " differs between ranks: rank " +
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
    } else if (q.device != first.device) {
      mismatch("device", std::to_string(first.device), q.rank, std::to_string(q.device));
    } else if (q.op == OpType::kBroadcast && q.root != first.root) {
      mismatch("root rank", std::to_string(first.root), q.rank, std::to_string(q.root));
    } else if ((q.op == OpType::kAllgather || q.op == OpType::kAlltoall) &&
               (q.shape.size() != first.shape.size() || Tail(q.shape) != Tail(first.shape))) {
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
    } else if (q.group != first.group || q.group_size != first.group_size) {
      mismatch("group", first.group, q.rank, q.group);
    }
    if (r.error != StatusCode::kOk) return r;
  }

  const bool anyone_joined = r.active.size() != set->ranks.size();
  if (anyone_joined) {
    std::vector<int32_t> joined;
    for (int32_t m : set->ranks) {
      if (joined_[static_cast<size_t>(m)]) joined.push_back(m);
    }
    if (first.op == OpType::kBroadcast &&
        joined_[static_cast<size_t>(set->ranks[static_cast<size_t>(first.root)])]) {
      r.error = StatusCode::kInvalidArgument;
      r.error_message = what + ": its root rank has already called join()";
      return r;
    }
    if (first.op == OpType::kAlltoall || first.op == OpType::kReducescatter ||
        first.reduce_op == ReduceOp::kAdasum) {
      r.error = StatusCode::kInvalidArgument;
      r.error_message = what + " is not supported while ranks " + RankList(joined) +
                        " have joined; only allreduce, allgather, broadcast and barrier are";
      return r;
    }
  }

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
        r.error_message = what + ": rank " + std::to_string(kv.first) + " gave " +
                          std::to_string(kv.second.splits.size()) + " splits for " +
                          std::to_string(n) + " ranks";
        return r;
      }
      for (size_t j = 0; j < n; ++j) t.rank_dims[static_cast<size_t>(sr) * n + j] = kv.second.splits[j];
    }
  } else if (first.op == kAddProcessSet || first.op == kRemoveProcessSet) {
    r.extra = first.splits;
  }
  return r;
}

CycleResult Controller::Cycle(Communicator* control, std::vector<TensorEntry> incoming,
                              bool shutdown) {
  ++cycle_;
  for (auto& e : incoming) File(std::move(e));

  // 1-2. Header, uncached payload and cache bits.
  Writer payload;
  for (const auto& name : to_send_) {
    auto it = pending_.find(name);
    if (it != pending_.end()) WriteRequest(payload, it->second->req);
  }
  to_send_.clear();
  const int64_t bit_bytes = ((cache_.capacity() + 63) / 64) * 8;
  const int64_t rec = static_cast<int64_t>(sizeof(Header)) + bit_bytes;
  std::vector<char> mine(static_cast<size_t>(rec), 0);
  Header h{0, static_cast<uint32_t>(payload.data().size()), -1};
  if (shutdown) h.flags |= kFlagShutdown;
  if (join_entry_) h.flags |= kFlagJoined;
  const double stall_shutdown_s = env::StallShutdownTimeS();
  if (rank_ == 0 && stall_shutdown_s > 0) {
    const int64_t limit_us = NowMicros() - static_cast<int64_t>(stall_shutdown_s * 1e6);
    for (const auto& kv : table_) {
      if (kv.second.first_us <= limit_us) h.stall_cutoff = std::max(h.stall_cutoff, kv.second.first_cycle);
    }
    for (int64_t s = 0; s < cache_.capacity(); ++s) {
      const CacheSlot& cs = cache_.slot(s);
      if (cs.valid && cs.first_bit_cycle >= 0 && cs.first_bit_us <= limit_us) {
        h.stall_cutoff = std::max(h.stall_cutoff, cs.first_bit_cycle);
      }
    }
  }
  std::memcpy(mine.data(), &h, sizeof(h));
  for (const auto& kv : cached_local_) {
    mine[sizeof(Header) + static_cast<size_t>(kv.first / 8)] |= static_cast<char>(1 << (kv.first % 8));
  }
  std::vector<char> all(static_cast<size_t>(rec * size_));
  Status s = control->AllgatherFixed(mine.data(), all.data(), rec);
  if (!s.ok()) throw StatusError(s);

  std::vector<Header> headers(static_cast<size_t>(size_));
  int64_t total_uncached = 0;
  std::vector<int64_t> sizes(static_cast<size_t>(size_));
  for (int32_t r = 0; r < size_; ++r) {
    std::memcpy(&headers[r], all.data() + r * rec, sizeof(Header));
    sizes[r] = headers[r].uncached_bytes;
    total_uncached += sizes[r];
  }
  auto bit = [&](int32_t r, int64_t slot) {
    const char byte = all[static_cast<size_t>(r * rec + static_cast<int64_t>(sizeof(Header)) + slot / 8)];
    return ((byte >> (slot % 8)) & 1) != 0;
  };

  // 3. Uncached requests, only when someone has any.
  std::string everyone;
  if (total_uncached > 0) {
    everyone.resize(static_cast<size_t>(total_uncached));
    s = control->Allgatherv(payload.data().data(), &everyone[0], sizes);
    if (!s.ok()) throw StatusError(s);
  }

  CycleResult result;
  for (int32_t r = 0; r < size_; ++r) {
    if (headers[r].flags & kFlagShutdown) result.shutdown_ranks.push_back(r);
  }
  if (!result.shutdown_ranks.empty()) {
    result.shutdown = true;
    return result;
  }

  // 4. Joined ranks, then the message table.
  for (int32_t r = 0; r < size_; ++r) {
    bool j = (headers[r].flags & kFlagJoined) != 0;
    if (j && !joined_[r]) join_cycle_[r] = cycle_;
    joined_[r] = j;
  }
  int64_t offset = 0;
  for (int32_t r = 0; r < size_; ++r) {
    Reader rd(everyone.data() + offset, static_cast<size_t>(sizes[r]));
    offset += sizes[r];
    while (!rd.done()) {
      Request req = ReadRequest(rd);
      const std::string key = TensorKey(req);
      int64_t slot = cache_.Find(key);
      if (slot >= 0) {
        cache_.Erase(slot);
        auto it = cached_local_.find(slot);
        if (it != cached_local_.end()) {
          to_send_.push_back(it->second);  // resend in full next cycle
          cached_local_.erase(it);
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

  std::vector<Response> ready;
  // Cached tensors whose bit every active member set.
  for (int64_t slot = 0; slot < cache_.capacity(); ++slot) {
    CacheSlot& cs = cache_.slot(slot);
    if (!cs.valid) continue;
    ProcessSet* set = sets_->Get(cs.process_set);
    if (set == nullptr) {
      cache_.Erase(slot);
      continue;
    }
    std::vector<int32_t> active = Active(*set);
    bool any = false, every = !active.empty();
    for (int32_t m : set->ranks) any = any || bit(m, slot);
    for (int32_t a : active) every = every && bit(a, slot);
    if (any && cs.first_bit_cycle < 0) {
      cs.first_bit_cycle = cycle_;
      cs.first_bit_us = NowMicros();
    }
    if (every) {
      ready.push_back(Build(cs.requests, set));
      cs.first_bit_cycle = -1;
      cs.reported = false;
      cached_local_.erase(slot);
    }
  }
  // Table entries every active member submitted, in first-seen order.
  std::vector<std::pair<int64_t, std::string>> order;
  for (const auto& kv : table_) order.emplace_back(kv.second.seq, kv.first);
  std::sort(order.begin(), order.end());
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
      std::vector<int32_t> active = Active(*set);
      bool every = !active.empty();
      for (int32_t a : active) every = every && te.requests.count(a) > 0;
      if (!every) continue;
      resp = Build(te.requests, set);
      if (resp.error == StatusCode::kOk && Cacheable(first) &&
          te.requests.size() == set->ranks.size()) {
        cache_.Put(te.requests);
      }
    }
    if (!first.group.empty() && resp.error == StatusCode::kOk) {
      const std::string group_key = TensorKey(first.process_set, first.group);
      auto& g = groups_[group_key];
      g.push_back(std::move(resp));
      if (static_cast<int32_t>(g.size()) >= first.group_size) {
        for (auto& gr : g) ready.push_back(std::move(gr));
        groups_.erase(group_key);
      }
    } else {
      ready.push_back(std::move(resp));
    }
    table_.erase(o.second);
  }

  // 5. Join completes when every rank has joined.
  if (std::all_of(joined_.begin(), joined_.end(), [](bool j) { return j; })) {
    int32_t last = 0;
    for (int32_t r = 0; r < size_; ++r) {
      if (join_cycle_[r] >= join_cycle_[last]) last = r;
    }
    Response j;
    j.op = OpType::kJoin;
    j.extra = {last};
    ready.push_back(std::move(j));
  }
  InspectStalls(headers[0].stall_cutoff, bit, &ready);
  bool any_flag = false;
  for (int32_t r = 0; r < size_ && !any_flag; ++r) {
    any_flag = headers[r].flags != 0;
    for (int64_t b = 0; b < bit_bytes && !any_flag; ++b) {
      any_flag = all[static_cast<size_t>(r * rec + static_cast<int64_t>(sizeof(Header)) + b)] != 0;
    }
  }
  result.idle = !any_flag && total_uncached == 0 && ready.empty() && table_.empty() &&
                groups_.empty();
  result.responses = Fuse(std::move(ready));
  return result;
}

void Controller::InspectStalls(int64_t cutoff, const std::function<bool(int32_t, int64_t)>& bit,
                               std::vector<Response>* out) {
  const double check_s = env::StallCheckTimeS();
  const int64_t now = NowMicros();
  auto missing_from = [&](int32_t set_id, const std::map<int32_t, Request>* have,
                          std::vector<int32_t>* got, std::vector<int32_t>* missing) {
    ProcessSet* set = sets_->Get(set_id);
    if (set == nullptr) return;
    for (int32_t m : set->ranks) {
      if (have->count(m)) got->push_back(m);
      else if (!joined_[m]) missing->push_back(m);
    }
  };
  // Table entries (uncached tensors).
  std::vector<std::string> expired;
  for (auto& kv : table_) {
    TableEntry& te = kv.second;
    const Request& first = te.requests.begin()->second;
    std::vector<int32_t> got, missing;
    bool stalled = check_s > 0 && rank_ == 0 && !te.reported && now - te.first_us > check_s * 1e6;
    bool expire = cutoff >= 0 && te.first_cycle <= cutoff;
    if (!stalled && !expire) continue;
    missing_from(first.process_set, &te.requests, &got, &missing);
    std::string text = "tensor '" + first.name + "' (" + OpTypeName(first.op) + ", process set " +
                       std::to_string(first.process_set) + ") was submitted by ranks " +
                       RankList(got) + " but not yet by ranks " + RankList(missing);
    if (stalled) {
      te.reported = true;
      SHVD_LOG(kWarning, "stall")
          << text << " after " << (now - te.first_us) / 1000000
          << " s. A rank may have skipped this op, called it under another name, or be stuck. "
             "(SPARK_HVD_STALL_CHECK_TIME_S sets this warning's delay; "
             "SPARK_HVD_STALL_SHUTDOWN_TIME_S turns stalls into errors.)";
    }
    if (expire) {
      Response r;
      r.op = first.op;
      r.process_set = first.process_set;
      r.tensors.push_back({first.name, first.shape, {}});
      r.error = StatusCode::kTimeout;
      r.error_message = text + " after SPARK_HVD_STALL_SHUTDOWN_TIME_S=" +
                        std::to_string(env::StallShutdownTimeS()) + " s";
      out->push_back(std::move(r));
      expired.push_back(kv.first);
    }
  }
  for (const auto& name : expired) table_.erase(name);
  // Cached tensors: some ranks set the bit, others did not yet.
  for (int64_t slot = 0; slot < cache_.capacity(); ++slot) {
    CacheSlot& cs = cache_.slot(slot);
    if (!cs.valid || cs.first_bit_cycle < 0) continue;
    bool stalled = check_s > 0 && rank_ == 0 && !cs.reported && now - cs.first_bit_us > check_s * 1e6;
    bool expire = cutoff >= 0 && cs.first_bit_cycle <= cutoff;
    if (!stalled && !expire) continue;
    const Request& first = cs.requests.begin()->second;
    std::vector<int32_t> got, missing;
    if (ProcessSet* set = sets_->Get(cs.process_set)) {
      for (int32_t m : set->ranks) {
        if (bit(m, slot)) got.push_back(m);
        else if (!joined_[m]) missing.push_back(m);
      }
    }
    std::string text = "tensor '" + first.name + "' (" + OpTypeName(first.op) + ", process set " +
                       std::to_string(cs.process_set) + ") was submitted by ranks " +
                       RankList(got) + " but not yet by ranks " + RankList(missing);
    if (stalled) {
      cs.reported = true;
      SHVD_LOG(kWarning, "stall") << text << " after " << (now - cs.first_bit_us) / 1000000
                                  << " s (SPARK_HVD_STALL_CHECK_TIME_S)";
    }
    if (expire) {
      Response r;
      r.op = first.op;
      r.process_set = cs.process_set;
      r.tensors.push_back({first.name, first.shape, {}});
      r.error = StatusCode::kTimeout;
      r.error_message = text + " after SPARK_HVD_STALL_SHUTDOWN_TIME_S=" +
                        std::to_string(env::StallShutdownTimeS()) + " s";
      out->push_back(std::move(r));
      cached_local_.erase(slot);
      cs.first_bit_cycle = -1;
    }
  }
}

std::vector<Response> Controller::Fuse(std::vector<Response> ready) {
  const int64_t threshold = env::FusionThresholdBytes();
  std::vector<Response> out;
  int64_t bytes = 0;
  for (auto& r : ready) {
    const int64_t rb = r.TotalElements() * static_cast<int64_t>(DataTypeSize(r.dtype));
    if (!out.empty() && threshold > 0 && r.op == OpType::kAllreduce &&
        r.error == StatusCode::kOk && r.reduce_op != ReduceOp::kAdasum) {
      Response& last = out.back();
      if (last.op == OpType::kAllreduce && last.error == StatusCode::kOk &&
          last.dtype == r.dtype && last.reduce_op == r.reduce_op && last.prescale == r.prescale &&
          last.postscale == r.postscale && last.process_set == r.process_set &&
          last.device == r.device && last.active == r.active && bytes + rb <= threshold) {
        for (auto& t : r.tensors) last.tensors.push_back(std::move(t));
        bytes += rb;
        continue;
      }
    }
    bytes = rb;
    out.push_back(std::move(r));
  }
  return out;
}

std::unique_ptr<TensorEntry> Controller::Take(int32_t process_set, const std::string& name) {
  auto it = pending_.find(TensorKey(process_set, name));
  if (it == pending_.end()) return nullptr;
  auto e = std::move(it->second);
  pending_.erase(it);
  return e;
}

std::unique_ptr<TensorEntry> Controller::TakeJoin() { return std::move(join_entry_); }

void Controller::FailAll(const Status& status) {
  for (auto& kv : pending_) Fail(*kv.second, status);
  pending_.clear();
  if (join_entry_) Fail(*join_entry_, status);
  join_entry_.reset();
  to_send_.clear();
  cached_local_.clear();
}

}  // namespace spark_hvd
