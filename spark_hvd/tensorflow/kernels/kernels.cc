// spark_hvd's TensorFlow kernels: asynchronous, so a collective holds no thread of
// TensorFlow's while it waits for the other ranks.
//
// 1. ComputeAsync describes the op's tensors to the core (c_api.h) and returns at once.
//    The inputs, and the outputs it allocated (allreduce, broadcast), stay referenced by
//    a Keep that the core holds until it has finished with them.
// 2. The core completes each op on one of its threads and calls OnOpDone, which only
//    counts; the last op of a call posts Finish to the adapter's Completer thread.
// 3. Finish sets the outputs the core allocated (allgather, alltoall, reducescatter: the
//    core's buffer becomes the tensor's, no copy) or the failure, releases the handles
//    and calls TensorFlow's done.
//
// Device tensors (a GPU kernel) go to the core as device pointers with TensorFlow's
// stream for that device, the core waiting on that stream before it reads them (no host
// copy); a constant-folding pass that tries to run a collective while it optimizes a
// graph (one rank alone, with no step) is refused, so the op stays in the graph.
#include <string>
#include <vector>

#include "collective.h"
#include "ops.h"

namespace spark_hvd_tf {
namespace {

#define SHVD_OK_ASYNC(ctx, expr, done) OP_REQUIRES_OK_ASYNC(ctx, (expr), done)

// A collective over a list of tensors (the op's first inputs; its last input is the name),
// one core op each. Allreduce and broadcast write into outputs allocated here (or into
// their input, when TensorFlow lets the kernel reuse it); the others' outputs are the
// core's.
class ListCollective : public Collective {
 public:
  ListCollective(OpKernelConstruction* c, int32_t op, bool bit_exact, int trailing)
      : Collective(c), op_(op), bit_exact_(bit_exact), trailing_(trailing) {}
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    if (Refused(ctx, done)) return;
    const int n = ctx->num_inputs() - trailing_;
    const std::string name = NameAt(ctx, ctx->num_inputs() - 1);
    const bool writes_output = op_ == kAllreduce || op_ == kBroadcast;
    auto keep = std::make_shared<Keep>();
    std::vector<Spec> specs(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& in = ctx->input(i);
      SHVD_OK_ASYNC(ctx, Describe(ctx, name, op_, i, n, in, bit_exact_, &specs[i]), done);
      Customize(ctx, n, &specs[i]);
      keep->tensors.push_back(in);
      if (writes_output) {
        Tensor* out = nullptr;
        SHVD_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({i}, i, in.shape(), &out), done);
        specs[i].op.output = const_cast<char*>(out->tensor_data().data());
        keep->tensors.push_back(*out);
      }
    }
    Launch(ctx, std::move(done), name, specs, std::move(keep),
           writes_output ? nullptr : Finisher(&OutputsFromCore));
  }

 protected:
  virtual void Customize(OpKernelContext* ctx, int n, Spec* s) {}

 private:
  int32_t op_;
  bool bit_exact_;
  int trailing_;
};

// Allreduce and reducescatter: the tensors, then the prescale and postscale factors.
class Reduction : public ListCollective {
 public:
  Reduction(OpKernelConstruction* c, int32_t op) : ListCollective(c, op, false, 3) {
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &reduce_op_));
  }

 protected:
  void Customize(OpKernelContext* ctx, int n, Spec* s) override {
    s->op.reduce_op = static_cast<int32_t>(reduce_op_);
    s->op.prescale = ctx->input(n).scalar<double>()();
    s->op.postscale = ctx->input(n + 1).scalar<double>()();
  }

 private:
  int64_t reduce_op_ = 0;
};

class AllreduceOp : public Reduction {
 public:
  explicit AllreduceOp(OpKernelConstruction* c) : Reduction(c, kAllreduce) {}
};

class ReducescatterOp : public Reduction {
 public:
  explicit ReducescatterOp(OpKernelConstruction* c) : Reduction(c, kReducescatter) {}
};

