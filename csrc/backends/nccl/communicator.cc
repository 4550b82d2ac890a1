#include "backends/nccl/communicator.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <thread>

#include "backends/host_reduce.h"
#include "backends/members.h"
#include "backends/cuda/util.h"
#include "common/env.h"
#include "common/half.h"
#include "common/logging.h"
#include "common/reduce.h"

namespace spark_hvd {
namespace nccl {
namespace {

// NCCL's type for a spark_hvd dtype (bool travels as uint8); false for int16.
bool NcclType(DataType d, ncclDataType_t* out) {
  switch (d) {
    case DataType::kUInt8: *out = ncclUint8; return true;
    case DataType::kBool: *out = ncclUint8; return true;
    case DataType::kInt8: *out = ncclInt8; return true;
    case DataType::kInt32: *out = ncclInt32; return true;
    case DataType::kInt64: *out = ncclInt64; return true;
    case DataType::kFloat16: *out = ncclFloat16; return true;
    case DataType::kBFloat16: *out = ncclBfloat16; return true;
    case DataType::kFloat32: *out = ncclFloat32; return true;
    case DataType::kFloat64: *out = ncclFloat64; return true;
    default: return false;
  }
}

ncclRedOp_t BaseOp(ReduceOp op, DataType d) {
  const bool logical = d == DataType::kBool;
  switch (op) {
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kProduct: return logical ? ncclMin : ncclProd;
    default: return logical ? ncclMax : ncclSum;  // Sum, Average
  }
}

// The PreMulSum scalar: `factor` as a host value of the tensors' dtype.
std::vector<uint8_t> Scalar(double factor, DataType d) {
  std::vector<uint8_t> out(DataTypeSize(d));
  if (d == DataType::kFloat16) {
    const uint16_t h = FloatToHalf(static_cast<float>(factor));
    std::memcpy(out.data(), &h, 2);
  } else if (d == DataType::kBFloat16) {
    const uint16_t b = FloatToBFloat16(static_cast<float>(factor));
    std::memcpy(out.data(), &b, 2);
  } else if (d == DataType::kFloat32) {
    const float f = static_cast<float>(factor);
    std::memcpy(out.data(), &f, 4);
  } else {
    std::memcpy(out.data(), &factor, 8);
  }
  return out;
}

class Work : public PendingWork {
 public:
  Work(const cuda::CudaApi* cuda, std::shared_ptr<CommHandle> comm, int32_t device, cudaEvent_t event,
       std::vector<std::vector<uint8_t>> keep)
      : cuda_(cuda), comm_(std::move(comm)), device_(device), event_(event),
        keep_(std::move(keep)) {}
  ~Work() override { cuda_->EventDestroy(event_); }

  bool Poll(Status* status) override {
    const cudaError_t q = cuda::QueryOnDevice(cuda_, device_, event_);
    if (q == cudaSuccess) {
      *status = Status::OK();
      return true;
    }
    if (q != cudaErrorNotReady) {
      *status = Status::Internal(std::string("CUDA error while a collective ran: ") +
                                 cuda_->GetErrorString(q));
      return true;
    }
    if (comm_->aborted) {
      *status = Status::PeerLost("the NCCL communicator was aborted");
      return true;
    }
    Status failure = comm_->AsyncFailure();
    if (failure.ok()) return false;
    *status = failure;
    return true;
  }
  void Abort() override { comm_->Abort(); }
  bool Quiesced() override { return cuda::QueryOnDevice(cuda_, device_, event_) != cudaErrorNotReady; }

