// The rank side of the fake NCCL (see fake_nccl_comm.h).
#include "fake_nccl_comm.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "fake_internal.h"

namespace shvd_fake {
namespace {

// What ncclGetLastError(NULL) says; leaked, so stream workers may still set it at exit.
struct LastError {
  std::mutex mu;
  std::string text;
};
LastError& Last() {
  static LastError* last = new LastError;
  return *last;
}

}  // namespace

ncclResult_t Fail(ncclResult_t code, const std::string& message) {
  std::lock_guard<std::mutex> lock(Last().mu);
  Last().text = message;
  return code;
}

std::string LastErrorText() {
  std::lock_guard<std::mutex> lock(Last().mu);
  return Last().text;
}

namespace {

int EnvInt(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : 0;
}

}  // namespace

ncclResult_t Comm::Ready(const char* fn) {
  ncclResult_t error;
  std::string text;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (injected_code_ != ncclSuccess && async_error_ == ncclSuccess) {  // see Inject
      SetError(injected_code_,
               "fake NCCL: SHVD_FAKE_NCCL_FAIL_CALL injected this failure on "
               "rank " +
                   std::to_string(rank) +
                   " (as a system call, a GPU or "
                   "a peer failing)");
    }
    if (async_error_ == ncclSuccess) return ncclSuccess;
    error = async_error_;
    text = last_error_;
  }
  static const int stuck_ms = EnvInt("SHVD_FAKE_NCCL_STUCK_CALL_MS");
  if (stuck_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(stuck_ms));
  return Fail(error, std::string(fn) + ": the communicator has an error: " + text);
}

void Comm::Inject(ncclResult_t code) {
  std::lock_guard<std::mutex> lock(mu_);
  injected_ = true;
  injected_code_ = code;
}

bool Comm::Enter(const char* fn) {
  const char* other = nullptr;
  if (in_call_.compare_exchange_strong(other, fn)) return true;
  std::fprintf(stderr,
               "fake NCCL: rank %d: %s on a communicator while another thread is inside "
               "%s: NCCL calls on one communicator must not overlap (it is not thread-safe)\n",
               rank, fn, other);
  Fail(ncclInvalidUsage,
       std::string(fn) + " while another thread is inside " + other + " on the same communicator");
  return false;
}

void Comm::Leave() { in_call_ = nullptr; }

ncclResult_t Comm::Hang(const char* fn, bool entered) {
  if (nonblocking) {
    std::lock_guard<std::mutex> lock(mu_);
    hung_ = true;
    return ncclInProgress;
  }
  if (!entered && !Enter(fn)) return ncclInvalidUsage;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return dead_; });
  }
  if (!entered) Leave();
  return Fail(ncclInvalidUsage, std::string(fn) +
                                    ": the communicator was aborted while the "
                                    "call waited for its peers (SHVD_FAKE_NCCL_HANG_CALL)");
}

void RunUnit(void* arg) {
  std::unique_ptr<Unit> unit(static_cast<Unit*>(arg));
  for (auto& p : unit->parts) p.shipped = p.comm->Ship(&p);
  for (auto& p : unit->parts) {
    if (p.shipped) p.comm->Await(&p);
    p.comm->Finish();
  }
}

ncclResult_t Comm::CheckBuffer(const char* fn, const char* what, const void* p, size_t bytes) {
  if (bytes == 0) return ncclSuccess;
  int dev = -1;
  if (shvd_fake_memory_kind(p, bytes, &dev) != kShvdFakeDevice) {
    char where[32];
    std::snprintf(where, sizeof where, "%p", p);
    return Fail(ncclInvalidArgument, std::string(fn) + ": " + what + " " + where + " (" +
                                         std::to_string(bytes) +
                                         " bytes) is not inside one cudaMalloc allocation (host "
                                         "or pinned memory, or past its end)");
  }
  if (dev != device) {
    return Fail(ncclInvalidArgument, std::string(fn) + ": " + what + " allocated on device " +
                                         std::to_string(dev) + " mismatches with NCCL device " +
                                         std::to_string(device));
  }
  return ncclSuccess;
}

