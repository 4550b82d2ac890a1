#include "backends/nccl/communicator.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "backends/cuda/util.h"
#include "backends/members.h"
#include "common/env.h"
#include "common/free_list.h"
#include "common/logging.h"

namespace spark_hvd {
namespace nccl {
namespace {

class Work : public PendingWork, public Recycled<Work> {
 public:
  Work(const cuda::CudaApi* cuda, std::shared_ptr<CommHandle> comm, int32_t device,
       cuda::PooledEvent event, std::vector<std::vector<uint8_t>> keep,
       std::shared_ptr<const WaitMarks> marks, uint64_t call)
      : cuda_(cuda),
        comm_(std::move(comm)),
        device_(device),
        event_(std::move(event)),
        keep_(std::move(keep)),
        marks_(std::move(marks)),
        call_(std::to_string(call)) {}

  bool Poll(Status* status) override {
    const cudaError_t q = cuda::QueryOnDevice(cuda_, device_, event_.get());
    if (q == cudaSuccess) {
      *status = Status::OK();
      return true;
    }
    if (q != cudaErrorNotReady) {
      *status = Status::Internal(std::string("CUDA error while a collective ran: ") +
                                 cuda_->GetErrorString(q));
      return true;
    }
    if (comm_->abort_requested()) {
      const Status why = comm_->failure();
      *status = why.ok() ? Status::PeerLost("the NCCL communicator was aborted") : why;
      return true;
    }
    Status failure = comm_->AsyncFailure();
    if (failure.ok()) return false;
    comm_->RecordFailure(failure);  // InFlight aborts next: the ops that find it say why
    *status = failure;
    return true;
  }
  void Abort() override {
    comm_->Abort(Status::Timeout("a GPU collective on it outlasted SPARK_HVD_TIMEOUT_S"));
  }
  bool Quiesced() override {
    return cuda::QueryOnDevice(cuda_, device_, event_.get()) != cudaErrorNotReady;
  }
  // The op's last NCCL call (numbered as Settle numbers it) is the one its peers queued
  // too when they wait for it on their streams.
  void NoteWaiting() override {
    marks_->Note(call_, "rank " + std::to_string(marks_->members[marks_->self]) +
                            " waiting for its GPU collective");
  }
  std::string WhoIsMissing(std::vector<int32_t>* ranks) override {
    return "rank " + std::to_string(marks_->members[marks_->self]) + " queued it, and " +
           marks_->WhoIsMissing(call_,
                                "every other member queued it too and waits for it (a GPU of "
                                "one of them is stuck, or the network between them: "
                                "NCCL_DEBUG=WARN)",
                                ranks);
  }

