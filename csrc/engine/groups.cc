#include "engine/groups.h"

#include <algorithm>
#include <set>

namespace spark_hvd {
namespace {

// Does a table entry belong to the group `key` (a TensorKey of the group's name)?
// Any request counts: one rank may have submitted the name in the group and
// another outside it (that is the mismatch).
bool InGroup(const TableEntry& te, const std::string& key) {
  for (const auto& kv : te.requests) {
    const Request& q = kv.second;
    if (!q.group.empty() && TensorKey(q.process_set, q.group) == key) return true;
  }
  return false;
}

std::string Quoted(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "'" : ", '") + n + "'";
  return s;
}

// Step 4: moves the group's table entries into `failed` (one more tensor each).
void TakeTableMembers(const std::string& key, MessageTable* table, Response* failed) {
  for (auto it = table->begin(); it != table->end();) {
    if (!InGroup(it->second, key)) {
      ++it;
      continue;
    }
    const Request& q = it->second.requests.begin()->second;
    failed->tensors.push_back({q.name, q.shape, {}});
    it = table->erase(it);
  }
}

// Step 3, every member valid but some missing: which ranks submitted which members.
Response Incomplete(const ReadyGroup& g, const std::string& key, const MessageTable& table) {
  Response r;
  r.error = StatusCode::kMismatch;
  std::vector<std::string> everyone;
  for (const auto& m : g.members) everyone.push_back(m.tensors[0].name);
  const std::vector<int32_t>& active = g.members[0].active;
  std::string partial;
  for (const auto& kv : table) {
    if (!InGroup(kv.second, key)) continue;
    std::vector<int32_t> got, missing;
    for (int32_t a : active) (kv.second.requests.count(a) ? got : missing).push_back(a);
    const std::string& name = kv.second.requests.begin()->second.name;
    partial += "; '" + name + "' only from ranks " + RankList(got);
    if (r.error_ranks.empty() && !got.empty() && !missing.empty()) {
      r.error_ranks = {std::min(got[0], missing[0]), std::max(got[0], missing[0])};
    }
  }
  r.error_message =
      "its members differ between ranks: every rank submitted " + Quoted(everyone) +
      (partial.empty()
           ? "; the other " + std::to_string(g.size - static_cast<int32_t>(g.members.size())) +
                 " never came"
           : partial) +
      ". Every rank must submit the same tensors in a group.";
  return r;
}

std::string GroupPrefix(const std::string& name, size_t tensors) {
  return "grouped op '" + name + "' (" + std::to_string(tensors) + " tensors) failed as a whole: ";
}

}  // namespace

void GroupsReady::Add(const Request& first, Response member, ResponseList* ready) {
  member.group = first.group;
  const std::string key = TensorKey(first.process_set, first.group);
  ReadyGroup& g = open_[key];
  if (g.members.empty()) {
    g.name = first.group;
    g.size = first.group_size;
  }
  g.members.push_back(std::move(member));
  if (static_cast<int32_t>(g.members.size()) < g.size) return;
  for (const auto& m : g.members) {
    if (m.error != StatusCode::kOk) return;  // Close fails it
  }
  for (auto& m : g.members) ready->push_back(std::move(m));  // step 2
  open_.erase(key);
}

void GroupsReady::Close(MessageTable* table, ResponseList* ready) {
  for (auto& kv : open_) {
    const ReadyGroup& g = kv.second;
    auto error = std::find_if(g.members.begin(), g.members.end(),
                              [](const Response& m) { return m.error != StatusCode::kOk; });
    Response failed = error != g.members.end() ? *error : Incomplete(g, kv.first, *table);
    failed.op = g.members[0].op;
    failed.process_set = g.members[0].process_set;
    failed.group = g.name;
    failed.tensors.clear();
    for (const auto& m : g.members) failed.tensors.push_back(m.tensors[0]);
    TakeTableMembers(kv.first, table, &failed);
    failed.error_message = GroupPrefix(g.name, failed.tensors.size()) + failed.error_message;
    ready->push_back(std::move(failed));
  }
  open_.clear();
}

void FailWholeGroups(MessageTable* table, ResponseList* ready, size_t from) {
  ResponseList& rs = *ready;
  // Most cycles have no failed grouped tensor: then nothing to do, and nothing allocated.
  bool any = false;
  for (size_t i = from; i < rs.size() && !any; ++i) {
    any = rs[i].error != StatusCode::kOk && !rs[i].group.empty();
  }
  if (!any) return;
  std::set<std::string> done;
  std::vector<bool> merged(rs.size(), false);
  for (size_t i = from; i < rs.size(); ++i) {
    if (rs[i].error == StatusCode::kOk || rs[i].group.empty()) continue;
    const std::string key = TensorKey(rs[i].process_set, rs[i].group);
    if (!done.insert(key).second) continue;
    for (size_t j = i + 1; j < rs.size(); ++j) {  // the group's other failures
      if (rs[j].error != StatusCode::kOk && rs[j].group == rs[i].group &&
          rs[j].process_set == rs[i].process_set) {
        for (auto& t : rs[j].tensors) rs[i].tensors.push_back(std::move(t));
        merged[j] = true;
      }
    }
    TakeTableMembers(key, table, &rs[i]);
    rs[i].error_message = GroupPrefix(rs[i].group, rs[i].tensors.size()) + rs[i].error_message;
  }
  size_t kept = from;
  for (size_t i = from; i < rs.size(); ++i) {
    if (merged[i]) continue;
    if (kept != i) rs[kept] = std::move(rs[i]);
    ++kept;
  }
  rs.resize(kept);
}

}  // namespace spark_hvd
