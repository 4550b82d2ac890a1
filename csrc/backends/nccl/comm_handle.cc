#include "backends/nccl/comm_handle.h"

namespace spark_hvd {
namespace nccl {

Status NcclError(const cuda::NcclApi* nccl, ncclResult_t err, const std::string& what,
                 const std::string& detail) {
  if (err == ncclSuccess || err == ncclInProgress) return Status::OK();
  const std::string msg =
      what + ": " + nccl->GetErrorString(err) + (detail.empty() ? "" : " (" + detail + ")");
  const std::string debug = "; NCCL_DEBUG=WARN in the ranks' environment prints NCCL's reason";
  switch (err) {
    case ncclRemoteError:
      return Status::PeerLost(msg + " (a peer failed or left, or the network to it broke)");
    case ncclInvalidArgument:
      return Status::InvalidArgument(msg);
    case ncclUnhandledCudaError:
      return Status::Internal(msg +
                              "; a CUDA error on this rank, not a lost peer: check that its "
                              "GPU is visible (CUDA_VISIBLE_DEVICES) and the NVIDIA driver "
                              "loads" +
                              debug);
    case ncclSystemError:
      return Status::Internal(msg +
                              "; a system call failed on this rank, not a lost peer: check "
                              "its shared memory (/dev/shm, often too small in containers: "
                              "--shm-size), its network interfaces (NCCL_SOCKET_IFNAME) and "
                              "open-file limits" +
                              debug);
    case ncclInvalidUsage:
      return Status::Internal(msg +
                              "; NCCL refused how it was used on this rank: each rank "
                              "needs its own GPU (ranks sharing one: "
                              "SPARK_HVD_GPU_OPERATIONS=tcp stages through host memory), and "
                              "every rank must issue the same collectives" +
                              debug);
    default:  // ncclInternalError and codes of later NCCL versions
      return Status::Internal(msg + "; an internal NCCL failure on this rank, not a lost peer" +
                              debug);
  }
}

Status CommHandle::Call(FunctionRef<Status()> calls, FunctionRef<Status()> aborted) {
  std::lock_guard<std::mutex> lock(mu_);
  if (abort_requested_) {
    AbortHoldingLock();
    return aborted();
  }
  Status s = calls();
  if (abort_requested_) AbortHoldingLock();  // asked while the calls ran: now, not during them
  return s;
}

Status CommHandle::AsyncFailure() {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock() || abort_requested_) return Status::OK();
  ncclResult_t async = ncclSuccess;
  nccl->CommGetAsyncError(comm, &async);
  if (async == ncclSuccess || async == ncclInProgress) return Status::OK();  // no strings made
  return NcclError(nccl, async, "NCCL reported an asynchronous error", nccl->GetLastError(comm));
}

void CommHandle::RecordFailure(const Status& why) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (failure_.ok()) failure_ = why;
}

Status CommHandle::failure() {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return failure_;
}

void CommHandle::Abort(const Status& why) {
  RecordFailure(why);
  abort_requested_ = true;
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (lock.owns_lock()) AbortHoldingLock();  // else the thread inside a call does it (2)
}

void CommHandle::RequestAbort(const Status& why) {
  RecordFailure(why);
  abort_requested_ = true;
}

void CommHandle::AbortHoldingLock() {
  if (aborted_ || comm == nullptr) return;
  aborted_ = true;
  nccl->CommAbort(comm);
}

CommHandle::~CommHandle() {
  if (comm == nullptr) return;
  if (abort_requested_) {
    AbortHoldingLock();  // nobody else holds the handle: no call is in progress
  } else {
    nccl->CommDestroy(comm);
  }
}

}  // namespace nccl
}  // namespace spark_hvd
