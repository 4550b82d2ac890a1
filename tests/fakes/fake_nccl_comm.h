// One rank's side of a fake NCCL communicator (fake_nccl_comm.cc): the checks a call
// gets when made, and what its stream runs later: ship the inputs to the coordinator,
// wait for the results (or for ncclCommAbort), write the outputs. Its connection's
// reader thread turns the coordinator's messages into results and async errors.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fake_nccl_wire.h"

namespace shvd_fake {

// Sets what ncclGetLastError(NULL) says (LastErrorText) and returns code.
ncclResult_t Fail(ncclResult_t code, const std::string& message);
std::string LastErrorText();

struct UserOp {
  int dtype;
  uint64_t scalar;         // ncclScalarHostImmediate: the value's bytes
  const void* scalar_ptr;  // ncclScalarDevice: read when the collective runs
};

// One call, as checked when made.
struct Call {
  OpDesc desc;
  const void* send = nullptr;
  size_t send_bytes = 0;
  void* recv = nullptr;
  size_t recv_bytes = 0;
  const void* scalar_ptr = nullptr;
  cudaStream_t stream = nullptr;
};

struct Part;

class Comm {
 public:
  Comm(int fd, int rank, int nranks, int device, int home)
      : rank(rank),
        nranks(nranks),
        device(device),
        home(home),
        send_seq_(nranks),
        recv_seq_(nranks),
        fd_(fd) {
    reader_ = std::thread([this] { ReadLoop(); });
  }
  const int rank, nranks, device, home;

  // ncclSuccess, or the comm's async error (after SHVD_FAKE_NCCL_STUCK_CALL_MS, as a call
  // stuck on a broken connection returns only after its own timeout).
  ncclResult_t Ready(const char* fn);
  // SHVD_FAKE_NCCL_FAIL_CALL: this comm fails as a real one would on this rank (a system
  // call, a GPU, a peer): its queued and running ops block their streams until
  // ncclCommAbort, as after a lost peer, and the next call on it finds `code` (then its
  // async error): the failure is seen once the engine made its next call, whatever the
  // timing.
  void Inject(ncclResult_t code);

  // One thread at a time may be inside a call on a comm (NCCL is not thread-safe per
  // communicator): Enter records `fn` as the call in progress and fails (on stderr too)
  // when another thread is inside one; Leave ends it.
  bool Enter(const char* fn);
  void Leave();
  ncclResult_t AsyncError() {
    std::lock_guard<std::mutex> lock(mu_);
    if (hung_ && !dead_ && async_error_ == ncclSuccess) return ncclInProgress;
    return async_error_;
  }
  // ncclCommInitRankConfig with blocking = 0: a call that cannot finish returns
  // ncclInProgress instead of blocking (Hang).
  std::atomic<bool> nonblocking{false};
  // SHVD_FAKE_NCCL_HANG_CALL: a call whose peers never come (as NCCL connecting to a peer
  // that never makes the call): blocking, it returns only once another thread aborted the
  // comm (an overlap, reported by Enter); non-blocking, it returns ncclInProgress and
  // the comm's async error stays ncclInProgress until ncclCommAbort. `entered`: the
  // calling thread is inside a call on this comm already (else Hang enters for it).
  ncclResult_t Hang(const char* fn, bool entered);
  std::string LastError() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_error_;
  }

  ncclResult_t Prepare(uint8_t kind, const void* send, void* recv, size_t count, int dtype, int op,
                       int peer, cudaStream_t stream, Call* call);
  ncclResult_t AddOp(int dtype, uint64_t scalar, const void* scalar_ptr, ncclRedOp_t* op);
  ncclResult_t DestroyOp(ncclRedOp_t op);

  // Called at ncclGroupEnd: numbers the part's calls and counts it as queued.
  bool Issue(Part* part);
  bool Ship(Part* part);   // on the stream: false if it must not wait for results
  void Await(Part* part);  // on the stream: waits, then writes outputs
  void Finish();           // on the stream: the part is done

  void Destroy();
  void Abort();

 private:
  void SetError(ncclResult_t code, const std::string& message) {  // under mu_
    if (async_error_ == ncclSuccess) {
      async_error_ = code;
      last_error_ = message;
      Fail(code, "rank " + std::to_string(rank) + ": " + message);
    }
    cv_.notify_all();
  }
  void ReadLoop();
  ncclResult_t CheckBuffer(const char* fn, const char* what, const void* p, size_t bytes);

  std::mutex mu_;
  std::condition_variable cv_;
  ncclResult_t async_error_ = ncclSuccess;
  std::string last_error_;
  bool dead_ = false;  // destroyed or aborted
  bool aborted_ = false;
  bool hung_ = false;      // Hang on a non-blocking comm: in progress until abort
  bool injected_ = false;  // Inject: ops block until abort
  ncclResult_t injected_code_ = ncclSuccess;  // the async error from the next call on
  std::atomic<const char*> in_call_{nullptr};
  bool closing_ = false;  // ncclCommDestroy sent kBye
  bool coordinator_gone_ = false;
  bool home_departed_ = false;
  bool reader_done_ = false;
  int inflight_ = 0;  // issued parts not finished
  uint64_t next_unit_ = 1, coll_seq_ = 0;
  std::vector<uint64_t> send_seq_, recv_seq_;
  struct Pending {
    size_t remaining;
    std::vector<std::pair<int32_t, std::string>> results;  // status, data
  };
  std::map<uint64_t, Pending> pending_;
  std::map<int, UserOp> user_ops_;

  std::mutex send_mu_;  // guards writes to fd_ and closing it
  int fd_;
  std::thread reader_;
};

struct Part {
  std::shared_ptr<Comm> comm;
  std::vector<Call> calls;
  uint64_t unit = 0;
  bool shipped = false;
};

struct Unit {
  std::vector<Part> parts;
};

// The shvd_fake_work_fn a stream runs for a Unit (which it deletes).
void RunUnit(void* arg);

}  // namespace shvd_fake
