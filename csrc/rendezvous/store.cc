#include "rendezvous/store.h"

#include <algorithm>
#include <chrono>

#include "common/status.h"
#include "common/types.h"

namespace spark_hvd {

std::vector<std::string> Store::SetAndMultiGetRequest(const std::string& key,
                                                      const std::string& value,
                                                      const std::vector<std::string>& keys,
                                                      double timeout_s, bool fail_on_lost) {
  Set(key, value);
  return MultiGet(keys, timeout_s, fail_on_lost);
}

std::vector<std::string> Store::MultiGet(const std::vector<std::string>& keys, double timeout_s,
                                         bool fail_on_lost) {
  constexpr double kLostCheckS = 0.5;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const auto& key : keys) {
    while (true) {
      if (fail_on_lost) {
        const std::vector<int> lost = LostRanks();
        if (!lost.empty()) {
          throw StatusError(Status::PeerLost(
              "the rendezvous service lost rank" + std::string(lost.size() > 1 ? "s " : " ") +
                  JoinRanks(lost) + " while this rank waited for '" + key + "'",
              std::vector<int32_t>(lost.begin(), lost.end())));
        }
      }
      const double left =
          std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) throw StatusError(Status::Timeout("timed out waiting for '" + key + "'"));
      try {
        values.push_back(
            Get(key, fail_on_lost ? std::max(0.01, std::min(left, kLostCheckS)) : left));
        break;
      } catch (const StatusError& e) {
        if (e.status().code() != StatusCode::kTimeout) throw;
      }
    }
  }
  return values;
}

Status LostDuringInit(const std::string& who, const Status& lost) {
  const std::vector<int32_t>& ranks = lost.ranks();
  return Status::PeerLost(who + ": it lost rank" + (ranks.size() > 1 ? "s " : " ") +
                              JoinRanks(ranks) + " during init (" + lost.message() + ")",
                          ranks);
}

std::vector<size_t> MissingKeys(Store* store, const std::vector<std::string>& keys) {
  std::vector<size_t> missing;
  for (size_t i = 0; i < keys.size(); ++i) {
    try {
      store->Get(keys[i], 0.0);
    } catch (const StatusError& e) {
      if (e.status().code() != StatusCode::kTimeout) throw;
      missing.push_back(i);
    }
  }
  return missing;
}

}  // namespace spark_hvd
