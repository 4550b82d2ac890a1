#include "python/dlpack.h"

namespace spark_hvd {
namespace dlpack {
namespace {

struct Context {
  std::shared_ptr<OpState> state;
  std::vector<int64_t> shape;
};

DataType Of(spark_hvd::DataType d) {
  const uint8_t bits = static_cast<uint8_t>(8 * DataTypeSize(d));
  switch (d) {
    case spark_hvd::DataType::kUInt8:
      return {1, bits, 1};
    case spark_hvd::DataType::kBool:
      return {6, bits, 1};
    case spark_hvd::DataType::kFloat16:
    case spark_hvd::DataType::kFloat32:
    case spark_hvd::DataType::kFloat64:
      return {2, bits, 1};
    case spark_hvd::DataType::kBFloat16:
      return {4, bits, 1};
    default:
      return {0, bits, 1};  // signed integers
  }
}

void Delete(ManagedTensor* self) {
  delete static_cast<Context*>(self->manager_ctx);
  delete self;
}

}  // namespace

pybind11::capsule Capsule(std::shared_ptr<OpState> state, spark_hvd::DataType dtype) {
  auto* ctx = new Context{state, state->output_shape};
  auto* t = new ManagedTensor{};
  t->dl_tensor.data = state->output.data;
  t->dl_tensor.device = Device{state->output.device >= 0 ? 2 : 1,
                               state->output.device >= 0 ? state->output.device : 0};
  t->dl_tensor.ndim = static_cast<int32_t>(ctx->shape.size());
  t->dl_tensor.dtype = Of(dtype);
  t->dl_tensor.shape = ctx->shape.data();
  t->dl_tensor.strides = nullptr;
  t->dl_tensor.byte_offset = 0;
  t->manager_ctx = ctx;
  t->deleter = &Delete;
  // A consumer renames the capsule "used_dltensor" and calls the deleter itself; an
  // unconsumed one is deleted here.
  return pybind11::capsule(t, "dltensor", [](PyObject* capsule) {
    if (PyCapsule_IsValid(capsule, "dltensor")) {
      auto* m = static_cast<ManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
      if (m != nullptr) m->deleter(m);
    }
  });
}

}  // namespace dlpack
}  // namespace spark_hvd
