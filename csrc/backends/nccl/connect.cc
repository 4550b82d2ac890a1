// NcclCommunicator's set-up (communicator.h): the NCCL communicator among the members,
// made at their first GPU op, with rank 0's unique id passed through the rendezvous store.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <sstream>
#include <thread>

#include "backends/nccl/communicator.h"
#include "common/logging.h"

namespace spark_hvd {
namespace nccl {

Status NcclCommunicator::Connect(int32_t device) {
  Status s = CudaCheck(cuda_->SetDevice(device),
                       ("cudaSetDevice(" + std::to_string(device) + ")").c_str());
  if (!s.ok()) return s;
  ncclUniqueId id;
  const std::string key = options_.store_prefix + "/nccl/set" + std::to_string(set_id_) + "/id";
  try {
    if (rank_ == 0) {
      s = NcclCheck(nccl_->GetUniqueId(&id), "ncclGetUniqueId");
      if (!s.ok()) return s;
      if (options_.store) options_.store->Set(key, std::string(id.internal, sizeof(id.internal)));
    } else {
      SHVD_CHECK(options_.store != nullptr);
      const std::string v = options_.store->Get(key, options_.connect_timeout_s);
      SHVD_CHECK_EQ(v.size(), sizeof(id.internal));
      std::memcpy(id.internal, v.data(), sizeof(id.internal));
    }
  } catch (const StatusError& e) {
    return e.status();
  }
  auto handle = std::make_shared<CommHandle>();
  handle->nccl = nccl_;
  s = InitRank(handle, device, id);
  if (!s.ok()) return s;
  comm_ = handle;
  s = CudaCheck(cuda_->StreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                "cudaStreamCreateWithFlags");
  if (!s.ok()) return s;
  device_ = device;
  pool_ = cuda::MemoryPool::Of(cuda_, device, cuda::MemoryPool::kDevice);
  pool_->Attach();
  SHVD_LOG(kDebug, "nccl") << "rank " << rank_ << " of " << size() << " (set " << set_id_
                           << ") on GPU " << device;
  return Status::OK();
}

// ncclCommInitRank blocks until every member joins, and a member that died (or
// failed before it) never does. So it runs on a thread of its own (which, with NCCL 2.14+,
// makes a non-blocking communicator, polls its init and aborts it when the waiter gave
// up, then exits; an older NCCL's init may keep its thread) while this one
// watches: a member the rendezvous service reports lost, or the start deadline
// (SPARK_HVD_START_TIMEOUT_S), ends the wait with an error instead of a hang. After a
// second (or half the deadline) of waiting, this rank writes the store key saying it waits
// in the init (WaitMarks, call "init"), once; at the deadline the members that wrote none
// (never reached their first GPU op, or frozen in it) are named in the Timeout. The
// abandoned init thread keeps what it uses alive and exits with the process, or, if
// its init still completes, aborts that communicator (nobody will use it, and
// destroying it would wait for the other local ranks).
Status NcclCommunicator::InitRank(const std::shared_ptr<CommHandle>& handle, int32_t device,
                                  const ncclUniqueId& id) {
  struct Init {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    bool abandoned = false;  // the waiter gave up
    ncclResult_t result = ncclSuccess;
  };
  auto init = std::make_shared<Init>();
  std::thread([init, handle, cuda = cuda_, nccl = nccl_, device, id, n = size(), r = rank_] {
    cuda->SetDevice(device);  // the current device is per thread; NCCL takes it from here
    ncclComm_t comm = nullptr;
    ncclResult_t result;
    const bool nonblocking = nccl->CommInitRankConfig != nullptr;
    if (nonblocking) {
      ncclConfig_t config{sizeof(ncclConfig_t), kNcclConfigMagic, kNcclConfigVersion, 0};
      result = nccl->CommInitRankConfig(&comm, n, id, r, &config);
      // The init goes on in NCCL's threads: poll it, and abort it if the waiter gave up.
      while (result == ncclInProgress || (result == ncclSuccess && comm != nullptr)) {
        ncclResult_t state = ncclSuccess;
        if (nccl->CommGetAsyncError(comm, &state) != ncclSuccess) break;
        if (state != ncclInProgress) {
          result = state;
          break;
        }
        {
          std::lock_guard<std::mutex> lock(init->mu);
          if (init->abandoned) {
            nccl->CommAbort(comm);
            return;
          }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else {
      result = nccl->CommInitRank(&comm, n, id, r);
    }
    std::lock_guard<std::mutex> lock(init->mu);
    if (init->abandoned) {
      if (result == ncclSuccess) nccl->CommAbort(comm);
      return;
    }
    handle->nonblocking = nonblocking;
    handle->comm = result == ncclSuccess ? comm : nullptr;
    init->result = result;
    init->done = true;
    init->cv.notify_all();
  }).detach();
  using Clock = std::chrono::steady_clock;
  const double timeout_s = options_.connect_timeout_s;
  const auto start = Clock::now();
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  const auto mark_at = start + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(std::min(1.0, timeout_s / 2)));
  bool marked = false;
  std::unique_lock<std::mutex> lock(init->mu);
  while (!init->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return init->done; })) {
    if (!marked && Clock::now() >= mark_at) {
      marked = true;
      marks_->Note("init", "ncclCommInitRank on rank " + std::to_string(options_.rank));
    }
    const std::vector<int32_t> lost = MembersLost();
    if (!lost.empty()) {
      init->abandoned = true;
      return Status::PeerLost("ncclCommInitRank on rank " + std::to_string(options_.rank) +
                                  " stopped waiting: the rendezvous service lost rank(s) " +
                                  JoinRanks(lost),
                              lost);
    }
    if (Clock::now() > deadline) {
      init->abandoned = true;
      lock.unlock();  // the store lookups take a while; the init thread may finish meanwhile
      std::vector<int32_t> silent;
      const std::string who = marks_->WhoIsMissing("init", kAllWaitInTheCall, &silent);
      std::ostringstream secs;
      secs << timeout_s;
      Status s(StatusCode::kTimeout,
               "ncclCommInitRank on rank " + std::to_string(options_.rank) + " (process set " +
                   std::to_string(set_id_) + ") waited SPARK_HVD_START_TIMEOUT_S=" + secs.str() +
                   " s for the other ranks of the GPU communicator: " + who,
               silent);
      SHVD_LOG(kWarning, "nccl") << s.message();
      return s;
    }
  }
  return NcclCheck(init->result, "ncclCommInitRank");
}

}  // namespace nccl
}  // namespace spark_hvd
