// Core value types shared by every layer: data types, reduction ops, collective kinds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace spark_hvd {

// Values are part of the Python ABI: bindings.cc binds these enums (and StatusCode)
// as spark_hvd._core.DataType, ReduceOp, OpType; no Python copy exists.
enum class DataType : int32_t {
  kUInt8 = 0,
  kInt8 = 1,
  kInt16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kFloat16 = 5,
  kBFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBool = 9,
};
constexpr int kNumDataTypes = 10;

enum class ReduceOp : int32_t {
  kSum = 0,
  kAverage = 1,
  kMin = 2,
  kMax = 3,
  kProduct = 4,
  kAdasum = 5,
};

enum class OpType : int32_t {
  kAllreduce = 0,
  kAllgather = 1,
  kBroadcast = 2,
  kAlltoall = 3,
  kReducescatter = 4,
  kBarrier = 5,
  kJoin = 6,
};

// Device of a tensor: kCpuDevice, or a CUDA device ordinal >= 0.
constexpr int32_t kCpuDevice = -1;

size_t DataTypeSize(DataType dtype);
bool IsValidDataType(int32_t value);
bool IsFloatingPoint(DataType dtype);
const char* DataTypeName(DataType dtype);
const char* ReduceOpName(ReduceOp op);
const char* OpTypeName(OpType op);
std::string ShapeString(const std::vector<int64_t>& shape);
// Ranks as messages name them: "0,2,3" (sep between), RankList: "[0,2,3]".
std::string JoinRanks(const std::vector<int32_t>& ranks, const char* sep = ",");
std::string RankList(const std::vector<int32_t>& ranks);
int64_t NumElements(const std::vector<int64_t>& shape);

}  // namespace spark_hvd
