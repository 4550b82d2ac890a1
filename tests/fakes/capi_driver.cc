// A test driver of spark_hvd's C entry points (spark_hvd/include/spark_hvd/c_api.h): what a
// framework adapter does (spark_hvd's TensorFlow GPU kernels), without a framework, so the
// device path can run against the fake CUDA runtime and NCCL where TensorFlow cannot hand
// out a device tensor (tests/multiproc/cases_nccl.py, "nccl_capi/*").
//
// shvd_capi_run enqueues one op with an owner that only counts its release, then waits for
// its completion callback (which, as the header asks, only signals), and hands back the op's
// handle for shvd_capi_output / shvd_capi_release.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "spark_hvd/c_api.h"

namespace {

std::atomic<int64_t> owners_released{0};

struct Done {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
};

void OnDone(void* arg) {
  auto* d = static_cast<Done*>(arg);
  {
    std::lock_guard<std::mutex> lock(d->mu);
    d->done = true;
  }
  d->cv.notify_all();
}

void ReleaseOwner(void*) { owners_released.fetch_add(1); }

const shvd_api* Api(const void* api) { return static_cast<const shvd_api*>(api); }

}  // namespace

// Runs one op: its StatusCode (0: done), -2 when its callback did not come within
// timeout_ms, or enqueue's refusal; *work is the handle (null when refused).
extern "C" int32_t shvd_capi_run(const void* api, int32_t op, const char* name, int32_t dtype,
                                 const int64_t* shape, int32_t ndim, const void* input,
                                 void* output, int32_t reduce_op, int32_t root, int32_t device,
                                 void* stream, int32_t timeout_ms, void** work, char* message,
                                 size_t message_size) {
  auto* done = new Done;  // leaked if the callback never comes: it may still
  shvd_op o{};
  o.op = op;
  o.name = name;
  o.dtype = dtype;
  o.shape = shape;
  o.ndim = ndim;
  o.input = input;
  o.output = output;
  o.reduce_op = reduce_op;
  o.prescale = o.postscale = 1.0;
  o.root = root;
  o.device = device;
  o.stream = stream;
  o.owner = done;  // any non-null pointer: the release only counts
  o.release_owner = &ReleaseOwner;
  o.done = &OnDone;
  o.done_arg = done;
  shvd_work* w = nullptr;
  *work = nullptr;
  const int32_t rc = Api(api)->enqueue(&o, 1, &w, message, message_size);
  if (rc != 0) {
    delete done;
    return rc;
  }
  *work = w;
  std::unique_lock<std::mutex> lock(done->mu);
  if (!done->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                         [done] { return done->done; })) {
    return -2;
  }
  lock.unlock();
  delete done;
  shvd_result r;
  Api(api)->result(w, &r);
  if (r.code != 0 && message_size > 0) {
    std::strncpy(message, r.message ? r.message : "", message_size - 1);
    message[message_size - 1] = '\0';
  }
  return r.code;
}

// The output the core allocated for the op (allgather, alltoall, reducescatter).
extern "C" void shvd_capi_output(const void* api, void* work, void** data, int64_t* bytes,
                                 int32_t* device, int64_t* shape, int32_t* ndim) {
  shvd_result r;
  Api(api)->result(static_cast<shvd_work*>(work), &r);
  *data = r.data;
  *bytes = r.bytes;
  *device = r.device;
  *ndim = r.ndim;
  for (int32_t i = 0; i < r.ndim && i < 8; ++i) shape[i] = r.shape[i];
}

extern "C" void shvd_capi_release(const void* api, void* work) {
  Api(api)->release(static_cast<shvd_work*>(work));
}

extern "C" int64_t shvd_capi_owners_released() { return owners_released.load(); }
