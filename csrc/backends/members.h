// Rank bookkeeping shared by backends that keep the job ranks of their members.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/status.h"

namespace spark_hvd {

// 0..size-1: every rank of the job.
inline std::vector<int32_t> AllRanks(int32_t size) {
  std::vector<int32_t> all(static_cast<size_t>(size));
  for (int32_t r = 0; r < size; ++r) all[static_cast<size_t>(r)] = r;
  return all;
}

// Where job rank `rank` sits in `members` (sorted job ranks; it must be there).
inline int MemberRank(const std::vector<int32_t>& members, int32_t rank) {
  auto it = std::lower_bound(members.begin(), members.end(), rank);
  SHVD_CHECK(it != members.end() && *it == rank);
  return static_cast<int>(it - members.begin());
}

// The job ranks of a split's members, given as ranks of a communicator among `members`.
inline std::vector<int32_t> SplitMembers(const std::vector<int32_t>& members,
                                         const std::vector<int32_t>& ranks) {
  std::vector<int32_t> out;
  for (int32_t r : ranks) out.push_back(members[static_cast<size_t>(r)]);
  return out;
}

}  // namespace spark_hvd
