// Store: the key-value interface every backend bootstraps through (Gloo exchanges
// its connection addresses here). Implemented by the job's rendezvous service
// (through the Python client, see python/py_store.h) and by an in-memory store.
//
// Blocking behaviour:
//   Set   returns once the value is stored; never blocks on other ranks.
//   Get   blocks until the key exists, up to timeout_s; then throws StatusError(kTimeout).
//   Wait  blocks until all keys exist, same timeout rule (MultiGet and SetAndMultiGet too).
//   LostRanks  one request, never waits.
// Failures of the store itself throw StatusError(kStoreError).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace spark_hvd {

class Store {
 public:
  virtual ~Store() = default;
  virtual void Set(const std::string& key, const std::string& value) = 0;
  virtual std::string Get(const std::string& key, double timeout_s) = 0;
  virtual void Wait(const std::vector<std::string>& keys, double timeout_s) = 0;
  // Every key's value, in order: one request to the rendezvous service, waiting up to
  // timeout_s until all are set. With fail_on_lost, a rank of the job the service has
  // lost (LostRanks) ends the wait at once with kPeerLost naming it. The default (a
  // store without a bulk read) gets the keys one by one, asking LostRanks in between.
  virtual std::vector<std::string> MultiGet(const std::vector<std::string>& keys, double timeout_s,
                                            bool fail_on_lost);
  // Set(key, value), then MultiGet(keys, ...): one request to the rendezvous service
  // (SETMGET), so a rank publishes its address and reads its peers' in one round trip;
  // with no keys to read, a Set.
  std::vector<std::string> SetAndMultiGet(const std::string& key, const std::string& value,
                                          const std::vector<std::string>& keys, double timeout_s,
                                          bool fail_on_lost) {
    if (keys.empty()) {
      Set(key, value);
      return {};
    }
    return SetAndMultiGetRequest(key, value, keys, timeout_s, fail_on_lost);
  }
  // Ranks of the job the rendezvous service has seen vanish (a registered rank's
  // connection dropped without a goodbye: its process exited or its host became
  // unreachable). Empty where the store does not watch ranks.
  virtual std::vector<int> LostRanks() { return {}; }

 protected:
  // SetAndMultiGet with keys to read. The default (a store without that request): the
  // two calls.
  virtual std::vector<std::string> SetAndMultiGetRequest(const std::string& key,
                                                         const std::string& value,
                                                         const std::vector<std::string>& keys,
                                                         double timeout_s, bool fail_on_lost);
};

// After a MultiGet timed out: the indices of `keys` still missing (one request per key:
// the failure path only), so the error can name whose keys never came.
std::vector<size_t> MissingKeys(Store* store, const std::vector<std::string>& keys);

// A MultiGet's kPeerLost as `who`'s (e.g. "rank 3 stopped connecting to its peers"):
// "<who>: it lost rank 5 during init (<the service's words>)", the ranks kept.
Status LostDuringInit(const std::string& who, const Status& lost);

// Namespaces every key with "<prefix>/", so several contexts can share one store.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> inner)
      : prefix_(std::move(prefix)), inner_(std::move(inner)) {}
  void Set(const std::string& key, const std::string& value) override {
    inner_->Set(Key(key), value);
  }
  std::string Get(const std::string& key, double timeout_s) override {
    return inner_->Get(Key(key), timeout_s);
  }
  void Wait(const std::vector<std::string>& keys, double timeout_s) override {
    inner_->Wait(Keys(keys), timeout_s);
  }
  std::vector<std::string> MultiGet(const std::vector<std::string>& keys, double timeout_s,
                                    bool fail_on_lost) override {
    return inner_->MultiGet(Keys(keys), timeout_s, fail_on_lost);
  }
  std::vector<int> LostRanks() override { return inner_->LostRanks(); }  // job-wide

 protected:
  std::vector<std::string> SetAndMultiGetRequest(const std::string& key, const std::string& value,
                                                 const std::vector<std::string>& keys,
                                                 double timeout_s, bool fail_on_lost) override {
    return inner_->SetAndMultiGet(Key(key), value, Keys(keys), timeout_s, fail_on_lost);
  }

 private:
  std::string Key(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> Keys(const std::vector<std::string>& keys) const {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(Key(k));
    return full;
  }
  std::string prefix_;
  std::shared_ptr<Store> inner_;
};

}  // namespace spark_hvd
