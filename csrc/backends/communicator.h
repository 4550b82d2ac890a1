// Communicator: one backend's connection among the ranks of one process set.
//
// Every backend folder (tcp/, shm/, gloo/, mpi/, nccl/, staged/) provides a
// communicator.h/.cc implementing this interface and a backend.cc registering it
// (backend.h). All calls are made from the engine's background thread (or an API thread
// running a cycle, for backends that allow it: Backend::AnyThread), one at a time, in the
// same order on every member rank. Ranks here are ranks *within the communicator*
// (0..size-1).
//
// Each call blocks until the collective finishes locally; a lost or silent peer
// surfaces as a non-OK Status (kPeerLost / kTimeout) instead of a hang.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/function_ref.h"
#include "common/status.h"
#include "common/types.h"

namespace spark_hvd {

// One tensor's elements inside an allreduce, reduced in place.
struct Segment {
  void* data;
  int64_t count;
};

// One tensor of an allreduce: `input` reduced into `output` (the same pointer for
// in place). A rank that has joined holds no tensor: input and output are null
// and it contributes the op's neutral value.
struct ReduceTensor {
  const void* input;
  void* output;
  int64_t count;
};

// An allreduce as the engine asks for it: every tensor is prescaled, reduced
// with `op` (Average: summed, then divided by `ranks`, every member of the set,
// as Horovod: ranks that have joined add zeros and still count), then postscaled. Tensors are in
// the memory of the communicator's device.
struct ReduceArgs {
  std::vector<ReduceTensor> tensors;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  double prescale = 1.0;
  double postscale = 1.0;
  int64_t ranks = 1;
};

// What a device op's inputs bring to Prepare.
struct DeviceInputs {
  // This rank's device for the op; kCpuDevice when this rank holds no tensor (it joined).
  int32_t device = kCpuDevice;
  // Events (cudaEvent_t) recorded on the streams that produced the inputs, at submit.
  std::vector<void*> ready;
  // Those streams (null: the legacy default stream, torch's default), where the op was
  // submitted from: an output the core allocates is read there afterwards.
  std::vector<void*> streams;
};

// Memory a communicator allocated (an op's output, or scratch), in its memory: host
// memory (device kCpuDevice) or a GPU's. Freed when the last copy of `owner` goes.
struct Buffer {
  void* data = nullptr;
  int64_t bytes = 0;
  int32_t device = kCpuDevice;
  std::shared_ptr<void> owner;
};

// Work a device backend queued on its stream and has not finished.
class PendingWork {
 public:
  virtual ~PendingWork() = default;
  // Never blocks: true once the work has finished (*status: how) or failed (a
  // peer's error reported by the library).
  virtual bool Poll(Status* status) = 0;
  // Gives up on the work: aborts the communicator it runs on (which is unusable
  // afterwards); Poll then returns true.
  virtual void Abort() = 0;
  // Never blocks: true once nothing queued for the work can still read or write its
  // buffers. After a failure or an abort the ops fail at once, but copies queued behind
  // the collective may still run; until this is true their buffers are kept.
  virtual bool Quiesced() { return true; }
  // Called once the work has waited a second (or half SPARK_HVD_TIMEOUT_S): a backend
  // whose peers can see it says so there (NCCL: its WaitMarks key). The slow path only.
  virtual void NoteWaiting() {}
  // At SPARK_HVD_TIMEOUT_S: who holds the work up, as far as this rank can tell ("" when
  // it cannot), *ranks the job ranks it names.
  virtual std::string WhoIsMissing(std::vector<int32_t>* ranks) {
    (void)ranks;
    return "";
  }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual const char* name() const = 0;  // the backend's name: "tcp", "gloo", "mpi", ...
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Control plane: every rank contributes `bytes` bytes; out receives size*bytes.
  virtual Status AllgatherFixed(const void* in, void* out, int64_t bytes) = 0;

  // Control plane, a cycle's summary: every rank contributes `bytes` bytes in `inout`,
  // which receives their combination: combine(acc, other) folds `other` into `acc` and
  // must be commutative and associative (ORs, ANDs, maxima, integer sums), so any
  // order of folding gives the same bytes on every rank. The default gathers every
  // rank's record (AllgatherFixed) and folds them; tcp runs it in log2(size) rounds of
  // recursive doubling, each rank sending one message per round.
  using Combine = FunctionRef<void(void* acc, const void* other)>;
  virtual Status AllreduceFixed(void* inout, int64_t bytes, Combine combine);

