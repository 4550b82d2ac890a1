// WaitMarks: how the members of an NCCL communicator tell each other that they wait in
// a call (its number, the same sequence on every member, or "init" for the
// communicator's set-up), so that a rank that gives up can name the members that never
// reached it.
//
// 1. A wait that has lasted a second (or half its timeout) writes, once, the key
//    <prefix>/nccl/set<S>/waiting/<call>/<member> (Note): the slow path only, no store
//    traffic in steady state.
// 2. At the timeout, the members that wrote no key for that call (stuck before it, in
//    their own work, frozen, or on their GPU) are named (WhoIsMissing); when every other
//    member wrote one, the wait is on something they share (a GPU, the network).
// Without a store (one rank, no launcher) nothing is written and nobody can be named.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rendezvous/store.h"

namespace spark_hvd {
namespace nccl {

// What WhoIsMissing says of an NCCL call (or init) every other member waits in too.
constexpr const char* kAllWaitInTheCall =
    "every other member waits in it too (check the network between them: "
    "NCCL_SOCKET_IFNAME, NCCL_DEBUG=WARN)";

struct WaitMarks {
  std::shared_ptr<Store> store;  // may be null
  std::string prefix;            // "<store_prefix>/nccl/set<S>/waiting/"
  std::vector<int32_t> members;  // job ranks, by member index
  int self = 0;                  // this rank's member index

  std::string Key(const std::string& call, int member) const;
  // (1) Writes this member's key for `call`; a store failure is logged for `where`.
  void Note(const std::string& call, const std::string& where) const;
  // (2) "rank(s) R never reached it (...)", with *silent = R; `all_waiting` when every
  // other member wrote its key.
  std::string WhoIsMissing(const std::string& call, const std::string& all_waiting,
                           std::vector<int32_t>* silent) const;
};

}  // namespace nccl
}  // namespace spark_hvd