 private:
  const cuda::CudaApi* cuda_;
  std::shared_ptr<CommHandle> comm_;
  int32_t device_;
  cuda::PooledEvent event_;                 // behind the op's work
  std::vector<std::vector<uint8_t>> keep_;  // host memory queued copies read or write
  std::shared_ptr<const WaitMarks> marks_;  // the communicator's (shared: no copy per op)
  std::string call_;                        // the number of the op's last NCCL call
};

}  // namespace

NcclCommunicator::NcclCommunicator(const BackendOptions& options, std::vector<int32_t> members,
                                   int32_t set_id, const cuda::CudaApi* cuda,
                                   const cuda::NcclApi* nccl)
    : options_(options),
      members_(std::move(members)),
      set_id_(set_id),
      rank_(MemberRank(members_, options.rank)),
      cuda_(cuda),
      nccl_(nccl) {
  auto marks = std::make_shared<WaitMarks>();
  marks->store = options_.store;
  marks->prefix = options_.store_prefix + "/nccl/set" + std::to_string(set_id_) + "/waiting/";
  marks->members = members_;
  marks->self = rank_;
  marks_ = std::move(marks);
}

NcclCommunicator::~NcclCommunicator() {
  // No wait here: the stream's resources go once its work is done (work in flight holds
  // the comm), and the pool frees its idle memory through FreeLater once its last
  // communicator is gone.
  if (stream_ != nullptr) cuda_->StreamDestroy(stream_);
  if (pool_) pool_->Detach();
  comm_.reset();
}

void NcclCommunicator::Abort() {
  if (comm_) comm_->Abort(Status::PeerLost("the job stopped after a failure"));
}

Status NcclCommunicator::Aborted() const {
  // The failure that ended it, as its own kind (a peer's loss, this rank's error, a timeout).
  const Status why = comm_->failure();
  const std::string what = "the NCCL communicator of rank " + std::to_string(options_.rank) +
                           " (process set " + std::to_string(set_id_) + ") was aborted";
  if (why.ok()) return Status::PeerLost(what + " after a GPU collective failed or timed out");
  return Status(why.code(), what + ": " + why.message(), why.ranks());
}

std::vector<int32_t> NcclCommunicator::MembersLost() const {
  std::vector<int32_t> lost;
  if (!options_.lost_ranks) return lost;
  try {
    for (int32_t r : options_.lost_ranks()) {
      if (std::binary_search(members_.begin(), members_.end(), r)) lost.push_back(r);
    }
  } catch (const std::exception&) {
    // the service did not answer: no news; the deadline still applies
  }
  return lost;
}

Status NcclCommunicator::OnComm(FunctionRef<Status()> calls) {
  ++calls_made_;
  return comm_->Call(calls, [this] { return Aborted(); });
}

Status NcclCommunicator::WaitForStream() {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(env::TimeoutS());
  auto next_lost_check = std::chrono::steady_clock::now();
  Status s = cuda::WaitPolling(cuda_, device_, stream_, [&]() -> Status {
    if (comm_->abort_requested()) return Aborted();
    Status failure = comm_->AsyncFailure();
    if (!failure.ok()) return failure;
    // The rendezvous service is asked every 100 ms (a call into Python, under the GIL).
    if (std::chrono::steady_clock::now() >= next_lost_check) {
      next_lost_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
      std::vector<int32_t> lost = MembersLost();
      if (!lost.empty()) {
        return Status::PeerLost("the rendezvous service lost rank(s) " + JoinRanks(lost) +
                                    " while rank " + std::to_string(options_.rank) +
                                    " waited for its GPU work",
                                lost);
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Status::Timeout(
          "a GPU collective did not finish within SPARK_HVD_TIMEOUT_S on "
          "rank " +
          std::to_string(options_.rank) +
          "; its communicator was aborted (a peer, or this rank's GPU, may "
          "be stuck)");
    }
    return Status::OK();
  });
  if (!s.ok()) comm_->Abort(s);  // the stream's kernels wait no more
  return s;
}

Status NcclCommunicator::CudaCheck(cudaError_t err, const char* what) const {
  if (err == cudaSuccess) return Status::OK();  // the message only for a failure
  return cuda::CudaStatus(cuda_, err,
                          std::string(what) + " on rank " + std::to_string(options_.rank));
}

Status NcclCommunicator::NcclCheck(ncclResult_t err, const char* what) const {
  if (err == ncclInProgress && comm_ && comm_->nonblocking && comm_->comm) return Settle(what);
  if (err == ncclSuccess || err == ncclInProgress) return Status::OK();
  return NcclError(nccl_, err,
                   std::string("NCCL ") + what + " failed on rank " + std::to_string(options_.rank),
                   comm_ && comm_->comm ? nccl_->GetLastError(comm_->comm) : "");
}
Status NcclCommunicator::Prepare(const DeviceInputs& inputs) {
  int32_t device = inputs.device;
  if (device < 0) device = device_;  // this rank joined: its device from before
  if (device < 0) {
    return Status::InvalidArgument(
        "this rank has no GPU tensor in this operation and has run no GPU operation before "
        "(it joined first), so it cannot take part on the GPU");
  }
  if (!comm_) {
    Status s = Connect(device);
    if (!s.ok()) return s;
  } else if (comm_->abort_requested()) {
    return Aborted();
  } else if (device != device_) {
    return Status::InvalidArgument("NCCL takes one GPU per rank: this rank used GPU " +
                                   std::to_string(device_) + " and now GPU " +
                                   std::to_string(device) + "; keep each rank on one device");
  }
  Status s = CudaCheck(cuda_->SetDevice(device_), "cudaSetDevice");
  if (s.ok()) s = cuda::WaitForEvents(cuda_, stream_, inputs.ready);  // the inputs are ready
  user_stream_known_ = inputs.streams.size() == 1;
  user_stream_ = user_stream_known_ ? static_cast<cudaStream_t>(inputs.streams[0]) : nullptr;
  keep_.clear();
  return s;
}

std::unique_ptr<PendingWork> NcclCommunicator::TakePending() {
  if (!queued_) return nullptr;
  queued_ = false;
  cuda::PooledEvent done;
  if (!cuda::EventAfterQueuedWork(cuda_, device_, stream_, &done).ok()) {
    // Cannot observe the work: wait for it here rather than release its buffers early.
    cuda_->StreamSynchronize(stream_);
    keep_.clear();
    return nullptr;
  }
  return std::make_unique<Work>(cuda_, comm_, device_, std::move(done), std::move(keep_), marks_,
                                calls_made_);
}

Status NcclCommunicator::Allocate(int64_t bytes, Buffer* out) {
  return pool_->Allocate(bytes, stream_, out, user_stream_known_ ? &user_stream_ : nullptr);
}

Status NcclCommunicator::Scratch(size_t bytes, Buffer* out) {
  return pool_->Allocate(static_cast<int64_t>(bytes), stream_, out);
}

Status NcclCommunicator::Copy(void* dst, const void* src, int64_t bytes) {
  if (bytes == 0 || dst == src) return Status::OK();
  queued_ = true;
  return CudaCheck(
      cuda_->MemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream_),
      "cudaMemcpyAsync");
}
Status NcclCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  queued_ = true;
  return OnComm([&] {
    return NcclCheck(nccl_->Broadcast(buf, buf, static_cast<size_t>(bytes), ncclUint8, root,
                                      comm_->comm, stream_),
                     "ncclBroadcast");
  });
}

Status NcclCommunicator::AllgatherFixed(const void*, void*, int64_t) {
  return Status::Internal("the NCCL backend does not carry the control plane");
}

// Equal blocks: one ncclAllGather. Ragged (or this rank joined): every rank
// broadcasts its block into its place of everyone's output, as one NCCL group.
Status NcclCommunicator::Allgatherv(const void* in, void* out,
                                    const std::vector<int64_t>& bytes_per_rank) {
  queued_ = true;
  const bool equal =
      in != nullptr && std::all_of(bytes_per_rank.begin(), bytes_per_rank.end(),
                                   [&](int64_t b) { return b == bytes_per_rank[0]; });
  if (equal) {
    return OnComm([&] {
      return NcclCheck(nccl_->AllGather(in, out, static_cast<size_t>(bytes_per_rank[0]), ncclUint8,
                                        comm_->comm, stream_),
                       "ncclAllGather");
    });
  }
  return OnComm([&] {
    Status s = NcclCheck(nccl_->GroupStart(), "ncclGroupStart");
    if (!s.ok()) return s;
    int64_t offset = 0;
    for (int r = 0; r < size() && s.ok(); ++r) {
      const int64_t bytes = bytes_per_rank[static_cast<size_t>(r)];
      if (bytes > 0) {
        s = NcclCheck(
            nccl_->Broadcast(r == rank_ ? in : nullptr, static_cast<char*>(out) + offset,
                             static_cast<size_t>(bytes), ncclUint8, r, comm_->comm, stream_),
            "ncclBroadcast (allgather)");
      }
      offset += bytes;
    }
    Status end = NcclCheck(nccl_->GroupEnd(), "ncclGroupEnd");
    return s.ok() ? end : s;
  });
}

// One send and one receive per peer, as one NCCL group; this rank's own block is a copy.
Status NcclCommunicator::Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                                   void* out, const std::vector<int64_t>& recv_bytes) {
  queued_ = true;
  std::vector<int64_t> send_off(size() + 1, 0), recv_off(size() + 1, 0);
  for (int r = 0; r < size(); ++r) {
    send_off[r + 1] = send_off[r] + send_bytes[static_cast<size_t>(r)];
    recv_off[r + 1] = recv_off[r] + recv_bytes[static_cast<size_t>(r)];
  }
  Status s = Copy(static_cast<char*>(out) + recv_off[rank_],
                  static_cast<const char*>(in) + send_off[rank_], send_bytes[rank_]);
  if (!s.ok()) return s;
  return OnComm([&] {
    Status s = NcclCheck(nccl_->GroupStart(), "ncclGroupStart");
    if (!s.ok()) return s;
    for (int r = 0; r < size() && s.ok(); ++r) {
      if (r == rank_) continue;
      if (send_bytes[r] > 0) {
        s = NcclCheck(
            nccl_->Send(static_cast<const char*>(in) + send_off[r],
                        static_cast<size_t>(send_bytes[r]), ncclUint8, r, comm_->comm, stream_),
            "ncclSend (alltoall)");
      }
      if (s.ok() && recv_bytes[r] > 0) {
        s = NcclCheck(
            nccl_->Recv(static_cast<char*>(out) + recv_off[r], static_cast<size_t>(recv_bytes[r]),
                        ncclUint8, r, comm_->comm, stream_),
            "ncclRecv (alltoall)");
      }
    }
    Status end = NcclCheck(nccl_->GroupEnd(), "ncclGroupEnd");
    return s.ok() ? end : s;
  });
}

Status NcclCommunicator::Barrier() {
  return Status::Internal("barrier runs on the control plane, not on NCCL");
}

std::unique_ptr<Communicator> NcclCommunicator::Split(const std::vector<int32_t>& ranks,
                                                      int32_t set_id) {
  if (!std::binary_search(ranks.begin(), ranks.end(), rank_)) return nullptr;
  return std::make_unique<NcclCommunicator>(options_, SplitMembers(members_, ranks), set_id, cuda_,
                                            nccl_);
}

}  // namespace nccl
}  // namespace spark_hvd