class AllgatherOp : public ListCollective {
 public:
  explicit AllgatherOp(OpKernelConstruction* c) : ListCollective(c, kAllgather, true, 1) {}

 protected:
  void Customize(OpKernelContext*, int, Spec* s) override {
    if (s->shape.empty()) s->shape = {1};  // a scalar is one row
  }
};

class BroadcastOp : public ListCollective {
 public:
  explicit BroadcastOp(OpKernelConstruction* c) : ListCollective(c, kBroadcast, true, 1) {
    OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_));
  }

 protected:
  void Customize(OpKernelContext*, int, Spec* s) override {
    s->op.root = static_cast<int32_t>(root_);
  }

 private:
  int64_t root_ = 0;
};

class AlltoallOp : public Collective {
 public:
  using Collective::Collective;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    if (Refused(ctx, done)) return;
    const Tensor& in = ctx->input(0);
    const Tensor& splits = ctx->input(1);
    const std::string name = NameAt(ctx, 2);
    std::vector<Spec> specs(1);
    SHVD_OK_ASYNC(ctx, Describe(ctx, name, kAlltoall, 0, 1, in, true, &specs[0]), done);
    OP_REQUIRES_ASYNC(
        ctx, in.dims() > 0,
        StatusOf(2, "alltoall needs a tensor with at least one dimension", name, nullptr, 0), done);
    // Empty splits: the engine splits the first dimension evenly (and checks that it can).
    const auto flat = splits.flat<int32_t>();
    specs[0].splits.assign(flat.data(), flat.data() + flat.size());
    auto keep = std::make_shared<Keep>();
    keep->tensors.push_back(in);
    Launch(ctx, std::move(done), name, specs, std::move(keep),
           [](Call& call, const std::vector<shvd_result>& rs) {
             TF_RETURN_IF_ERROR(OutputFromCore(call, 0, 0, rs[0], call.ctx->input(0).dtype()));
             Tensor* received = nullptr;
             TF_RETURN_IF_ERROR(
                 call.ctx->allocate_output(1, TensorShape({rs[0].nreceived}), &received));
             for (int32_t i = 0; i < rs[0].nreceived; ++i) {
               received->flat<int32_t>()(i) = static_cast<int32_t>(rs[0].received_splits[i]);
             }
             return absl::OkStatus();
           });
  }
};

class BarrierOp : public Collective {
 public:
  using Collective::Collective;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    if (Refused(ctx, done)) return;
    const std::string name = NameAt(ctx, 0);
    std::vector<Spec> specs(1);
    specs[0].op.op = kBarrier;
    specs[0].name = name;
    specs[0].op.dtype = 0;
    specs[0].op.process_set = static_cast<int32_t>(process_set_);
    specs[0].op.device = -1;
    Launch(ctx, std::move(done), name, specs, nullptr,
           [](Call& call, const std::vector<shvd_result>&) {
             Tensor* out = nullptr;
             TF_RETURN_IF_ERROR(call.ctx->allocate_output(0, TensorShape({}), &out));
             out->scalar<bool>()() = true;
             return absl::OkStatus();
           });
  }
};

// Join has no name of its own: it is the one "__join".
class JoinOp : public Collective {
 public:
  using Collective::Collective;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    if (Refused(ctx, done)) return;
    std::vector<Spec> specs(1);
    specs[0].op.op = kJoin;
    specs[0].name = "__join";
    specs[0].op.device = -1;
    Launch(ctx, std::move(done), "__join", specs, nullptr,
           [](Call& call, const std::vector<shvd_result>& rs) {
             Tensor* out = nullptr;
             TF_RETURN_IF_ERROR(call.ctx->allocate_output(0, TensorShape({}), &out));
             out->scalar<int32_t>()() = static_cast<int32_t>(rs[0].value);
             return absl::OkStatus();
           });
  }
};

