// Stall inspection (protocol step 5): tensors some ranks submitted and others
// have not. Rank 0 warns after SPARK_HVD_STALL_CHECK_TIME_S naming the missing
// ranks; after SPARK_HVD_STALL_SHUTDOWN_TIME_S rank 0 publishes a cutoff cycle in
// its header and every rank fails the tensors pending since then, the same way.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/negotiation.h"
#include "engine/process_set.h"
#include "engine/response_cache.h"

namespace spark_hvd {

class StallInspector {
 public:
  StallInspector(int32_t rank, ProcessSetTable* sets) : rank_(rank), sets_(sets) {}

  // Rank 0's cutoff for this cycle's header: the latest cycle whose pending
  // tensors are older than the shutdown time; -1 when none (or not rank 0).
  int64_t Cutoff(const MessageTable& table, ResponseCache& cache) const;

  // Rank 0: will this cycle warn about a cached tensor (whose missing ranks only every
  // rank's own cache bits tell)? Then rank 0 asks for every rank's record (kFlagFull).
  bool WantsRecords(const ResponseCache& cache) const;

  // Warns about (rank 0) and fails (every rank, per rank 0's `cutoff`) stalled
  // tensors of the table and of the cache. Failed tensors leave the table, and
  // their error responses are appended to `out`. A cached tensor is reported only in a
  // cycle with every rank's record (`records.full`; a cutoff makes the cycle full).
  void Inspect(int64_t cutoff, const CycleRecords& records, const std::vector<bool>& joined,
               MessageTable* table, ResponseCache* cache, ResponseList* out);

 private:
  // Warns and/or appends an error response for one stalled tensor.
  void Report(const Request& first, int32_t process_set, const std::vector<int32_t>& got,
              const std::vector<int32_t>& missing, int64_t since_us, bool warn, bool expire,
              ResponseList* out) const;

  int32_t rank_;
  ProcessSetTable* sets_;
};

}  // namespace spark_hvd
