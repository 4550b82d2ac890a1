// NcclCommunicator::Settle: a call on a non-blocking communicator that returned
// ncclInProgress (its peers have not all come: NCCL connects to them at the first
// collective that needs them), waited for by the thread that made it, with a watchdog.
//
// 1. Poll ncclCommGetAsyncError (`mu` is held: we are inside CommHandle::Call) until the
//    state is no longer ncclInProgress: success, or NCCL's error as NcclError says it.
// 2. An abort another thread asked meanwhile (InFlight's timeout, the engine stopping)
//    ends the wait: Call performs it as the calls return.
// 3. Lost members (the rendezvous service, every 100 ms) end it as PeerLost.
// 4. After a second (or half of SPARK_HVD_TIMEOUT_S, if less) this rank writes, once,
//    that it waits in call number N (WaitMarks): the slow path only, no store traffic
//    in steady state.
// 5. At SPARK_HVD_TIMEOUT_S the wait ends as a Timeout that names the members which
//    wrote no such key (those that never reached the call: stuck before it, in their own
//    work or their GPU), and asks the abort (CommHandle::RequestAbort), which Call
//    performs once this call returns: ncclCommAbort, on this thread, overlapping no call.
#include <algorithm>
#include <chrono>
#include <sstream>
#include <thread>

#include "backends/nccl/communicator.h"
#include "common/env.h"
#include "common/logging.h"

namespace spark_hvd {
namespace nccl {

Status NcclCommunicator::Settle(const char* what) const {
  using Clock = std::chrono::steady_clock;
  const double timeout_s = env::TimeoutS();
  const auto start = Clock::now();
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  const auto mark_at = start + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(std::min(1.0, timeout_s / 2)));
  auto next_lost_check = start + std::chrono::milliseconds(100);
  bool marked = false;
  int spins = 0;  // an enqueue in progress usually ends within microseconds: yield first
  auto pause = std::chrono::microseconds(20);
  const std::string where = std::string("NCCL ") + what + " on rank " +
                            std::to_string(options_.rank) + " (process set " +
                            std::to_string(set_id_) + ")";
  while (true) {
    ncclResult_t state = ncclSuccess;  // (1)
    const ncclResult_t rc = nccl_->CommGetAsyncError(comm_->comm, &state);
    if (rc != ncclSuccess) state = rc;
    if (state != ncclInProgress) {
      return NcclError(nccl_, state, where + " failed", nccl_->GetLastError(comm_->comm));
    }
    if (comm_->abort_requested()) return Aborted();  // (2)
    const auto now = Clock::now();
    if (!marked && now >= mark_at && options_.store) {  // (4)
      marked = true;
      marks_->Note(std::to_string(calls_made_), where);
    }
    if (now >= next_lost_check) {  // (3)
      next_lost_check = now + std::chrono::milliseconds(100);
      const std::vector<int32_t> lost = MembersLost();
      if (!lost.empty()) {
        Status s = Status::PeerLost(where +
                                        " stopped waiting: the rendezvous service lost "
                                        "rank(s) " +
                                        JoinRanks(lost),
                                    lost);
        comm_->RequestAbort(s);
        return s;
      }
    }
    if (now > deadline) {  // (5)
      std::vector<int32_t> silent;
      const std::string who =
          marks_->WhoIsMissing(std::to_string(calls_made_), kAllWaitInTheCall, &silent);
      std::ostringstream secs;
      secs << timeout_s;
      Status s(StatusCode::kTimeout,
               where + " waited SPARK_HVD_TIMEOUT_S=" + secs.str() + " s for its peers: " + who +
                   "; its communicator was aborted",
               silent);
      SHVD_LOG(kWarning, "nccl") << s.message();
      comm_->RequestAbort(s);
      return s;
    }
    if (++spins <= 200) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

}  // namespace nccl
}  // namespace spark_hvd
