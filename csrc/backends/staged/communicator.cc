#include "backends/staged/communicator.h"

#include <algorithm>

#include "backends/cuda/util.h"

namespace spark_hvd {
namespace {

// The copies back to the GPU, seen through an event behind them.
class CopiesBack : public PendingWork {
 public:
  CopiesBack(const cuda::CudaApi* cuda, int32_t device, cudaEvent_t event,
             std::vector<std::shared_ptr<void>> keep)
      : cuda_(cuda), device_(device), event_(event), keep_(std::move(keep)) {}
  ~CopiesBack() override { cuda_->EventDestroy(event_); }
  bool Poll(Status* status) override {
    const cudaError_t q = cuda::QueryOnDevice(cuda_, device_, event_);
    if (q == cudaErrorNotReady) return false;
    *status = q == cudaSuccess ? Status::OK()
                               : Status::Internal(std::string("CUDA error in a staged copy: ") +
                                                  cuda_->GetErrorString(q));
    return true;
  }
  void Abort() override {}  // host-side copies finish on their own
  bool Quiesced() override {
    return cuda::QueryOnDevice(cuda_, device_, event_) != cudaErrorNotReady;
  }

 private:
  const cuda::CudaApi* cuda_;
  int32_t device_;
  cudaEvent_t event_;
  std::vector<std::shared_ptr<void>> keep_;  // pinned buffers the copies read
};

}  // namespace

StagedCommunicator::StagedCommunicator(std::unique_ptr<Communicator> host,
                                       const cuda::CudaApi* cuda)
    : host_(std::move(host)), cuda_(cuda) {}

StagedCommunicator::~StagedCommunicator() {
  // No wait: the stream's resources go once its work is done, and the pinned
  // buffers that work reads are held by its InFlight item.
  if (stream_ != nullptr) cuda_->StreamDestroy(stream_);
}

void StagedCommunicator::Abort() { host_->Abort(); }

Status StagedCommunicator::Check(cudaError_t err, const char* what) const {
  return cuda::CudaStatus(cuda_, err, std::string(what) + " (staged GPU op)");
}

Status StagedCommunicator::Prepare(int32_t device, const std::vector<void*>& streams) {
  if (device < 0) device = device_;
  if (device < 0) {
    return Status::InvalidArgument(
        "this rank has no GPU tensor in this operation and has run no GPU operation before "
        "(it joined first), so it cannot take part on the GPU");
  }
  Status s = Check(cuda_->SetDevice(device), "cudaSetDevice");
  if (s.ok() && stream_ == nullptr) {
    s = Check(cuda_->StreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  } else if (s.ok() && device != device_) {
    s = Status::InvalidArgument("a rank's GPU ops must stay on one device: GPU " +
                                std::to_string(device_) + " then GPU " + std::to_string(device));
  }
  if (!s.ok()) return s;
  device_ = device;
  pinned_.clear();
  return cuda::WaitForStreams(cuda_, stream_, streams);
}

Status StagedCommunicator::Pinned(int64_t bytes, void** out) {
  void* p = nullptr;
  Status s = Check(cuda_->MallocHost(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1))),
                   "cudaMallocHost");
  if (!s.ok()) return s;
  const cuda::CudaApi* cuda = cuda_;
  const int32_t device = device_;
  pinned_.emplace_back(p, [cuda, device](void* q) { cuda::FreeLater(cuda, device, q, true); });
  *out = p;
  return Status::OK();
}