 private:
  const cuda::CudaApi* cuda_;
  std::shared_ptr<CommHandle> comm_;
  int32_t device_;
  cudaEvent_t event_;
  std::vector<std::vector<uint8_t>> keep_;  // host memory queued copies read or write
};

}  // namespace

Status CommHandle::AsyncFailure() {
  // The engine thread may be inside an NCCL call on the communicator (one that
  // blocks, even): ask again later rather than wait, so the callers' deadlines run.
  std::unique_lock<std::timed_mutex> lock(mu, std::try_to_lock);
  if (!lock.owns_lock() || aborted) return Status::OK();
  ncclResult_t async = ncclSuccess;
  nccl->CommGetAsyncError(comm, &async);
  if (async == ncclSuccess || async == ncclInProgress) return Status::OK();
  return Status::PeerLost(std::string("NCCL reported ") + nccl->GetErrorString(async) + ": " +
                          nccl->GetLastError(comm) + " (a peer failed or left)");
}

void CommHandle::Abort() {
  if (aborted) return;
  std::unique_lock<std::timed_mutex> lock(mu, std::defer_lock);
  (void)lock.try_lock_for(std::chrono::seconds(5));  // see the struct's comment
  if (comm == nullptr || aborted.exchange(true)) return;
  nccl->CommAbort(comm);
}

CommHandle::~CommHandle() {
  if (!aborted && comm != nullptr) nccl->CommDestroy(comm);
}

NcclCommunicator::NcclCommunicator(const BackendOptions& options, std::vector<int32_t> members,
                                   int32_t set_id, const cuda::CudaApi* cuda, const cuda::NcclApi* nccl)
    : options_(options),
      members_(std::move(members)),
      set_id_(set_id),
      rank_(MemberRank(members_, options.rank)),
      cuda_(cuda),
      nccl_(nccl) {}

NcclCommunicator::~NcclCommunicator() {
  // Neither waits here: the stream's resources go once its work is done, and
  // FreeLater's cudaFree waits for the device (work in flight holds the comm).
  if (stream_ != nullptr) cuda_->StreamDestroy(stream_);
  if (fusion_ != nullptr) cuda::FreeLater(cuda_, device_, fusion_);
  comm_.reset();
}

void NcclCommunicator::Abort() {
  if (comm_) comm_->Abort();
}

Status NcclCommunicator::Aborted() const {
  return Status::PeerLost("the NCCL communicator of rank " + std::to_string(options_.rank) +
                          " (process set " + std::to_string(set_id_) +
                          ") was aborted after a GPU collective failed or timed out");
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

Status NcclCommunicator::OnComm(const std::function<Status()>& calls) {
  std::lock_guard<std::timed_mutex> lock(comm_->mu);
  if (comm_->aborted) return Aborted();
  return calls();
}

Status NcclCommunicator::WaitForStream() {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(env::TimeoutS());
  auto next_lost_check = std::chrono::steady_clock::now();
  Status s = cuda::WaitPolling(cuda_, stream_, [&]() -> Status {
    if (comm_->aborted) return Aborted();
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
      return Status::Timeout("a GPU collective did not finish within SPARK_HVD_TIMEOUT_S on "
                             "rank " + std::to_string(options_.rank) +
                             "; its communicator was aborted (a peer, or this rank's GPU, may "
                             "be stuck)");
    }
    return Status::OK();
  });
  if (!s.ok()) comm_->Abort();  // the stream's kernels wait no more
  return s;
}

Status NcclCommunicator::CudaCheck(cudaError_t err, const char* what) const {
  return cuda::CudaStatus(cuda_, err, std::string(what) + " on rank " + std::to_string(options_.rank));
}

Status NcclCommunicator::NcclCheck(ncclResult_t err, const char* what) const {
  if (err == ncclSuccess || err == ncclInProgress) return Status::OK();
  std::string detail = comm_ && comm_->comm ? nccl_->GetLastError(comm_->comm) : "";
  std::string msg = std::string("NCCL ") + what + " failed on rank " +
                    std::to_string(options_.rank) + ": " + nccl_->GetErrorString(err) +
                    (detail.empty() ? "" : " (" + detail + ")");
  if (err == ncclInvalidArgument || err == ncclInvalidUsage) return Status::InvalidArgument(msg);
  // This rank's own CUDA or NCCL failed (no driver, a GPU fault...): not a lost peer.
  if (err == ncclUnhandledCudaError) {
    return Status::Internal(msg + "; a CUDA error on this rank: check that its GPU is visible "
                                  "(CUDA_VISIBLE_DEVICES) and the NVIDIA driver loads");
  }
  if (err == ncclInternalError) return Status::Internal(msg);
  // ncclSystemError, ncclRemoteError: the network or another rank.
  return Status::PeerLost(msg);
}

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
  SHVD_LOG(kDebug, "nccl") << "rank " << rank_ << " of " << size() << " (set " << set_id_
                           << ") on GPU " << device;
  return Status::OK();
}

// ncclCommInitRank blocks until every member joins, and a member that died (or
// failed before it) never does. So it runs on a thread of its own while this one
// watches: a member the rendezvous service reports lost, or the start deadline
// (SPARK_HVD_START_TIMEOUT_S), ends the wait with an error instead of a hang; the
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
    const ncclResult_t result = nccl->CommInitRank(&comm, n, id, r);
    std::lock_guard<std::mutex> lock(init->mu);
    if (init->abandoned) {
      if (result == ncclSuccess) nccl->CommAbort(comm);
      return;
    }
    handle->comm = result == ncclSuccess ? comm : nullptr;
    init->result = result;
    init->done = true;
    init->cv.notify_all();
  }).detach();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(options_.connect_timeout_s);
  std::unique_lock<std::mutex> lock(init->mu);
  while (!init->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return init->done; })) {
    const std::vector<int32_t> lost = MembersLost();
    if (!lost.empty()) {
      init->abandoned = true;
      return Status::PeerLost("ncclCommInitRank on rank " + std::to_string(options_.rank) +
                                  " stopped waiting: the rendezvous service lost rank(s) " +
                                  JoinRanks(lost),
                              lost);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      init->abandoned = true;
      return Status::Timeout("ncclCommInitRank on rank " + std::to_string(options_.rank) +
                             " waited " + std::to_string(options_.connect_timeout_s) +
                             " s (SPARK_HVD_START_TIMEOUT_S) for the other ranks of the GPU "
                             "communicator; one failed before its first GPU op or is stuck");
    }
  }
  return NcclCheck(init->result, "ncclCommInitRank");
}

