// Executor: carries out the responses the controller agreed on, on the first
// communicator of the process set whose backend accepts the tensors' device and
// op. The executor never touches tensor memory itself: an allreduce (fused or
// not) goes to the backend as ReduceArgs (inputs, outputs, scale factors), an
// Adasum allreduce to HostAdasum (backends/host_adasum.h) on that communicator.
#pragma once

#include <memory>
#include <vector>

#include "engine/in_flight.h"
#include "engine/message.h"
#include "engine/process_set.h"
#include "engine/tensor_queue.h"
#include "engine/timeline.h"

namespace spark_hvd {

class Executor {
 public:
  Executor(int32_t rank, ProcessSetTable* sets, TensorQueue* queue, Completions* completions,
           InFlight* in_flight, Timeline* timeline)
      : rank_(rank),
        sets_(sets),
        queue_(queue),
        completions_(completions),
        in_flight_(in_flight),
        timeline_(timeline) {
    es_.reserve(64);  // a fusion of 64 tensors before any growth
    done_.reserve(64);
    args_.tensors.reserve(64);
  }

  // Executes one response. A non-OK return means a communicator failed: the
  // engine must stop (the response's own ops have already been failed).
  Status Execute(const Response& r);

 private:
  using Entries = std::vector<EntryPtr>;
  Status Allreduce(const Response& r, Entries& es, Communicator* comm);
  Status Allgather(const Response& r, Entries& es, Communicator* comm);
  Status Broadcast(const Response& r, Entries& es, Communicator* comm);
  Status Alltoall(const Response& r, Entries& es, Communicator* comm);
  Status Reducescatter(const Response& r, Entries& es, Communicator* comm);
  // A timeline event per entry, named after the communicator's backend and `op` (built
  // only while the timeline records).
  void Phase(const Entries& es, const Communicator* comm, const char* op, int64_t start_us);

  int32_t rank_;
  ProcessSetTable* sets_;
  TensorQueue* queue_;
  Completions* completions_;
  InFlight* in_flight_;
  Timeline* timeline_;
  // Reducescatter of uneven rows on host memory: the whole reduced tensor, kept for the
  // next one (grown, never shrunk) so that steady state allocates nothing per op.
  std::vector<uint8_t> host_scratch_;
  // The op's entries, arguments and byte counts, reused from op to op (cleared, their
  // capacity kept): no allocation per op in steady state.
  Entries es_;
  std::vector<std::shared_ptr<OpState>> done_;  // ReleaseThenComplete's scratch
  ReduceArgs args_;
  DeviceInputs inputs_;  // a device op's ready events and producer streams
  std::vector<int64_t> bytes_, send_, recv_, recv_rows_;
};

}  // namespace spark_hvd