Status StagedCommunicator::ToHost(void* host, const void* device, int64_t bytes) {
  if (bytes == 0) return Status::OK();
  return Check(cuda_->MemcpyAsync(host, device, static_cast<size_t>(bytes),
                                  cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync (to host)");
}

Status StagedCommunicator::ToDevice(void* device, const void* host, int64_t bytes) {
  if (bytes == 0) return Status::OK();
  queued_ = true;
  return Check(cuda_->MemcpyAsync(device, host, static_cast<size_t>(bytes),
                                  cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync (to the GPU)");
}

Status StagedCommunicator::Wait() {
  return Check(cuda_->StreamSynchronize(stream_), "cudaStreamSynchronize");
}

Status StagedCommunicator::Copy(void* dst, const void* src, int64_t bytes) {
  if (bytes == 0 || dst == src) return Status::OK();
  queued_ = true;
  return Check(cuda_->MemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice,
                                  stream_),
               "cudaMemcpyAsync");
}

Status StagedCommunicator::Allocate(int64_t bytes, Buffer* out) {
  return cuda::AllocateDevice(cuda_, device_, bytes, out);
}

std::unique_ptr<PendingWork> StagedCommunicator::TakePending() {
  if (!queued_) {
    pinned_.clear();
    return nullptr;
  }
  queued_ = false;
  cudaEvent_t done = cuda::EventAfterQueuedWork(cuda_, stream_);
  if (done == nullptr) {
    pinned_.clear();
    return nullptr;
  }
  return std::make_unique<CopiesBack>(cuda_, device_, done, std::move(pinned_));
}

Status StagedCommunicator::AllgatherFixed(const void*, void*, int64_t) {
  return Status::Internal("the staged backend does not carry the control plane");
}

Status StagedCommunicator::Allreduce(const ReduceArgs& a) {
  const int64_t dsize = static_cast<int64_t>(DataTypeSize(a.dtype));
  ReduceArgs staged = a;
  Status s;
  for (auto& t : staged.tensors) {
    if (t.input == nullptr) continue;  // joined: the host backend fills in the neutral value
    void* host;
    s = Pinned(t.count * dsize, &host);
    if (s.ok()) s = ToHost(host, t.input, t.count * dsize);
    if (!s.ok()) return s;
    t.input = host;
    t.output = host;
  }
  s = Wait();
  if (s.ok()) s = host_->Allreduce(staged);
  for (size_t i = 0; s.ok() && i < a.tensors.size(); ++i) {
    if (a.tensors[i].output != nullptr) {
      s = ToDevice(a.tensors[i].output, staged.tensors[i].output, a.tensors[i].count * dsize);
    }
  }
  return s;
}

Status StagedCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  void* host;
  Status s = Pinned(bytes, &host);
  if (s.ok() && rank() == root) s = ToHost(host, buf, bytes);
  if (s.ok()) s = Wait();
  if (s.ok()) s = host_->Broadcast(host, bytes, root);
  if (s.ok() && rank() != root) s = ToDevice(buf, host, bytes);
  return s;
}

Status StagedCommunicator::Allgatherv(const void* in, void* out,
                                      const std::vector<int64_t>& bytes_per_rank) {
  int64_t total = 0;
  for (int64_t b : bytes_per_rank) total += b;
  const int64_t mine = bytes_per_rank[static_cast<size_t>(rank())];
  void *host_in = nullptr, *host_out;
  Status s = Pinned(mine, &host_in);
  if (s.ok()) s = Pinned(total, &host_out);
  if (s.ok() && in != nullptr) s = ToHost(host_in, in, mine);
  if (s.ok()) s = Wait();
  if (s.ok()) s = host_->Allgatherv(host_in, host_out, bytes_per_rank);
  if (s.ok()) s = ToDevice(out, host_out, total);
  return s;
}

Status StagedCommunicator::Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                                     void* out, const std::vector<int64_t>& recv_bytes) {
  int64_t sent = 0, received = 0;
  for (int64_t b : send_bytes) sent += b;
  for (int64_t b : recv_bytes) received += b;
  void *host_in, *host_out;
  Status s = Pinned(sent, &host_in);
  if (s.ok()) s = Pinned(received, &host_out);
  if (s.ok()) s = ToHost(host_in, in, sent);
  if (s.ok()) s = Wait();
  if (s.ok()) s = host_->Alltoallv(host_in, send_bytes, host_out, recv_bytes);
  if (s.ok()) s = ToDevice(out, host_out, received);
  return s;
}

std::unique_ptr<Communicator> StagedCommunicator::Split(const std::vector<int32_t>& ranks,
                                                        int32_t set_id) {
  auto sub = host_->Split(ranks, set_id);
  if (!sub) return nullptr;
  return std::make_unique<StagedCommunicator>(std::move(sub), cuda_);
}

}  // namespace spark_hvd
