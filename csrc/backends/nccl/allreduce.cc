// NcclCommunicator's reductions (communicator.h): allreduce, fused or not, with NCCL's own
// ops or a premultiplied sum; what NCCL cannot express staged through host memory; and
// reducescatter in equal blocks.
#include <algorithm>
#include <cstring>

#include "backends/host_reduce.h"
#include "backends/nccl/communicator.h"
#include "common/half.h"
#include "common/reduce.h"

namespace spark_hvd {
namespace nccl {
namespace {

// NCCL's type for a spark_hvd dtype (bool travels as uint8); false for int16.
bool NcclType(DataType d, ncclDataType_t* out) {
  switch (d) {
    case DataType::kUInt8:
      *out = ncclUint8;
      return true;
    case DataType::kBool:
      *out = ncclUint8;
      return true;
    case DataType::kInt8:
      *out = ncclInt8;
      return true;
    case DataType::kInt32:
      *out = ncclInt32;
      return true;
    case DataType::kInt64:
      *out = ncclInt64;
      return true;
    case DataType::kFloat16:
      *out = ncclFloat16;
      return true;
    case DataType::kBFloat16:
      *out = ncclBfloat16;
      return true;
    case DataType::kFloat32:
      *out = ncclFloat32;
      return true;
    case DataType::kFloat64:
      *out = ncclFloat64;
      return true;
    default:
      return false;
  }
}

ncclRedOp_t BaseOp(ReduceOp op, DataType d) {
  const bool logical = d == DataType::kBool;
  switch (op) {
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kProduct:
      return logical ? ncclMin : ncclProd;
    default:
      return logical ? ncclMax : ncclSum;  // Sum, Average
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

}  // namespace

// The NCCL op for a reduction NCCL expresses in one call, handed to `run`: its own
// (Sum, Min, Max, Product; float Sum/Average unscaled), or, for scale factors and float
// Average, a premultiplied sum made for the call and destroyed after it. False, running
// nothing, for what it cannot express (integer Average, scaled Min/Max/Product).
bool NcclCommunicator::WithNcclOp(const ReduceArgs& a, ncclDataType_t dtype,
                                  FunctionRef<Status(ncclRedOp_t)> run, Status* status) {
  const bool is_float = IsFloatingPoint(a.dtype);
  const double factor =
      a.prescale * a.postscale / (a.op == ReduceOp::kAverage ? static_cast<double>(a.ranks) : 1.0);
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
      const ncclResult_t d = nccl_->RedOpDestroy(op, comm_->comm);
      if (d == ncclInProgress) NcclCheck(d, "ncclRedOpDestroy");  // settles; failures ignored
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
  const bool done = WithNcclOp(
      a, dtype,
      [&](ncclRedOp_t op) {
        return OnComm([&] {
          return NcclCheck(nccl_->ReduceScatter(in, out, static_cast<size_t>(block), dtype, op,
                                                comm_->comm, stream_),
                           "ncclReduceScatter");
        });
      },
      status);
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
  Buffer fusion;  // back to the pool when this returns, reused behind the work queued now
  Status s = Scratch(count * dsize, &fusion);
  void* buf = fusion.data;
  size_t offset = 0;
  for (const auto& t : a.tensors) {
    if (!s.ok()) return s;
    const size_t bytes = static_cast<size_t>(t.count) * dsize;
    char* dst = static_cast<char*>(buf) + offset;
    if (t.input != nullptr) {
      s = Copy(dst, t.input, static_cast<int64_t>(bytes));
    } else if (bytes > 0) {  // joined: zeros (Horovod's)
      queued_ = true;
      s = CudaCheck(cuda_->MemsetAsync(dst, 0, bytes, stream_), "cudaMemsetAsync");
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
    if (t.output != nullptr)
      s = Copy(t.output, static_cast<char*>(buf) + offset, static_cast<int64_t>(bytes));
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
  Buffer scratch;
  Status s = Scratch(host.size(), &scratch);
  void* buf = scratch.data;
  if (s.ok()) s = WaitForStream();
  size_t offset = 0;
  for (const auto& t : a.tensors) {
    if (!s.ok()) return s;
    const size_t bytes = static_cast<size_t>(t.count) * dsize;
    if (t.input != nullptr) {
      s = CudaCheck(
          cuda_->MemcpyAsync(host.data() + offset, t.input, bytes, cudaMemcpyDeviceToHost, stream_),
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
    if (t.input != nullptr)
      ScaleBuffer(host.data() + offset, static_cast<size_t>(t.count), a.dtype, a.prescale);
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
    s = CudaCheck(
        cuda_->MemcpyAsync(host.data(), buf, host.size(), cudaMemcpyDeviceToHost, stream_),
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

}  // namespace nccl
}  // namespace spark_hvd
