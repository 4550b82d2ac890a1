// The data one negotiation cycle works on (see controller.h for the protocol):
// what every rank sent this cycle, and the table of tensors still waiting for
// some ranks. Identical on every rank.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engine/message.h"

namespace spark_hvd {

// The fixed part of each rank's record (step 2), and of the cycle's summary, which
// combines every rank's: flags ORed, the other fields their maxima (every rank but 0
// leaves them 0, or -1 for the cutoff, so the summary carries rank 0's).
struct CycleHeader {
  uint32_t flags;
  uint32_t uncached_bytes;
  int64_t stall_cutoff;  // rank 0 only: fail tensors pending since this cycle; -1 = none
  // Rank 0 only, under kFlagTuned (autotune.h): the parameters every rank applies from
  // this cycle's fusion on; kKeepOwn: each rank's own setting (one set explicitly).
  uint32_t fusion_threshold_kib;
  uint32_t cycle_time_us;
};
static_assert(sizeof(CycleHeader) == 24, "the header is exchanged as raw bytes every cycle");
constexpr uint32_t kFlagShutdown = 1;
constexpr uint32_t kFlagJoined = 2;
constexpr uint32_t kFlagTuned = 4;      // rank 0 runs autotune: apply its parameters
constexpr uint32_t kFlagSearching = 8;  // ... and is still searching
// Some rank needs every rank's own record this cycle (step 3): it has requests to send in
// full, shuts down, joined or stopped being joined, or (rank 0) reports a stalled tensor.
constexpr uint32_t kFlagFull = 16;
constexpr uint32_t kKeepOwn = 0xFFFFFFFFu;

// What the ranks sent in one cycle (steps 2 to 4).
struct CycleRecords {
  // Step 2, every cycle: the summary, combined over every rank: the header, then the
  // cache bits ANDed (a rank sets the bit of a slot it has ready, of a slot of a process
  // set it is not in, and every bit while it has joined: the slot is ready everywhere
  // when the AND is set), then the cache bits ORed (some rank has the slot ready).
  int64_t bit_bytes = 0;
  std::vector<char> summary;  // header + 2 * bit_bytes
  CycleHeader header{};       // the summary's header

  // Steps 3 and 4, only when the summary carries kFlagFull: every rank's own record
  // (header + its cache bits), then every rank's serialized requests.
  bool full = false;
  int64_t record_bytes = 0;   // header + bit_bytes
  std::vector<char> records;  // size * record_bytes, in rank order
  std::vector<CycleHeader> headers;
  std::vector<int64_t> uncached_bytes;  // by rank
  std::string uncached;                 // every rank's serialized requests, in rank order

  static bool BitAt(const char* bits, int64_t slot) {
    return ((bits[slot / 8] >> (slot % 8)) & 1) != 0;
  }
  // Is the slot ready on every rank (the ANDed bits) / on some rank (the ORed bits)?
  bool Every(int64_t slot) const { return BitAt(summary.data() + sizeof(CycleHeader), slot); }
  bool Some(int64_t slot) const {
    return BitAt(summary.data() + sizeof(CycleHeader) + bit_bytes, slot);
  }
  // Did `rank` set the cache bit of `slot` this cycle? Only when `full`.
  bool Bit(int32_t rank, int64_t slot) const {
    return BitAt(records.data() + rank * record_bytes + sizeof(CycleHeader), slot);
  }
  // Did any rank raise shutdown or joined, or set any cache bit?
  bool AnyFlagOrBit() const;
};

// A tensor some ranks submitted in full and others not yet.
struct TableEntry {
  std::map<int32_t, Request> requests;  // by global rank
  int64_t seq = 0;                      // first-seen order
  int64_t first_cycle = 0;
  int64_t first_us = 0;
  bool reported = false;  // stall warning given
};
using MessageTable = std::map<std::string, TableEntry>;  // by TensorKey

// The request of `te` that names a group (the lowest rank's), or null: ranks that
// disagree about the group still fail the whole of it (groups.h).
inline const Request* GroupedRequest(const TableEntry& te) {
  for (const auto& kv : te.requests) {
    if (!kv.second.group.empty()) return &kv.second;
  }
  return nullptr;
}

}  // namespace spark_hvd