  // The allreduce of args.tensors, as one collective. Host-memory backends do
  // the arithmetic around the reduction through HostAllreduce (host_reduce.h); one
  // that needs one contiguous buffer packs through FusionBuffer (contiguous.h).
  virtual Status Allreduce(const ReduceArgs& args) = 0;

  // Rank r contributes bytes_per_rank[r] bytes; out is their concatenation.
  virtual Status Allgatherv(const void* in, void* out,
                            const std::vector<int64_t>& bytes_per_rank) = 0;

  virtual Status Broadcast(void* buf, int64_t bytes, int root) = 0;

  // send_bytes[r] bytes go to rank r (consecutive in `in`); recv_bytes[r] come from r.
  virtual Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                           const std::vector<int64_t>& recv_bytes) = 0;

  virtual Status Barrier() = 0;
  // Can this communicator carry the engine's per-cycle control exchange (AllgatherFixed,
  // Allgatherv) in this job? The engine hands the exchange to the first communicator of
  // the global set that can, when it comes before the control plane's own (shm, when
  // every rank shares a host). Default: no.
  virtual bool CarriesControl() const { return false; }
  // Does this communicator run `op`? A backend whose communicators differ by where their
  // ranks are (shm: one host or several) declines what a set's cannot do, and the op goes
  // to the set's next backend that accepts it (ProcessSet::For). Default: yes.
  virtual bool Runs(OpType op) const {
    (void)op;
    return true;
  }
  // Reduce-scatter in equal blocks, where the backend has it as one collective:
  // `args.tensors` is one tensor of size() * `block` elements (its output unused), and
  // this rank's reduced block goes to `out`. Returns false, doing nothing, where it has
  // not (the default), and the executor reduces the whole tensor and keeps its block.
  virtual bool ReducescatterBlocks(const ReduceArgs& args, int64_t block, void* out,
                                   Status* status) {
    (void)args, (void)block, (void)out, (void)status;
    return false;
  }

  // Called before each op. Device backends: order the op's work after `inputs.ready`
  // (events recorded on the inputs' producer streams when they were submitted) and remember
  // `inputs.streams` for the outputs Allocate makes during the op. Host backends have
  // nothing to do.
  virtual Status Prepare(const DeviceInputs& inputs) {
    (void)inputs;
    return Status::OK();
  }
  // Copies bytes between two tensors in this communicator's memory.
  virtual Status Copy(void* dst, const void* src, int64_t bytes);
  // `bytes` of this communicator's memory (host memory unless overridden).
  virtual Status Allocate(int64_t bytes, Buffer* out);
  // The work the last call queued without finishing it (device backends; the
  // caller must keep the op's buffers alive until it is done); null: finished.
  virtual std::unique_ptr<PendingWork> TakePending() { return nullptr; }
  // The engine stopped on a failure: end this communicator now, without the
  // handshake with its peers that a clean destruction may do (a peer that failed
  // never joins it). Called before destruction; host backends have nothing to do.
  virtual void Abort() {}

  // A communicator among `ranks` (ranks of this communicator, sorted), for process
  // set `set_id`. Collective: every rank of this communicator calls it with the
  // same arguments, in the same order; ranks outside `ranks` get null.
  virtual std::unique_ptr<Communicator> Split(const std::vector<int32_t>& ranks,
                                              int32_t set_id) = 0;

 private:
  std::vector<char> fixed_scratch_;  // the default AllreduceFixed's gathered records
};

inline Status Communicator::AllreduceFixed(void* inout, int64_t bytes, Combine combine) {
  const size_t b = static_cast<size_t>(bytes);
  // Kept: no allocation per cycle once it has grown to the job's size.
  if (fixed_scratch_.size() < b * static_cast<size_t>(size())) {
    fixed_scratch_.resize(b * static_cast<size_t>(size()));
  }
  Status s = AllgatherFixed(inout, fixed_scratch_.data(), bytes);
  if (!s.ok()) return s;
  for (int r = 0; r < size(); ++r) {
    if (r != rank()) combine(inout, fixed_scratch_.data() + b * static_cast<size_t>(r));
  }
  return Status::OK();
}

inline Status Communicator::Allocate(int64_t bytes, Buffer* out) {
  auto memory = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(bytes));
  out->data = memory->data();
  out->bytes = bytes;
  out->device = kCpuDevice;
  out->owner = memory;
  return Status::OK();
}

inline Status Communicator::Copy(void* dst, const void* src, int64_t bytes) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, static_cast<size_t>(bytes));
  return Status::OK();
}

}  // namespace spark_hvd
