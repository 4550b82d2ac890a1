// CommHandle: one NCCL communicator, shared by the NcclCommunicator that calls it (the
// engine thread) and the work queued on it (InFlight's thread), so that an abort and the
// destructor agree on who ends it; and how an NCCL failure becomes a Status.
//
// NCCL is not thread-safe per communicator: two threads must never be inside calls on one
// at the same time, and ncclCommAbort frees it. So:
// 1. Every NCCL call on `comm` is made holding `mu` (Call), by one thread at a time.
// 2. Abort (any thread) asks for the abort and performs it at once if `mu` is free. If a
//    call holds `mu` (one stuck on a broken connection, say), the abort is left to that
//    call's thread, which performs it as soon as its call returns, still holding `mu`:
//    ncclCommAbort never overlaps another call. Meanwhile `abort_requested` already fails
//    the work waiting on the communicator, so no caller waits for a stuck call.
// 3. After an abort was asked no call is made on `comm` but that one abort; the
//    destructor destroys (ncclCommDestroy, which waits for the other members) only a
//    communicator nobody asked to abort, and aborts one whose abort is still owed.
// 4. AsyncFailure asks NCCL for an asynchronous error only when `mu` is free (try-lock):
//    "no news" while a call is in progress, so its callers' deadlines keep running.
// 5. A non-blocking communicator (`nonblocking`, NCCL 2.14+; settle.cc) never holds `mu`
//    for long: a call whose peers do not come returns ncclInProgress, and the thread that
//    made it waits by polling, within SPARK_HVD_TIMEOUT_S; past it, that thread asks the
//    abort itself (RequestAbort, `mu` held), which Call performs as the calls return (2).
//    With a blocking one (an older NCCL) such a call never returns, and nor does the
//    engine thread inside it.
#pragma once

#include <atomic>
#include <mutex>
#include <string>

#include "backends/cuda/loader.h"
#include "common/function_ref.h"
#include "common/status.h"

namespace spark_hvd {
namespace nccl {

// An NCCL failure as the Status the user gets: PeerLost only for ncclRemoteError (a peer
// failed or left, or the network between them); this rank's own failures (system or
// internal errors, invalid usage, a CUDA error) are Internal, naming NCCL's text and what
// to check; invalid arguments are InvalidArgument. `what`: what failed ("NCCL ncclAllReduce
// failed on rank 1"); `detail`: ncclGetLastError's text, if any.
Status NcclError(const cuda::NcclApi* nccl, ncclResult_t err, const std::string& what,
                 const std::string& detail);

struct CommHandle {
  const cuda::NcclApi* nccl = nullptr;
  ncclComm_t comm = nullptr;
  bool nonblocking = false;  // made with ncclConfig_t::blocking = 0 (5)

  // Runs `calls` (NCCL calls on comm) holding mu (1), unless an abort was asked (then
  // `aborted` is returned, and the abort performed if owed); performs an abort asked
  // during the calls once they returned (2).
  Status Call(FunctionRef<Status()> calls, FunctionRef<Status()> aborted);
  // NCCL's asynchronous error (NcclError), or OK: also while a call is in progress (4)
  // and once an abort was asked.
  Status AsyncFailure();
  // (2). `why`: the failure that ends the communicator, kept (the first one given, or
  // recorded by RecordFailure) for the ops that find it aborted.
  void Abort(const Status& why);
  void RecordFailure(const Status& why);
  // Asks the abort without performing it: for the thread inside Call, which holds `mu`
  // and performs it once its calls return (5).
  void RequestAbort(const Status& why);
  Status failure();
  bool abort_requested() const { return abort_requested_; }
  ~CommHandle();

 private:
  void AbortHoldingLock();  // performs an owed abort; mu held

  std::mutex mu_;
  std::atomic<bool> abort_requested_{false};
  bool aborted_ = false;  // ncclCommAbort ran; guarded by mu_
  std::mutex failure_mu_;
  Status failure_;
};

}  // namespace nccl
}  // namespace spark_hvd
