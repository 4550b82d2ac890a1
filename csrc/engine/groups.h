// Grouped ops (protocol step 5 in controller.h): the members of a group run
// together or fail together.
//
// Every rank submits the whole of a group in one enqueue (Engine::Enqueue refuses
// anything else), so its members reach the message table in the same cycle, and
// become ready (every active member of the set submitted them) in the same cycle:
//  1. The ready members of each group are collected in that cycle (GroupsReady).
//  2. A group that has all its `group_size` members, none of them an error, goes to
//     the executor as it is (its allreduces adjacent, so fusion can join them).
//  3. Any other group fails as a whole: one error response naming every member
//     (each rank fails its own entries with it), with the error of its first failing
//     member (dtype, shape, op... mismatch; a process set gone), or, when every
//     member was valid but some are missing, a mismatch saying which members which
//     ranks submitted: a rank whose group had other members has submitted all of
//     them by now, so the group could never complete.
//  4. Failing a group takes with it its members still in the message table (those
//     some ranks did not submit: a member one rank has and another has not), so no
//     entry of the group is left waiting (FailWholeGroups). The same holds for an
//     error the stall inspector gives a member that expired in the table.
// A failed group leaves nothing behind: its names can be used again at once. The
// table is identical on every rank, so every rank fails the same group, in the same
// cycle, with the same error.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "engine/message.h"
#include "engine/negotiation.h"

namespace spark_hvd {

// The members of one group that became ready this cycle.
struct ReadyGroup {
  std::string name;  // as submitted (the response's `group` is its TensorKey)
  int32_t size = 0;  // group_size of the first member's first request
  std::vector<Response> members;
};

class GroupsReady {
 public:
  // Adds a ready member (or an error response for one); when that completes its
  // group without errors, appends the group's members to `ready` (step 2).
  void Add(const Request& first, Response member, ResponseList* ready);
  // Fails every group still open (an error, or incomplete: step 3), with the
  // table members of those groups (step 4).
  void Close(MessageTable* table, ResponseList* ready);

 private:
  std::map<std::string, ReadyGroup> open_;  // by the group's TensorKey
};

// Step 4 for the error responses in ready[from..] of grouped tensors (e.g. the stall
// inspector's): the other error responses and the table entries of each such group
// join the first one, whose message then names the group.
void FailWholeGroups(MessageTable* table, ResponseList* ready, size_t from);

}  // namespace spark_hvd
