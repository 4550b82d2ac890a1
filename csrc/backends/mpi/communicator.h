// MPI communicator for CPU tensors (and the control plane) when the job was
// started by mpirun (spark-hvdrun --mpi). Built only when CMake finds an MPI.
#pragma once

#include <memory>
#include <vector>

#include "backends/communicator.h"
#include "backends/contiguous.h"

namespace spark_hvd {

class MpiCommunicator : public Communicator {
 public:
  // Initialises MPI once per process (MPI_THREAD_SERIALIZED; all calls come from
  // the engine's background thread). Returns the world communicator.
  static std::unique_ptr<MpiCommunicator> World();
  // Finalises MPI if we initialised it. Call after every communicator is gone.
  static void Finalize();

  ~MpiCommunicator() override;

  const char* name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status AllgatherFixed(const void* in, void* out, int64_t bytes) override;
  Status Allreduce(const ReduceArgs& args) override;
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank) override;
  Status Broadcast(void* buf, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                   const std::vector<int64_t>& recv_bytes) override;
  Status Barrier() override;
  // MPI_Comm_create over this communicator: collective over all of its ranks.
  std::unique_ptr<Communicator> Split(const std::vector<int32_t>& ranks, int32_t set_id) override;

 private:
  struct Impl;
  explicit MpiCommunicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  FusionBuffer fusion_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace spark_hvd
