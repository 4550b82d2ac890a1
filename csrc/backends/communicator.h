// Communicator: one backend's connection among the ranks of one process set.
//
// Every backend folder (gloo/, mpi/, later nccl/) provides a communicator.h/.cc
// with a class implementing this interface. All calls are made from the engine's
// background thread only, one at a time, in the same order on every member rank.
// Ranks here are ranks *within the process set* (0..size-1).
//
// Each call blocks until the collective finishes locally; a lost or silent peer
// surfaces as a non-OK Status (kPeerLost / kTimeout) instead of a hang.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/types.h"

namespace spark_hvd {

// One tensor's elements inside a segmented allreduce.
struct Segment {
  void* data;
  int64_t count;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual const char* name() const = 0;  // "gloo", "mpi", ...
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Does this backend execute ops on tensors of `device` (kCpuDevice or a GPU)?
  virtual bool Accepts(int32_t device) const = 0;

  // Control plane: every rank contributes `bytes` bytes; out receives size*bytes.
  virtual Status AllgatherFixed(const void* in, void* out, int64_t bytes) = 0;

  // In-place reduction of `count` elements (Average is reduced as Sum; the
  // engine divides afterwards). `stable_buffer`: buf is engine-owned and will be
  // passed again (the fusion buffer), so per-buffer set-up may be cached. It is
  // the same on every rank for a given call, so caching stays in lockstep.
  virtual Status Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op,
                           bool stable_buffer) = 0;

  // How many elements a stable-buffer Allreduce of `count` should run over: a
  // backend whose set-up is per size may round up to a few size classes (the
  // engine zero-fills the padding and ignores it). Same answer on every rank.
  virtual int64_t StableAllreduceCount(int64_t count) const { return count; }

  // Backends that can reduce several buffers as one (no packing into a fusion
  // buffer) say so here and implement AllreduceSegments: an in-place allreduce of
  // the concatenation of `segments`. A `scale` other than 1 multiplies the result
  // (used for float Average: 1 / ranks), applied once per element by the backend.
  virtual bool SegmentedAllreduce() const { return false; }
  virtual Status AllreduceSegments(const std::vector<Segment>& segments, DataType dtype,
                                   ReduceOp op, double scale) {
    (void)segments, (void)dtype, (void)op, (void)scale;
    return Status::Internal(std::string(name()) + " has no segmented allreduce");
  }

  // Rank r contributes bytes_per_rank[r] bytes; out is their concatenation.
  virtual Status Allgatherv(const void* in, void* out,
                            const std::vector<int64_t>& bytes_per_rank) = 0;

  virtual Status Broadcast(void* buf, int64_t bytes, int root) = 0;

  // send_bytes[r] bytes go to rank r (consecutive in `in`); recv_bytes[r] come from r.
  virtual Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                           const std::vector<int64_t>& recv_bytes) = 0;

  virtual Status Barrier() = 0;
};

}  // namespace spark_hvd