Status NcclCommunicator::Prepare(int32_t device, const std::vector<void*>& streams) {
  if (device < 0) device = device_;  // this rank joined: its device from before
  if (device < 0) {
    return Status::InvalidArgument(
        "this rank has no GPU tensor in this operation and has run no GPU operation before "
        "(it joined first), so it cannot take part on the GPU");
  }
  if (!comm_) {
    Status s = Connect(device);
    if (!s.ok()) return s;
  } else if (comm_->aborted) {
    return Aborted();
  } else if (device != device_) {
    return Status::InvalidArgument("NCCL takes one GPU per rank: this rank used GPU " +
                                   std::to_string(device_) + " and now GPU " +
                                   std::to_string(device) + "; keep each rank on one device");
  }
  Status s = CudaCheck(cuda_->SetDevice(device_), "cudaSetDevice");
  if (s.ok()) s = cuda::WaitForStreams(cuda_, stream_, streams);  // the inputs are ready there
  keep_.clear();
  return s;
}

std::unique_ptr<PendingWork> NcclCommunicator::TakePending() {
  if (!queued_) return nullptr;
  queued_ = false;
  cudaEvent_t done = cuda::EventAfterQueuedWork(cuda_, stream_);
  if (done == nullptr) {
    keep_.clear();
    return nullptr;
  }
  return std::make_unique<Work>(cuda_, comm_, device_, done, std::move(keep_));
}

Status NcclCommunicator::Allocate(int64_t bytes, Buffer* out) {
  return cuda::AllocateDevice(cuda_, device_, bytes, out);
}

Status NcclCommunicator::DeviceBuffer(size_t bytes, void** out) {
  if (fusion_bytes_ < bytes) {
    if (fusion_ != nullptr) {
      // Work queued earlier may still use it: FreeLater's cudaFree waits for it.
      cuda::FreeLater(cuda_, device_, fusion_);
      fusion_ = nullptr;
    }
    Status s = CudaCheck(cuda_->Malloc(&fusion_, bytes), "cudaMalloc (fusion buffer)");
    if (!s.ok()) return s;
    fusion_bytes_ = bytes;
  }
  *out = fusion_;
  return Status::OK();
}

Status NcclCommunicator::Copy(void* dst, const void* src, int64_t bytes) {
  if (bytes == 0 || dst == src) return Status::OK();
  queued_ = true;
  return CudaCheck(cuda_->MemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                      cudaMemcpyDeviceToDevice, stream_),
                   "cudaMemcpyAsync");
}

// The NCCL op for a reduction NCCL expresses in one call, handed to `run`: its own
// (Sum, Min, Max, Product; float Sum/Average unscaled), or, for scale factors and float
// Average, a premultiplied sum made for the call and destroyed after it. False, running
// nothing, for what it cannot express (integer Average, scaled Min/Max/Product).
bool NcclCommunicator::WithNcclOp(const ReduceArgs& a, ncclDataType_t dtype,
                                  const std::function<Status(ncclRedOp_t)>& run,
                                  Status* status) {
  const bool is_float = IsFloatingPoint(a.dtype);
  const double factor = a.prescale * a.postscale /
                        (a.op == ReduceOp::kAverage ? static_cast<double>(a.ranks) : 1.0);
  const bool sum_like = a.op == ReduceOp::kSum || a.op == ReduceOp::kAverage;
  if (sum_like && is_float && factor != 1.0) {  // scale factors and Average: one premultiply
    std::vector<uint8_t> scalar = Scalar(factor, a.dtype);
    ncclRedOp_t op;
    *status = OnComm([&] {
      return NcclCheck(nccl_->RedOpCreatePreMulSum(&op, scalar.data(), dtype,
                                                   ncclScalarHostImmediate, comm_->comm),
                       "ncclRedOpCreatePreMulSum");
    });
    if (!status->ok()) return true;
    *status = run(op);
    OnComm([&] {
      nccl_->RedOpDestroy(op, comm_->comm);
      return Status::OK();
    });
    return true;
  }
  if ((sum_like && is_float) ||
      (a.prescale == 1.0 && a.postscale == 1.0 && a.op != ReduceOp::kAverage)) {
    *status = run(BaseOp(a.op, a.dtype));
    return true;
  }
  return false;
}

