// The machinery every spark_hvd kernel shares: a call's hand-over to the core and its
// completion (the numbered steps are in kernels.cc), device and stream, outputs the core
// allocated, names, refusals.
#pragma once

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core.h"
#include "xla/stream_executor/stream.h"

namespace spark_hvd_tf {

using tf::AsyncOpKernel;
using tf::OpKernelConstruction;
using tf::OpKernelContext;
using tf::Tensor;
using tf::TensorShape;

constexpr int32_t kAllreduce = 0, kAllgather = 1, kBroadcast = 2, kAlltoall = 3, kReducescatter = 4,
                  kBarrier = 5, kJoin = 6;

// What the core holds until it has finished with the ops: the tensors behind their
// addresses.
struct Keep {
  std::vector<Tensor> tensors;
};

// One op for the core: shvd_op's pointers point into this.
struct Spec {
  Spec() { op.prescale = op.postscale = 1.0; }
  shvd_op op{};
  std::string name, group;
  std::vector<int64_t> shape, splits;
};

struct Call;
using Finisher = std::function<tf::Status(Call&, const std::vector<shvd_result>&)>;

// A kernel call in flight, until its last op completes.
struct Call {
  OpKernelContext* ctx = nullptr;
  AsyncOpKernel::DoneCallback done;
  std::vector<shvd_work*> works;
  std::atomic<int> pending{0};
  Finisher finish;
};

inline void Finish(Call* call) {
  std::vector<shvd_result> results(call->works.size());
  tf::Status status;
  for (size_t i = 0; i < results.size(); ++i) {
    Api()->result(call->works[i], &results[i]);
    if (results[i].code != 0 && status.ok()) status = StatusOf(results[i]);
  }
  if (status.ok() && call->finish) status = call->finish(*call, results);
  if (!status.ok()) call->ctx->SetStatus(status);
  for (shvd_work* w : call->works) {
    if (w != nullptr) Api()->release(w);
  }
  auto done = std::move(call->done);
  delete call;
  done();
}

inline void OnOpDone(void* arg) {  // a core thread: count, and hand the last one over
  auto* call = static_cast<Call*>(arg);
  if (call->pending.fetch_sub(1) == 1) Completer::Get().Post([call] { Finish(call); });
}

inline void ReleaseKeep(void* p) { delete static_cast<std::shared_ptr<Keep>*>(p); }

// The core's device of the kernel (-1: host) and the stream its device tensors come from.
inline void DeviceOf(OpKernelContext* ctx, int32_t* device, void** stream) {
  *device = -1;
  *stream = nullptr;
  const auto* info = ctx->device()->tensorflow_accelerator_device_info();
  if (info == nullptr) return;
  *device = info->gpu_id;
  const auto* dc = ctx->op_device_context();
  if (dc != nullptr && dc->stream() != nullptr) {
    *stream = dc->stream()->platform_specific_handle().stream;
  }
}

inline std::vector<int64_t> Dims(const TensorShape& shape) {
  std::vector<int64_t> d;
  for (const auto& dim : shape) d.push_back(dim.size);
  return d;
}

// An output the core allocated, as output `index` of dtype `dt`.
inline tf::Status OutputFromCore(Call& call, int index, size_t work, const shvd_result& r,
                                 tf::DataType dt) {
  TensorShape shape;
  TF_RETURN_IF_ERROR(TensorShape::BuildTensorShape(
      absl::Span<const int64_t>(r.shape, static_cast<size_t>(r.ndim)), &shape));
  const int64_t bytes = shape.num_elements() * static_cast<int64_t>(tf::DataTypeSize(dt));
  if (bytes != r.bytes) {
    return absl::InternalError("spark_hvd: the core's output has " + std::to_string(r.bytes) +
                               " bytes for shape " + shape.DebugString() + " of " +
                               tf::DataTypeString(dt));
  }
  const bool aligned = reinterpret_cast<uintptr_t>(r.data) % EIGEN_MAX_ALIGN_BYTES == 0;
  if (bytes > 0 && aligned) {
    Tensor t(
        dt, shape,
        tf::core::RefCountPtr<tf::TensorBuffer>(new CoreBuffer(call.works[work], r.data, r.bytes)));
    call.works[work] = nullptr;  // the tensor releases it
    call.ctx->set_output(index, t);
    return absl::OkStatus();
  }
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(call.ctx->allocate_output(index, shape, &out));
  if (bytes == 0) return absl::OkStatus();
  if (r.device >= 0) return absl::InternalError("spark_hvd: a device output is not aligned");
  std::memcpy(const_cast<char*>(out->tensor_data().data()), r.data, static_cast<size_t>(bytes));
  return absl::OkStatus();
}

// Output i of the call is what the core allocated for its op i (input i's dtype).
inline tf::Status OutputsFromCore(Call& call, const std::vector<shvd_result>& rs) {
  for (size_t i = 0; i < rs.size(); ++i) {
    const int index = static_cast<int>(i);
    TF_RETURN_IF_ERROR(OutputFromCore(call, index, i, rs[i], call.ctx->input(index).dtype()));
  }
  return absl::OkStatus();
}

// The common part of the collectives: names, the hand-over to the core, refusals.
class Collective : public AsyncOpKernel {
 public:
  explicit Collective(OpKernelConstruction* c) : AsyncOpKernel(c) {
    if (c->HasAttr("process_set_id"))
      OP_REQUIRES_OK(c, c->GetAttr("process_set_id", &process_set_));
    if (c->HasAttr("grouped")) OP_REQUIRES_OK(c, c->GetAttr("grouped", &grouped_));
  }