class ProcessSetQueryOp : public tf::OpKernel {
 public:
  explicit ProcessSetQueryOp(OpKernelConstruction* c) : tf::OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("query", &query_));
    OP_REQUIRES_OK(c, c->GetAttr("process_set_id", &process_set_));
  }
  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES(ctx, Api() != nullptr,
                absl::FailedPreconditionError("spark_hvd's TensorFlow ops run only through "
                                              "spark_hvd.tensorflow"));
    const int32_t id = static_cast<int32_t>(process_set_);
    const int32_t rank = Api()->process_set_rank(id);
    int32_t value = query_ == "size"   ? Api()->process_set_size(id)
                    : query_ == "rank" ? rank
                                       : (rank >= 0 ? 1 : 0);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int32_t>()() = value;
  }

 private:
  std::string query_;
  int64_t process_set_ = 0;
};

using ::tensorflow::register_kernel::Name;
using tf::DEVICE_CPU;
using tf::DEVICE_GPU;

REGISTER_KERNEL_BUILDER(Name("SparkHvdAllreduce").Device(DEVICE_CPU), AllreduceOp);
REGISTER_KERNEL_BUILDER(Name("SparkHvdReducescatter").Device(DEVICE_CPU), ReducescatterOp);
REGISTER_KERNEL_BUILDER(Name("SparkHvdAllgather").Device(DEVICE_CPU), AllgatherOp);
REGISTER_KERNEL_BUILDER(Name("SparkHvdBroadcast").Device(DEVICE_CPU), BroadcastOp);
REGISTER_KERNEL_BUILDER(Name("SparkHvdAlltoall").Device(DEVICE_CPU), AlltoallOp);
REGISTER_KERNEL_BUILDER(Name("SparkHvdBarrier").Device(DEVICE_CPU), BarrierOp);
REGISTER_KERNEL_BUILDER(Name("SparkHvdJoin").Device(DEVICE_CPU), JoinOp);
REGISTER_KERNEL_BUILDER(Name("SparkHvdProcessSetQuery").Device(DEVICE_CPU), ProcessSetQueryOp);
// On a GPU the data stays in device memory; the scale factors and splits are read on
// the host.
REGISTER_KERNEL_BUILDER(Name("SparkHvdAllreduce")
                            .Device(DEVICE_GPU)
                            .HostMemory("prescale")
                            .HostMemory("postscale")
                            .HostMemory("tensor_name"),
                        AllreduceOp);
REGISTER_KERNEL_BUILDER(Name("SparkHvdReducescatter")
                            .Device(DEVICE_GPU)
                            .HostMemory("prescale")
                            .HostMemory("postscale")
                            .HostMemory("tensor_name"),
                        ReducescatterOp);
REGISTER_KERNEL_BUILDER(Name("SparkHvdAllgather").Device(DEVICE_GPU).HostMemory("tensor_name"),
                        AllgatherOp);
REGISTER_KERNEL_BUILDER(Name("SparkHvdBroadcast").Device(DEVICE_GPU).HostMemory("tensor_name"),
                        BroadcastOp);
REGISTER_KERNEL_BUILDER(Name("SparkHvdAlltoall")
                            .Device(DEVICE_GPU)
                            .HostMemory("splits")
                            .HostMemory("tensor_name")
                            .HostMemory("received_splits"),
                        AlltoallOp);

}  // namespace
}  // namespace spark_hvd_tf

// Binds the library to the core's table (Python calls it once after loading both).
// 0: bound; 1: the table is of another version of the C entry points.
extern "C" __attribute__((visibility("default"))) int spark_hvd_tf_bind(const void* api) {
  const auto* a = static_cast<const shvd_api*>(api);
  if (a == nullptr || a->version != SHVD_C_API_VERSION ||
      a->struct_size < static_cast<int32_t>(sizeof(shvd_api))) {
    return 1;
  }
  spark_hvd_tf::Api() = a;
  return 0;
}
