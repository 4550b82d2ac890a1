// The C entry points for framework adapters (spark_hvd/include/spark_hvd/c_api.h): the
// same Engine as the Python binding, reached without Python. Every entry point is
// noexcept: a C caller cannot catch a C++ exception.
#include "spark_hvd/c_api.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backends/cuda/events.h"
#include "common/status.h"
#include "common/types.h"
#include "engine/instance.h"
#include "engine/tensor_queue.h"

// The handle an adapter holds: the op's state (and with it the output the core
// allocated) until release.
struct shvd_work {
  std::shared_ptr<spark_hvd::OpState> state;
};

namespace spark_hvd {
namespace {

int32_t Fail(const Status& s, char* error, size_t error_size) {
  if (error != nullptr && error_size > 0) {
    const std::string& m = s.message();
    const size_t n = std::min(m.size(), error_size - 1);
    std::memcpy(error, m.data(), n);
    error[n] = '\0';
  }
  return static_cast<int32_t>(s.code());
}

// The owner of an op's buffers, released by the core when it has finished with them.
std::shared_ptr<void> OwnerOf(const shvd_op& op) {
  if (op.owner == nullptr) return nullptr;
  auto release = op.release_owner;
  return std::shared_ptr<void>(op.owner, [release](void* p) {
    if (release != nullptr) release(p);
  });
}

TensorEntry EntryOf(const shvd_op& op, std::shared_ptr<void> owner) {
  if (!IsValidDataType(op.dtype)) {
    throw StatusError(Status::InvalidArgument("unknown dtype code " + std::to_string(op.dtype)));
  }
  TensorEntry e;
  Request& r = e.req;
  r.op = static_cast<OpType>(op.op);
  r.name = op.name != nullptr ? op.name : "";
  r.dtype = static_cast<DataType>(op.dtype);
  r.shape.assign(op.shape, op.shape + std::max(op.ndim, 0));
  r.reduce_op = static_cast<ReduceOp>(op.reduce_op);
  r.prescale = op.prescale;
  r.postscale = op.postscale;
  r.root = op.root;
  r.process_set = op.process_set;
  r.device = op.device;
  if (op.splits != nullptr) r.splits.assign(op.splits, op.splits + std::max(op.nsplits, 0));
  r.group = op.group != nullptr ? op.group : "";
  r.group_size = op.group_size;
  e.input = op.input;
  e.output = op.output;
  e.stream = op.stream;
  e.owner = std::move(owner);
  // A device op's ready event, recorded on its producer stream now, at submit, as for
  // Python's ops (backends/cuda/events.h): the op's work waits for that event alone.
  const cuda::CudaApi* api = op.device >= 0 ? cuda::Cuda() : nullptr;
  if (api != nullptr) {
    cuda::PooledEvent ready;
    Status s = cuda::RecordReady(api, op.device, op.stream, &ready);
    if (!s.ok()) {
      throw StatusError(
          Status(s.code(), std::string(OpTypeName(r.op)) + " '" + r.name + "': " + s.message()));
    }
    e.ready = std::move(ready);
  }
  e.state = TheEngine().NewOpState();
  if (op.done != nullptr) {
    auto done = op.done;
    void* arg = op.done_arg;
    e.state->on_done = [done, arg] { done(arg); };
  }
  return e;
}

int32_t Enqueue(const shvd_op* ops, int32_t n, shvd_work** works, char* error,
                size_t error_size) noexcept {
  // Every owner is taken first, so that a refused call releases each one of them.
  std::vector<std::shared_ptr<void>> owners;
  try {
    for (int32_t i = 0; i < n; ++i) owners.push_back(OwnerOf(ops[i]));
    std::vector<TensorEntry> entries;
    entries.reserve(static_cast<size_t>(std::max(n, 0)));
    for (int32_t i = 0; i < n; ++i) entries.push_back(EntryOf(ops[i], std::move(owners[i])));
    // The handles exist before the engine sees the ops: an op may complete, and its
    // `done` read works[i], before Enqueue returns.
    for (int32_t i = 0; i < n; ++i) works[i] = new shvd_work{entries[i].state};
    try {
      TheEngine().Enqueue(std::move(entries));
    } catch (...) {
      for (int32_t i = 0; i < n; ++i) {
        delete works[i];
        works[i] = nullptr;
      }
      throw;
    }
    return 0;
  } catch (const StatusError& e) {
    return Fail(e.status(), error, error_size);
  } catch (const std::exception& e) {
    return Fail(Status::Internal(std::string("spark_hvd C API enqueue: ") + e.what()), error,
                error_size);
  }
}

void Result(const shvd_work* work, shvd_result* out) noexcept {
  *out = shvd_result{};
  OpState& s = *work->state;
  if (!TheEngine().completions().Done(s)) {
    out->code = -1;
    return;
  }
  out->code = static_cast<int32_t>(s.status.code());
  out->message = s.status.message().c_str();
  out->tensor = s.status.tensor().c_str();
  out->ranks = s.status.ranks().data();
  out->nranks = static_cast<int32_t>(s.status.ranks().size());
  out->data = s.output.data;
  out->bytes = s.output.bytes;
  out->device = s.output.device;
  out->shape = s.output_shape.data();
  out->ndim = static_cast<int32_t>(s.output_shape.size());
  out->received_splits = s.received_splits.data();
  out->nreceived = static_cast<int32_t>(s.received_splits.size());
  out->value = s.value;
}

void Release(shvd_work* work) noexcept { delete work; }

int32_t ProcessSetRank(int32_t id) noexcept {
  try {
    const auto ranks = TheEngine().ProcessSetRanks(id);
    auto it = std::find(ranks.begin(), ranks.end(), TheEngine().rank());
    return it == ranks.end() ? -1 : static_cast<int32_t>(it - ranks.begin());
  } catch (...) {
    return -1;
  }
}

int32_t ProcessSetSize(int32_t id) noexcept {
  try {
    return static_cast<int32_t>(TheEngine().ProcessSetRanks(id).size());
  } catch (...) {
    return 0;
  }
}

int32_t Initialized() noexcept { return TheEngine().initialized() ? 1 : 0; }

const shvd_api kApi = {SHVD_C_API_VERSION, static_cast<int32_t>(sizeof(shvd_api)),
                       &Enqueue,           &Result,
                       &Release,           &ProcessSetRank,
                       &ProcessSetSize,    &Initialized};

}  // namespace
}  // namespace spark_hvd

extern "C" __attribute__((visibility("default"))) const shvd_api* spark_hvd_c_api(int32_t version) {
  return version == SHVD_C_API_VERSION ? &spark_hvd::kApi : nullptr;
}
