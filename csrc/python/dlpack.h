// A core-allocated GPU output handed to Python as a DLPack capsule (the DLPack C
// ABI, declared here; frameworks take it with from_dlpack, zero-copy). The capsule
// keeps the op's state, and with it the GPU memory, alive until the consumer's
// tensor is freed.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/op_state.h"

namespace spark_hvd {
namespace dlpack {

struct Device {
  int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2
  int32_t device_id;
};
struct DataType {
  uint8_t code;  // kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

// The capsule ("dltensor") for a completed op's device output of `dtype`.
pybind11::capsule Capsule(std::shared_ptr<OpState> state, spark_hvd::DataType dtype);

}  // namespace dlpack
}  // namespace spark_hvd