 protected:
  // The collective's name: the string input at `index`.
  static std::string NameAt(OpKernelContext* ctx, int index) {
    return std::string(ctx->input(index).scalar<tf::tstring>()());
  }

  // A Spec for tensor i of n of the collective `name`, of `op` on `t` (dtype checked),
  // with the kernel's device.
  tf::Status Describe(OpKernelContext* ctx, const std::string& name, int32_t op, int i, int n,
                      const Tensor& t, bool bit_exact, Spec* s) {
    s->op.op = op;
    s->name = (n == 1 && !grouped_) ? name : name + "." + std::to_string(i);
    s->group = grouped_ ? name : "";
    s->op.group_size = grouped_ ? n : 0;
    s->op.dtype = CoreDtype(t.dtype(), bit_exact);
    if (s->op.dtype < 0) {
      return StatusOf(2,
                      "tensor '" + s->name + "': dtype " + tf::DataTypeString(t.dtype()) +
                          " is not supported; use one of uint8, int8, int16, int32, int64, "
                          "float16, bfloat16, float32, float64, bool",
                      s->name, nullptr, 0);
    }
    s->shape = Dims(t.shape());
    s->op.input = t.tensor_data().data();
    s->op.process_set = static_cast<int32_t>(process_set_);
    DeviceOf(ctx, &s->op.device, &s->op.stream);
    return absl::OkStatus();
  }

  // Hands `specs` to the core; `finish` runs once every op completed.
  void Launch(OpKernelContext* ctx, DoneCallback done, const std::string& name,
              std::vector<Spec>& specs, std::shared_ptr<Keep> keep, Finisher finish) {
    auto* call = new Call;
    call->ctx = ctx;
    call->done = std::move(done);
    call->finish = std::move(finish);
    call->works.assign(specs.size(), nullptr);
    call->pending = static_cast<int>(specs.size());
    std::vector<shvd_op> ops;
    for (auto& s : specs) {
      s.op.name = s.name.c_str();
      s.op.group = s.group.c_str();
      s.op.shape = s.shape.data();
      s.op.ndim = static_cast<int32_t>(s.shape.size());
      s.op.splits = s.splits.data();
      s.op.nsplits = static_cast<int32_t>(s.splits.size());
      s.op.owner = new std::shared_ptr<Keep>(keep);
      s.op.release_owner = &ReleaseKeep;
      s.op.done = &OnOpDone;
      s.op.done_arg = call;
      ops.push_back(s.op);
    }
    char error[2048] = {0};
    const int32_t rc = Api()->enqueue(ops.data(), static_cast<int32_t>(ops.size()),
                                      call->works.data(), error, sizeof(error));
    if (rc != 0) {  // refused: no op of the call will complete
      ctx->SetStatus(StatusOf(rc, error, name, nullptr, 0));
      auto cb = std::move(call->done);
      delete call;
      cb();
    }
  }

  // Refuses what must not reach the core: a constant-folding pass running the kernel while
  // it optimizes a graph (no step: one rank alone would start a collective), or an op
  // library loaded without spark_hvd's core.
  bool Refused(OpKernelContext* ctx, const DoneCallback& done) {
    if (ctx->step_container() == nullptr) {
      ctx->SetStatus(absl::FailedPreconditionError(
          "spark_hvd collectives run only when the graph runs, not while it is optimized"));
    } else if (Api() == nullptr) {
      ctx->SetStatus(absl::FailedPreconditionError(
          "spark_hvd's TensorFlow ops run only through spark_hvd.tensorflow, which binds them "
          "to spark_hvd's core"));
    } else {
      return false;
    }
    done();
    return true;
  }

  int64_t process_set_ = 0;
  bool grouped_ = false;
};

}  // namespace spark_hvd_tf