// Equal blocks: one ncclReduceScatter, where NCCL expresses the reduction in one call.
bool NcclCommunicator::ReducescatterBlocks(const ReduceArgs& a, int64_t block, void* out,
                                           Status* status) {
  ncclDataType_t dtype;
  if (a.tensors.size() != 1 || a.tensors[0].input == nullptr || !NcclType(a.dtype, &dtype)) {
    return false;
  }
  const void* in = a.tensors[0].input;
  const bool done = WithNcclOp(a, dtype, [&](ncclRedOp_t op) {
    return OnComm([&] {
      return NcclCheck(nccl_->ReduceScatter(in, out, static_cast<size_t>(block), dtype, op,
                                            comm_->comm, stream_),
                       "ncclReduceScatter");
    });
  }, status);
  queued_ = queued_ || (done && status->ok());
  return done;
}

Status NcclCommunicator::Allreduce(const ReduceArgs& a) {
  ncclDataType_t dtype;
  if (!NcclType(a.dtype, &dtype)) {
    return Status::InvalidArgument(std::string("NCCL has no ") + DataTypeName(a.dtype) +
                                   " type; cast the GPU tensor (e.g. to int32) first");
  }
  size_t count = 0;
  for (const auto& t : a.tensors) count += static_cast<size_t>(t.count);
  Status s;
  if (!WithNcclOp(a, dtype, [&](ncclRedOp_t op) { return Native(a, dtype, op, count); }, &s)) {
    s = Staged(a, dtype, BaseOp(a.op, a.dtype), count);
  }
  queued_ = queued_ || s.ok();
  return s;
}

// One NCCL reduction with `op`: a lone tensor straight from input to output, several
// through the fusion buffer. A joined rank's tensors are the op's neutral value.
Status NcclCommunicator::Native(const ReduceArgs& a, ncclDataType_t dtype, ncclRedOp_t op,
                                size_t count) {
  const size_t dsize = DataTypeSize(a.dtype);
  if (a.tensors.size() == 1 && a.tensors[0].input != nullptr) {
    const ReduceTensor& t = a.tensors[0];
    return OnComm([&] {
      return NcclCheck(nccl_->AllReduce(t.input, t.output, count, dtype, op, comm_->comm, stream_),
                       "ncclAllReduce");
    });
  }
  void* buf;
  Status s = DeviceBuffer(std::max<size_t>(count * dsize, 1), &buf);
  size_t offset = 0;
  for (const auto& t : a.tensors) {
    if (!s.ok()) return s;
    const size_t bytes = static_cast<size_t>(t.count) * dsize;
    char* dst = static_cast<char*>(buf) + offset;
    if (t.input != nullptr) {
      s = Copy(dst, t.input, static_cast<int64_t>(bytes));
    } else {  // joined: zeros (Horovod's), from host memory kept until the copy ran
      keep_.emplace_back(bytes);
      s = CudaCheck(cuda_->MemcpyAsync(dst, keep_.back().data(), bytes, cudaMemcpyHostToDevice,
                                       stream_),
                    "cudaMemcpyAsync");
    }
    offset += bytes;
  }
  if (!s.ok()) return s;
  s = OnComm([&] {
    return NcclCheck(nccl_->AllReduce(buf, buf, count, dtype, op, comm_->comm, stream_),
                     "ncclAllReduce");
  });
  offset = 0;
  for (const auto& t : a.tensors) {
    if (!s.ok()) return s;
    const size_t bytes = static_cast<size_t>(t.count) * dsize;
    if (t.output != nullptr) s = Copy(t.output, static_cast<char*>(buf) + offset, static_cast<int64_t>(bytes));
    offset += bytes;
  }
  return s;
}

