// Request: what one rank asks for one named tensor. Response: what every rank
// of a process set executes — computed identically on every rank from the same
// exchanged requests (see controller.h for the protocol).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/kept_vector.h"
#include "common/status.h"
#include "common/types.h"

namespace spark_hvd {

// Internal request kinds beyond the public collectives.
constexpr OpType kAddProcessSet = static_cast<OpType>(100);
constexpr OpType kRemoveProcessSet = static_cast<OpType>(101);

// Ops the engine thread alone may carry out, whatever the device (Engine::Drive): a join
// and the process-set changes, which build communicators of every backend.
inline bool EngineThreadOp(OpType op) {
  return op == OpType::kJoin || op == kAddProcessSet || op == kRemoveProcessSet;
}

struct Request {
  int32_t rank = 0;  // global rank of the submitter
  std::string name;
  OpType op = OpType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  ReduceOp reduce_op = ReduceOp::kSum;
  double prescale = 1.0;
  double postscale = 1.0;
  int32_t root = 0;  // broadcast root, a rank within the process set
  int32_t process_set = 0;
  int32_t device = kCpuDevice;
  std::vector<int64_t> splits;  // alltoall: rows sent to each set rank; process sets: members
  std::string group;            // grouped ops: the group's name ("" = none)
  int32_t group_size = 0;

  // Exactly the same request, rank aside (how a response-cache hit is recognised).
  bool Signature(const Request& other) const;
};

// One tensor inside a response. Copying one into another keeps the target's capacity
// (AssignKept): the controller refills kept responses every cycle.
struct ResponseTensor {
  ResponseTensor() = default;
  ResponseTensor(std::string n, std::vector<int64_t> s, std::vector<int64_t> d)
      : name(std::move(n)), shape(std::move(s)), rank_dims(std::move(d)) {}
  ResponseTensor(const ResponseTensor&) = default;
  ResponseTensor(ResponseTensor&&) noexcept = default;
  ResponseTensor& operator=(ResponseTensor&&) noexcept = default;
  ResponseTensor& operator=(const ResponseTensor& o) {
    AssignKept(&name, o.name);
    shape = o.shape;
    rank_dims = o.rank_dims;
    return *this;
  }

  std::string name;
  std::vector<int64_t> shape;  // the agreed shape (allgather/alltoall: of the lowest active rank)
  std::vector<int64_t> rank_dims;  // allgather: first dim per set rank;
                                   // alltoall: size x size split matrix, row = sender
};

struct Response {
  OpType op = OpType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  double prescale = 1.0;
  double postscale = 1.0;
  int32_t root = 0;
  int32_t process_set = 0;
  int32_t device = kCpuDevice;
  KeptVector<ResponseTensor> tensors;  // > 1 when fused (kept: refilled without allocating)
  std::vector<int32_t> active;         // set ranks contributing real data (others joined)
  std::vector<int64_t> extra;          // process-set members; join: {last joined rank}
  StatusCode error = StatusCode::kOk;  // != kOk: every rank fails these tensors
  std::string error_message;
  std::vector<int32_t> error_ranks;  // the evidence: stall: missing; mismatch: disagreeing
  std::string group;  // grouped ops: the group's name; a failure fails the whole group (groups.h)

  int64_t TotalElements() const;
};

// The responses of a cycle. The controller refills its lists every cycle: their elements,
// with their strings and vectors, are kept (no allocation per op in steady state).
using ResponseList = KeptVector<Response>;

// Compact binary encoding used on the control plane.
class Writer {
 public:
  void I32(int32_t v) { Raw(&v, sizeof(v)); }
  void I64(int64_t v) { Raw(&v, sizeof(v)); }
  void F64(double v) { Raw(&v, sizeof(v)); }
  void Str(const std::string& s);
  void Vec(const std::vector<int64_t>& v);
  void Raw(const void* p, size_t n);
  std::string& data() { return buf_; }
  void Clear() { buf_.clear(); }  // keeps the capacity

 private:
  std::string buf_;
};

class Reader {
 public:
  Reader(const char* p, size_t n) : p_(p), end_(p + n) {}
  int32_t I32();
  int64_t I64();
  double F64();
  std::string Str();
  std::vector<int64_t> Vec();
  bool done() const { return p_ >= end_; }

 private:
  void Raw(void* out, size_t n);
  const char* p_;
  const char* end_;
};

// Names are scoped by process set: the same name may be in flight in two sets.
inline std::string TensorKey(int32_t process_set, const std::string& name) {
  return std::to_string(process_set) + "/" + name;
}
inline std::string TensorKey(const Request& r) { return TensorKey(r.process_set, r.name); }
// The same into *out, reusing its capacity (no allocation once it held as long a key).
void AssignTensorKey(std::string* out, int32_t process_set, const std::string& name);

void WriteRequest(Writer& w, const Request& r);
Request ReadRequest(Reader& r);

}  // namespace spark_hvd
