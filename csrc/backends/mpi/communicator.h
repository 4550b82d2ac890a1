// MPI communicator for CPU tensors (and the control plane) when the job was
// started by mpirun (spark-hvdrun --mpi). Built only when CMake finds an MPI.
#pragma once

#include <memory>
#include <vector>

#include "backends/communicator.h"

namespace spark_hvd {

class MpiCommunicator : public Communicator {
 public:
  // Initialises MPI once per process (MPI_THREAD_SERIALIZED; all calls come from
  // the engine's background thread). Returns the world communicator.
  static std::unique_ptr<MpiCommunicator> World();
  // A communicator over `ranks` (world ranks, sorted); collective over the world:
  // every world rank must call it with the same list. Null for non-members.
  std::unique_ptr<MpiCommunicator> Subset(const std::vector<int>& ranks);
  // Finalises MPI if we initialised it. Call after every communicator is gone.
  static void Finalize();

  ~MpiCommunicator() override;

  const char* name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool Accepts(int32_t device) const override { return device == kCpuDevice; }

  Status AllgatherFixed(const void* in, void* out, int64_t bytes) override;
  Status Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op,
                   bool stable_buffer) override;
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank) override;
  Status Broadcast(void* buf, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                   const std::vector<int64_t>& recv_bytes) override;
  Status Barrier() override;

 private:
  struct Impl;
  explicit MpiCommunicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace spark_hvd