ncclResult_t Comm::Prepare(uint8_t kind, const void* send, void* recv, size_t count, int dtype,
                           int op, int peer, cudaStream_t stream, Call* call) {
  const char* fn = OpName(kind);
  const size_t size = DtypeSize(dtype);
  if (size == 0)
    return Fail(ncclInvalidArgument,
                std::string(fn) + ": invalid datatype " + std::to_string(dtype));
  const bool rooted = kind == kBroadcast || kind == kSend || kind == kRecv;
  if (rooted && (peer < 0 || peer >= nranks)) {
    return Fail(ncclInvalidArgument, std::string(fn) + ": " +
                                         (kind == kBroadcast ? "root " : "peer ") +
                                         std::to_string(peer) + " out of range for " +
                                         std::to_string(nranks) + " ranks");
  }
  OpDesc& d = call->desc;
  d.kind = kind;
  d.dtype = dtype;
  d.count = count;
  d.peer = rooted ? peer : 0;
  if (kind == kAllReduce || kind == kReduceScatter) {
    std::lock_guard<std::mutex> lock(mu_);
    if (op < 0)
      return Fail(ncclInvalidArgument, std::string(fn) + ": invalid op " + std::to_string(op));
    d.red = op;
    if (op >= ncclNumOps) {
      auto it = user_ops_.find(op);
      if (it == user_ops_.end()) {
        return Fail(ncclInvalidArgument,
                    std::string(fn) + ": op " + std::to_string(op) +
                        " is unknown to this communicator (destroyed, or made for another one)");
      }
      if (it->second.dtype != dtype) {
        return Fail(ncclInvalidArgument, std::string(fn) + ": datatype " + DtypeName(dtype) +
                                             " does not match the " + DtypeName(it->second.dtype) +
                                             " the op was made for");
      }
      d.red = kPreMulSum;
      d.scalar = it->second.scalar;
      call->scalar_ptr = it->second.scalar_ptr;
    }
  }
  size_t bytes = 0, all_bytes = 0;
  if (__builtin_mul_overflow(count, size, &bytes) ||
      __builtin_mul_overflow(bytes, size_t(nranks), &all_bytes)) {
    return Fail(ncclInvalidArgument,
                std::string(fn) + ": count " + std::to_string(count) + " is too large");
  }
  const bool sends = kind != kRecv && (kind != kBroadcast || peer == rank);
  call->send = send;
  call->send_bytes = !sends ? 0 : kind == kReduceScatter ? all_bytes : bytes;
  call->recv = recv;
  call->recv_bytes = kind == kSend ? 0 : kind == kAllGather ? all_bytes : bytes;
  call->stream = stream;
  ncclResult_t rc = CheckBuffer(fn, "sendbuff", send, call->send_bytes);
  if (rc == ncclSuccess) rc = CheckBuffer(fn, "recvbuff", recv, call->recv_bytes);
  if (rc != ncclSuccess) return rc;
  // What the stream reads and writes: the device memory's read-write mapping.
  call->send = shvd_fake_view(send);
  call->recv = static_cast<void*>(shvd_fake_view(recv));
  if (call->scalar_ptr) call->scalar_ptr = shvd_fake_view(call->scalar_ptr);
  int stream_device = -1;
  if (shvd_fake_stream_device(stream, &stream_device) != cudaSuccess) {
    return Fail(ncclUnhandledCudaError, std::string(fn) + ": invalid stream (destroyed?)");
  }
  if (stream && stream_device != device) {
    return Fail(ncclUnhandledCudaError,
                std::string(fn) + ": the stream is on device " + std::to_string(stream_device) +
                    ", the communicator on device " + std::to_string(device));
  }
  return ncclSuccess;
}

ncclResult_t Comm::AddOp(int dtype, uint64_t scalar, const void* scalar_ptr, ncclRedOp_t* op) {
  static std::atomic<int> next{ncclNumOps};  // process-wide: another comm's op is foreign
  std::lock_guard<std::mutex> lock(mu_);
  *op = next++;
  user_ops_[*op] = UserOp{dtype, scalar, scalar_ptr};
  return ncclSuccess;
}

ncclResult_t Comm::DestroyOp(ncclRedOp_t op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (user_ops_.erase(op)) return ncclSuccess;
  return Fail(ncclInvalidArgument,
              "ncclRedOpDestroy: op " + std::to_string(op) +
                  " is unknown to this communicator (destroyed already, or made for another one)");
}

bool Comm::Issue(Part* part) {
  std::lock_guard<std::mutex> lock(mu_);
  if (dead_) return false;
  for (Call& c : part->calls) {
    OpDesc& d = c.desc;
    d.seq = d.kind == kSend   ? send_seq_[d.peer]++
            : d.kind == kRecv ? recv_seq_[d.peer]++
                              : coll_seq_++;
  }
  part->unit = next_unit_++;
  ++inflight_;
  return true;
}

bool Comm::Ship(Part* part) {
  std::unique_lock<std::mutex> lock(mu_);
  if (coordinator_gone_ && async_error_ == ncclSuccess) {
    SetError(home_departed_ ? ncclInvalidUsage : ncclRemoteError,
             "the coordinator (in rank " + std::to_string(home) + "'s process) is gone" +
                 (home_departed_ ? ": that rank destroyed its communicator and its process exited "
                                   "while this rank still had calls to make (it must stay alive "
                                   "until every rank is done)"
                                 : " (its process died?)"));
  }
  if (async_error_ == ncclRemoteError || injected_) {
    cv_.wait(lock, [this] { return aborted_; });  // a kernel spinning on a dead peer
    return false;
  }
  if (aborted_ || async_error_ != ncclSuccess) return false;
  Writer w;
  w.Put<uint64_t>(part->unit).Put<uint32_t>(uint32_t(part->calls.size()));
  for (const Call& c : part->calls) {
    OpDesc d = c.desc;
    if (c.scalar_ptr) std::memcpy(&d.scalar, c.scalar_ptr, DtypeSize(d.dtype));
    w.Desc(d).Bytes(c.send, c.send_bytes);
  }
  pending_[part->unit] =
      Pending{part->calls.size(), std::vector<std::pair<int32_t, std::string>>(part->calls.size())};
  lock.unlock();
  std::lock_guard<std::mutex> send_lock(send_mu_);
  if (fd_ >= 0) SendFrame(fd_, kOps, w.data());  // a failure shows as a closed connection
  return true;
}

