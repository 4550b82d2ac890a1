#include "engine/process_set.h"

#include <algorithm>

namespace spark_hvd {

bool ProcessSet::Contains(int32_t global_rank) const { return SetRank(global_rank) >= 0; }

int32_t ProcessSet::SetRank(int32_t global_rank) const {
  auto it = std::lower_bound(ranks.begin(), ranks.end(), global_rank);
  if (it == ranks.end() || *it != global_rank) return -1;
  return static_cast<int32_t>(it - ranks.begin());
}

Communicator* ProcessSet::For(int32_t device, OpType op, DataType dtype) const {
  for (const auto& link : comms) {
    if (link.backend->Accepts(device, op, dtype) && link.comm->Runs(op)) return link.comm.get();
  }
  return nullptr;
}

void ProcessSetTable::Add(std::unique_ptr<ProcessSet> set) {
  std::lock_guard<std::mutex> lock(mu_);
  next_id_ = std::max(next_id_, set->id + 1);
  sets_[set->id] = std::move(set);
}

void ProcessSetTable::Remove(int32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  sets_.erase(id);
}

ProcessSet* ProcessSetTable::Get(int32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(id);
  return it == sets_.end() ? nullptr : it->second.get();
}

std::vector<int32_t> ProcessSetTable::Ranks(int32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(id);
  return it == sets_.end() ? std::vector<int32_t>{} : it->second->ranks;
}

size_t ProcessSetTable::Membership(int32_t id, int32_t global_rank, bool* member) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(id);
  *member = it != sets_.end() && it->second->Contains(global_rank);
  return it == sets_.end() ? 0 : it->second->ranks.size();
}

std::vector<int32_t> ProcessSetTable::Ids() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> ids;
  for (auto& kv : sets_) ids.push_back(kv.first);
  return ids;
}

int32_t ProcessSetTable::NextId() {
  std::lock_guard<std::mutex> lock(mu_);
  return next_id_++;
}

void ProcessSetTable::AbortAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& kv : sets_) {
    for (auto& link : kv.second->comms) {
      if (link.comm) link.comm->Abort();
    }
  }
}

void ProcessSetTable::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  sets_.clear();
  next_id_ = 1;
}

}  // namespace spark_hvd
