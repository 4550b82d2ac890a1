// MemoryStore: the rendezvous service's store held in this process, for many engines
// of one process (the in-process simulator, csrc/python/simulate.h) where real ranks
// would each reach the job's rendezvous service (spark_hvd/runner/rendezvous.py)
// through a client. Its waiting is the service's (spark_hvd/_job/store.py): a blocked
// request is woken only when every key it waits for is set, or a rank it watches is
// lost, so N ranks cost O(N) requests and O(N) wake-ups in all.
//
// Each client (Client()) is one rank's connection to the shared data, with its own
// request counters by operation, so a caller reads what each rank asked exactly.
//
// Blocking behaviour: Store's (store.h). MultiGet is one request; with fail_on_lost it
// ends at once with kPeerLost when a rank is lost (MarkLost) while keys are missing.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "rendezvous/store.h"

namespace spark_hvd {

// Requests one client sent, by operation (the rendezvous client's Op names).
enum class StoreOp : int {
  kSet = 0,
  kGet = 1,
  kWait = 2,
  kMultiGet = 3,
  kLostRanks = 4,
  kSetMultiGet = 5
};
constexpr int kStoreOps = 6;
const char* StoreOpName(StoreOp op);  // "SET", "GET", "WAIT", "MGET", "LOST", "SETMGET"

struct StoreRequests {
  std::array<int64_t, kStoreOps> by_op{};
  int64_t total() const;
};

class MemoryStore : public Store {
 public:
  MemoryStore();  // a new, empty store and its first client

  // Another client of the same data, with counters of its own.
  std::shared_ptr<MemoryStore> Client() const;

  void Set(const std::string& key, const std::string& value) override;
  std::string Get(const std::string& key, double timeout_s) override;
  void Wait(const std::vector<std::string>& keys, double timeout_s) override;
  std::vector<std::string> MultiGet(const std::vector<std::string>& keys, double timeout_s,
                                    bool fail_on_lost) override;
  std::vector<int> LostRanks() override;

  // What the service does when a registered rank's connection drops without a goodbye:
  // the rank is lost from now on, and every request watching for losses ends.
  void MarkLost(int rank);

  // This client's requests so far.
  StoreRequests Requests() const;

 protected:
  std::vector<std::string> SetAndMultiGetRequest(const std::string& key, const std::string& value,
                                                 const std::vector<std::string>& keys,
                                                 double timeout_s, bool fail_on_lost) override;

 private:
  struct Waiter {
    size_t missing = 0;  // keys not set yet
    bool watch = false;  // ends on a loss too
    std::condition_variable cv;
  };
  struct Data {
    std::mutex mu;
    std::map<std::string, std::string> values;
    std::map<std::string, std::set<Waiter*>> waiters;  // by missing key
    std::set<Waiter*> watchers;                        // fail_on_lost requests
    std::set<int> lost;
  };
  explicit MemoryStore(std::shared_ptr<Data> data);

  void Count(StoreOp op) { requests_[static_cast<size_t>(op)].fetch_add(1); }
  void Put(const std::string& key, const std::string& value);  // data_->mu held
  std::vector<std::string> Values(std::unique_lock<std::mutex>& lock,
                                  const std::vector<std::string>& keys, double timeout_s,
                                  bool watch);
  // Returns, data->mu held in `lock`, once every key is set; throws kTimeout (naming the
  // missing keys) or, with watch, kPeerLost naming the lost ranks.
  void Await(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
             double timeout_s, bool watch);

  std::shared_ptr<Data> data_;
  std::array<std::atomic<int64_t>, kStoreOps> requests_{};
};

}  // namespace spark_hvd