void Comm::Await(Part* part) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return aborted_ || pending_[part->unit].remaining == 0; });
  auto node = pending_.extract(part->unit);
  if (aborted_) return;
  for (size_t i = 0; i < part->calls.size(); ++i) {
    const Call& c = part->calls[i];
    const auto& result = node.mapped().results[i];
    if (result.first != ncclSuccess) continue;
    if (result.second.size() != c.recv_bytes) {
      SetError(ncclInternalError, "fake NCCL: got " + std::to_string(result.second.size()) +
                                      " bytes for " + Describe(c.desc));
      continue;
    }
    if (c.recv_bytes) std::memcpy(c.recv, result.second.data(), c.recv_bytes);
  }
}

void Comm::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  --inflight_;
  cv_.notify_all();
}

void Comm::ReadLoop() {
  MsgType type;
  std::string payload;
  bool acked = false;
  while (!acked && RecvFrame(fd_, &type, &payload)) {
    Reader r(payload);
    std::lock_guard<std::mutex> lock(mu_);
    if (type == kResult) {
      uint64_t unit = r.Get<uint64_t>();
      uint32_t index = r.Get<uint32_t>();
      int32_t status = r.Get<int32_t>();
      std::string data = r.Str();
      auto it = pending_.find(unit);
      if (r.ok() && it != pending_.end() && index < it->second.results.size()) {
        it->second.results[index] = {status, std::move(data)};
        --it->second.remaining;
        cv_.notify_all();
      }
    } else if (type == kFail) {
      int32_t code = r.Get<int32_t>();
      SetError(code, r.Str());
    } else if (type == kDeparted) {
      if (r.Get<int32_t>() == home) home_departed_ = true;
    } else if (type == kByeAck) {
      acked = true;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  coordinator_gone_ = true;
  reader_done_ = true;
  // Parts whose results all arrived are complete, even if their stream has not
  // collected them yet.
  const bool waiting = std::any_of(pending_.begin(), pending_.end(),
                                   [](const auto& kv) { return kv.second.remaining > 0; });
  if (!acked && !closing_ && !aborted_ && (!home_departed_ || waiting)) {
    SetError(
        home_departed_ ? ncclInvalidUsage : ncclRemoteError,
        "lost the connection to the coordinator in rank " + std::to_string(home) + "'s process" +
            (home_departed_
                 ? ": that rank destroyed its communicator and its "
                   "process exited while this rank still waited for results (it must stay alive "
                   "until every rank is done)"
                 : " (it died?)"));
    if (home_departed_) {  // these can never complete: let their streams move on
      for (auto& kv : pending_) {
        if (kv.second.remaining == 0) continue;
        for (auto& res : kv.second.results) res.first = ncclInvalidUsage;
        kv.second.remaining = 0;
      }
    }
  }
  cv_.notify_all();
}

void Comm::Destroy() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    dead_ = true;
    if (async_error_ == ncclRemoteError && inflight_ > 0) {
      std::fprintf(stderr,
                   "fake NCCL: rank %d: ncclCommDestroy waits for %d calls that wait for "
                   "a lost peer: it blocks forever, as real NCCL does; call ncclCommAbort on a "
                   "communicator with ncclRemoteError\n",
                   rank, inflight_);
    }
    cv_.wait(lock, [this] { return inflight_ == 0; });
    closing_ = true;
  }
  {
    std::lock_guard<std::mutex> send_lock(send_mu_);
    if (!SendFrame(fd_, kBye, std::string())) ::shutdown(fd_, SHUT_RDWR);
  }
  reader_.join();
  std::lock_guard<std::mutex> send_lock(send_mu_);
  ::close(fd_);
  fd_ = -1;
}

void Comm::Abort() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    dead_ = aborted_ = true;
    cv_.notify_all();
  }
  {
    std::lock_guard<std::mutex> send_lock(send_mu_);
    SendFrame(fd_, kAbort, std::string());
    ::shutdown(fd_, SHUT_WR);  // the coordinator closes its side in answer
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::seconds(2), [this] { return reader_done_; }))
      ::shutdown(fd_, SHUT_RDWR);  // a coordinator that does not answer: do not hang
  }
  reader_.join();
  std::lock_guard<std::mutex> send_lock(send_mu_);
  ::close(fd_);
  fd_ = -1;
}

}  // namespace shvd_fake
