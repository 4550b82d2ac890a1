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

// The fixed part of each rank's record in step 2.
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
constexpr uint32_t kKeepOwn = 0xFFFFFFFFu;

// What every rank sent in one cycle (steps 2 and 3).
struct CycleRecords {
  int64_t record_bytes = 0;   // header + cache bit vector
  std::vector<char> records;  // size * record_bytes, in rank order
  std::vector<CycleHeader> headers;
  std::vector<int64_t> uncached_bytes;  // by rank
  std::string uncached;                 // every rank's serialized requests, in rank order

  // Did `rank` set the cache bit of `slot` this cycle?
  bool Bit(int32_t rank, int64_t slot) const {
    const char byte = records[static_cast<size_t>(
        rank * record_bytes + static_cast<int64_t>(sizeof(CycleHeader)) + slot / 8)];
    return ((byte >> (slot % 8)) & 1) != 0;
  }
  // Did any rank raise a flag or set any cache bit?
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
