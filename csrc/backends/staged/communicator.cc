#include "backends/staged/communicator.h"

#include <algorithm>

#include "backends/cuda/util.h"
#include "common/free_list.h"

namespace spark_hvd {
namespace {

// The copies back to the GPU, seen through an event behind them. Their pinned buffers
// went back to the pool when they were queued: the next user of one orders its work after
// them (memory_pool.h), and the host touches one only after synchronizing its stream.
class CopiesBack : public PendingWork, public Recycled<CopiesBack> {
 public:
  CopiesBack(const cuda::CudaApi* cuda, int32_t device, cuda::PooledEvent event)
      : cuda_(cuda), device_(device), event_(std::move(event)) {}
  bool Poll(Status* status) override {
    const cudaError_t q = cuda::QueryOnDevice(cuda_, device_, event_.get());
    if (q == cudaErrorNotReady) return false;
    *status = q == cudaSuccess ? Status::OK()
                               : Status::Internal(std::string("CUDA error in a staged copy: ") +
                                                  cuda_->GetErrorString(q));
    return true;
  }
  void Abort() override {}  // host-side copies finish on their own
  bool Quiesced() override {
    return cuda::QueryOnDevice(cuda_, device_, event_.get()) != cudaErrorNotReady;
  }

 private:
  const cuda::CudaApi* cuda_;
  int32_t device_;
  cuda::PooledEvent event_;
};

}  // namespace

StagedCommunicator::StagedCommunicator(std::unique_ptr<Communicator> host,
                                       const cuda::CudaApi* cuda)
    : host_(std::move(host)), cuda_(cuda) {}

StagedCommunicator::~StagedCommunicator() {
  // No wait: the stream's resources go once its work is done, and the pinned
  // buffers that work reads are held by its InFlight item.
  if (stream_ != nullptr) cuda_->StreamDestroy(stream_);
  if (device_pool_) device_pool_->Detach();
  if (pinned_pool_) pinned_pool_->Detach();
}

void StagedCommunicator::Abort() { host_->Abort(); }

Status StagedCommunicator::Check(cudaError_t err, const char* what) const {
  if (err == cudaSuccess) return Status::OK();  // the message only for a failure
  return cuda::CudaStatus(cuda_, err, std::string(what) + " (staged GPU op)");
}

Status StagedCommunicator::Prepare(const DeviceInputs& inputs) {
  int32_t device = inputs.device;
  if (device < 0) device = device_;
  if (device < 0) {
    return Status::InvalidArgument(
        "this rank has no GPU tensor in this operation and has run no GPU operation before "
        "(it joined first), so it cannot take part on the GPU");
  }
  Status s = Check(cuda_->SetDevice(device), "cudaSetDevice");
  if (s.ok() && stream_ == nullptr) {
    s = Check(cuda_->StreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    if (s.ok()) {
      device_pool_ = cuda::MemoryPool::Of(cuda_, device, cuda::MemoryPool::kDevice);
      pinned_pool_ = cuda::MemoryPool::Of(cuda_, device, cuda::MemoryPool::kPinned);
      device_pool_->Attach();
      pinned_pool_->Attach();
    }
  } else if (s.ok() && device != device_) {
    s = Status::InvalidArgument("a rank's GPU ops must stay on one device: GPU " +
                                std::to_string(device_) + " then GPU " + std::to_string(device));
  }
  if (!s.ok()) return s;
  device_ = device;
  pinned_.clear();
  user_stream_known_ = inputs.streams.size() == 1;
  user_stream_ = user_stream_known_ ? static_cast<cudaStream_t>(inputs.streams[0]) : nullptr;
  return cuda::WaitForEvents(cuda_, stream_, inputs.ready);
}

Status StagedCommunicator::Pinned(int64_t bytes, void** out) {
  Buffer buf;
  Status s = pinned_pool_->Allocate(bytes, stream_, &buf);
  if (!s.ok()) return s;
  pinned_.push_back(std::move(buf.owner));
  *out = buf.data;
  return Status::OK();
}

Status StagedCommunicator::ToHost(void* host, const void* device, int64_t bytes) {
  if (bytes == 0) return Status::OK();
  queued_ = true;  // the op's device buffers are kept until the copy ran, even if it fails
  return Check(
      cuda_->MemcpyAsync(host, device, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, stream_),
      "cudaMemcpyAsync (to host)");
}

Status StagedCommunicator::ToDevice(void* device, const void* host, int64_t bytes) {
  if (bytes == 0) return Status::OK();
  queued_ = true;
  return Check(
      cuda_->MemcpyAsync(device, host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_),
      "cudaMemcpyAsync (to the GPU)");
}

Status StagedCommunicator::Wait() {
  return Check(cuda_->StreamSynchronize(stream_), "cudaStreamSynchronize");
}

Status StagedCommunicator::Copy(void* dst, const void* src, int64_t bytes) {
  if (bytes == 0 || dst == src) return Status::OK();
  queued_ = true;
  return Check(
      cuda_->MemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream_),
      "cudaMemcpyAsync");
}

Status StagedCommunicator::Allocate(int64_t bytes, Buffer* out) {
  return device_pool_->Allocate(bytes, stream_, out, user_stream_known_ ? &user_stream_ : nullptr);
}

std::unique_ptr<PendingWork> StagedCommunicator::TakePending() {
  pinned_.clear();  // back to the pool, ordered behind the copies queued on the stream
  if (!queued_) return nullptr;
  queued_ = false;
  cuda::PooledEvent done;
  if (!cuda::EventAfterQueuedWork(cuda_, device_, stream_, &done).ok()) {
    Wait();  // cannot observe the copies: let them finish before the op's buffers go
    return nullptr;
  }
  return std::make_unique<CopiesBack>(cuda_, device_, std::move(done));
}

Status StagedCommunicator::AllgatherFixed(const void*, void*, int64_t) {
  return Status::Internal("the staged backend does not carry the control plane");
}

Status StagedCommunicator::Allreduce(const ReduceArgs& a) {
  const int64_t dsize = static_cast<int64_t>(DataTypeSize(a.dtype));
  ReduceArgs& staged = staged_;
  staged = a;  // into the kept vector's capacity
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