// What NCCL cannot express, around a plain NCCL reduction in the fusion buffer: the
// inputs come to host memory, are prescaled there, reduced on the GPU, and divided
// and postscaled on the host again. Synchronous: it waits for the stream (earlier
// ops and the producers first, since copies into pageable memory block until they ran).
Status NcclCommunicator::Staged(const ReduceArgs& a, ncclDataType_t dtype, ncclRedOp_t op,
                                size_t count) {
  const size_t dsize = DataTypeSize(a.dtype);
  std::vector<uint8_t> host(count * dsize);
  void* buf;
  Status s = DeviceBuffer(std::max<size_t>(host.size(), 1), &buf);
  if (s.ok()) s = WaitForStream();
  size_t offset = 0;
  for (const auto& t : a.tensors) {
    if (!s.ok()) return s;
    const size_t bytes = static_cast<size_t>(t.count) * dsize;
    if (t.input != nullptr) {
      s = CudaCheck(cuda_->MemcpyAsync(host.data() + offset, t.input, bytes,
                                       cudaMemcpyDeviceToHost, stream_),
                    "cudaMemcpyAsync");
    } else {
      std::memset(host.data() + offset, 0, bytes);  // joined: zeros, as Horovod
    }
    offset += bytes;
  }
  if (s.ok()) s = WaitForStream();
  if (!s.ok()) return s;
  offset = 0;
  for (const auto& t : a.tensors) {  // the neutral values stay unscaled
    if (t.input != nullptr) ScaleBuffer(host.data() + offset, static_cast<size_t>(t.count), a.dtype, a.prescale);
    offset += static_cast<size_t>(t.count) * dsize;
  }
  s = CudaCheck(cuda_->MemcpyAsync(buf, host.data(), host.size(), cudaMemcpyHostToDevice, stream_),
                "cudaMemcpyAsync");
  if (s.ok()) {
    s = OnComm([&] {
      return NcclCheck(nccl_->AllReduce(buf, buf, count, dtype, op, comm_->comm, stream_),
                       "ncclAllReduce");
    });
  }
  // A copy into pageable memory returns only once it ran, so it would wait (with no
  // way out) for a collective stuck on a lost peer: wait here first, where one can.
  if (s.ok()) s = WaitForStream();
  if (s.ok()) {
    s = CudaCheck(cuda_->MemcpyAsync(host.data(), buf, host.size(), cudaMemcpyDeviceToHost,
                                     stream_),
                  "cudaMemcpyAsync");
  }
  if (s.ok()) s = WaitForStream();
  if (!s.ok()) return s;
  ScaleBuffer(host.data(), count, a.dtype, PostFactor(a));
  offset = 0;
  for (const auto& t : a.tensors) {
    if (!s.ok()) return s;
    const size_t bytes = static_cast<size_t>(t.count) * dsize;
    if (t.output != nullptr) {
      s = CudaCheck(cuda_->MemcpyAsync(t.output, host.data() + offset, bytes,
                                       cudaMemcpyHostToDevice, stream_),
                    "cudaMemcpyAsync");
    }
    offset += bytes;
  }
  keep_.push_back(std::move(host));  // read by the copies just queued
  return s;
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
  const bool equal = in != nullptr &&
                     std::all_of(bytes_per_rank.begin(), bytes_per_rank.end(),
                                 [&](int64_t b) { return b == bytes_per_rank[0]; });
  if (equal) {
    return OnComm([&] {
      return NcclCheck(nccl_->AllGather(in, out, static_cast<size_t>(bytes_per_rank[0]),
                                        ncclUint8, comm_->comm, stream_),
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
        s = NcclCheck(nccl_->Broadcast(r == rank_ ? in : nullptr,
                                       static_cast<char*>(out) + offset,
                                       static_cast<size_t>(bytes), ncclUint8, r, comm_->comm,
                                       stream_),
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
        s = NcclCheck(nccl_->Send(static_cast<const char*>(in) + send_off[r],
                                  static_cast<size_t>(send_bytes[r]), ncclUint8, r, comm_->comm,
                                  stream_),
                      "ncclSend (alltoall)");
      }
      if (s.ok() && recv_bytes[r] > 0) {
        s = NcclCheck(nccl_->Recv(static_cast<char*>(out) + recv_off[r],
                                  static_cast<size_t>(recv_bytes[r]), ncclUint8, r, comm_->comm,
                                  stream_),
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
  return std::make_unique<NcclCommunicator>(options_, SplitMembers(members_, ranks), set_id,
                                            cuda_, nccl_);
}

}  // namespace nccl
}  // namespace spark_hvd
