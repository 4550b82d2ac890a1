#include "common/types.h"

#include <sstream>

namespace spark_hvd {

size_t DataTypeSize(DataType dtype) {
  switch (dtype) {
    case DataType::kUInt8:
    case DataType::kInt8:
    case DataType::kBool:
      return 1;
    case DataType::kInt16:
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kInt32:
    case DataType::kFloat32:
      return 4;
    case DataType::kInt64:
    case DataType::kFloat64:
      return 8;
  }
  return 0;
}

bool IsValidDataType(int32_t value) { return value >= 0 && value < kNumDataTypes; }

bool IsFloatingPoint(DataType dtype) {
  return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16 ||
         dtype == DataType::kFloat32 || dtype == DataType::kFloat64;
}

const char* DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kUInt8:
      return "uint8";
    case DataType::kInt8:
      return "int8";
    case DataType::kInt16:
      return "int16";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
    case DataType::kFloat16:
      return "float16";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
    case DataType::kBool:
      return "bool";
  }
  return "unknown";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "Sum";
    case ReduceOp::kAverage:
      return "Average";
    case ReduceOp::kMin:
      return "Min";
    case ReduceOp::kMax:
      return "Max";
    case ReduceOp::kProduct:
      return "Product";
    case ReduceOp::kAdasum:
      return "Adasum";
  }
  return "unknown";
}

const char* OpTypeName(OpType op) {
  switch (op) {
    case OpType::kAllreduce:
      return "allreduce";
    case OpType::kAllgather:
      return "allgather";
    case OpType::kBroadcast:
      return "broadcast";
    case OpType::kAlltoall:
      return "alltoall";
    case OpType::kReducescatter:
      return "reducescatter";
    case OpType::kBarrier:
      return "barrier";
    case OpType::kJoin:
      return "join";
  }
  return "unknown";
}

std::string JoinRanks(const std::vector<int32_t>& ranks, const char* sep) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? sep : "") + std::to_string(ranks[i]);
  return s;
}

std::string RankList(const std::vector<int32_t>& ranks) { return "[" + JoinRanks(ranks) + "]"; }

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) os << ", ";
    os << shape[i];
  }
  if (shape.size() == 1) os << ",";
  os << ")";
  return os.str();
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace spark_hvd
