// The adapter's side of the C entry points (spark_hvd/include/spark_hvd/c_api.h): the
// bound table, the thread that finishes TensorFlow's kernels, statuses, dtypes, and the
// buffer through which an output the core allocated becomes a tf.Tensor without a copy.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "spark_hvd/c_api.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace spark_hvd_tf {

namespace tf = ::tensorflow;

// The core's table, bound once by spark_hvd_tf_bind (Python calls it after loading).
inline const shvd_api*& Api() {
  static const shvd_api* api = nullptr;
  return api;
}

// Runs the kernels' completions (TensorFlow's `done`, which may schedule more of the
// graph) on a thread of the adapter, never on the core's threads, which must not block
// (c_api.h). One thread, in completion order; made at first use and never joined (it
// waits on its queue until the process exits).
class Completer {
 public:
  static Completer& Get() {
    static Completer* c = new Completer();
    return *c;
  }
  void Post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(fn));
    }
    cv_.notify_one();
  }

 private:
  Completer() {
    std::thread([this] { Loop(); }).detach();
  }
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return !queue_.empty(); });
      std::deque<std::function<void()>> batch;
      batch.swap(queue_);
      lock.unlock();
      for (auto& fn : batch) fn();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
};

// spark_hvd's exception class of each StatusCode (spark_hvd/exceptions.py).
inline const char* ClassOf(int32_t code) {
  switch (code) {
    case 2:
      return "InvalidArgumentError";
    case 3:
      return "TensorMismatchError";
    case 4:
      return "NotInitializedError";
    case 5:
      return "CollectiveTimeoutError";
    case 6:
      return "PeerLostError";
    case 7:
      return "StoreError";
    case 8:
      return "AuthenticationError";
    case 9:
      return "InternalError";
    default:
      return "SparkHvdError";
  }
}

// A spark_hvd failure as TensorFlow's status, of the class Horovod's TensorFlow ops
// raise: FailedPrecondition for a mismatch between ranks (and use before init),
// InvalidArgument for a bad argument, Unknown for a failed collective (a lost or silent
// peer, an internal error). The message starts with the spark_hvd class, and payloads
// carry the code, ranks, tensor and message, from which Python rebuilds the spark_hvd
// exception (spark_hvd/tensorflow/_kernels.py).
inline tf::Status StatusOf(int32_t code, const std::string& message, const std::string& tensor,
                           const int32_t* ranks, int32_t nranks) {
  std::string text = std::string("spark_hvd.exceptions.") + ClassOf(code) + ": " + message;
  tf::Status s;
  switch (code) {
    case 2:
      s = absl::InvalidArgumentError(text);
      break;
    case 3:
    case 4:
      s = absl::FailedPreconditionError(text);
      break;
    default:
      s = absl::UnknownError(text);
      break;
  }
  std::string rank_list;
  for (int32_t i = 0; i < nranks; ++i) rank_list += (i ? "," : "") + std::to_string(ranks[i]);
  // (absl::Cord from a string_view: TensorFlow's libraries export that constructor only.)
  const std::string code_text = std::to_string(code);
  s.SetPayload("spark_hvd.code", absl::Cord(absl::string_view(code_text)));
  s.SetPayload("spark_hvd.ranks", absl::Cord(absl::string_view(rank_list)));
  s.SetPayload("spark_hvd.tensor", absl::Cord(absl::string_view(tensor)));
  s.SetPayload("spark_hvd.message", absl::Cord(absl::string_view(message)));
  return s;
}

inline tf::Status StatusOf(const shvd_result& r) {
  return StatusOf(r.code, r.message ? r.message : "", r.tensor ? r.tensor : "", r.ranks, r.nranks);
}

// The core's DataType of a TensorFlow dtype, -1 when it has none. Bit-exact ops
// (broadcast, allgather, alltoall) move unsigned ints as signed ones of the same width.
inline int32_t CoreDtype(tf::DataType dt, bool bit_exact) {
  switch (dt) {
    case tf::DT_UINT8:
      return 0;
    case tf::DT_INT8:
      return 1;
    case tf::DT_INT16:
      return 2;
    case tf::DT_INT32:
      return 3;
    case tf::DT_INT64:
      return 4;
    case tf::DT_HALF:
      return 5;
    case tf::DT_BFLOAT16:
      return 6;
    case tf::DT_FLOAT:
      return 7;
    case tf::DT_DOUBLE:
      return 8;
    case tf::DT_BOOL:
      return 9;
    case tf::DT_UINT16:
      return bit_exact ? 2 : -1;
    case tf::DT_UINT32:
      return bit_exact ? 3 : -1;
    case tf::DT_UINT64:
      return bit_exact ? 4 : -1;
    default:
      return -1;
  }
}

// An output the core allocated, as a TensorBuffer: the tensor holds the op's handle,
// and the last reference to the tensor releases it (and the core's memory with it).
class CoreBuffer : public tf::TensorBuffer {
 public:
  CoreBuffer(shvd_work* work, void* data, int64_t bytes)
      : tf::TensorBuffer(data), work_(work), bytes_(bytes) {}
  ~CoreBuffer() override { Api()->release(work_); }
  size_t size() const override { return static_cast<size_t>(bytes_); }
  tf::TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(tf::AllocationDescription* proto) const override {
    proto->set_requested_bytes(bytes_);
    proto->set_allocator_name("spark_hvd");
  }
  bool OwnsMemory() const override { return false; }

 private:
  shvd_work* work_;
  int64_t bytes_;
};

}  // namespace spark_hvd_tf
