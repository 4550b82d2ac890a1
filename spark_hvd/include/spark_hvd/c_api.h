/* spark_hvd's C entry points for framework adapters.
 *
 * A framework adapter (the TensorFlow op library, spark_hvd/tensorflow/kernels/) is a
 * shared library built apart from the core, against a framework's headers. It reaches
 * the engine of the _core module that Python loaded through this table of plain C
 * functions, so nothing of the core's C++ crosses the boundary and the core includes no
 * framework header. The table comes from _core's exported
 *
 *     const shvd_api* spark_hvd_c_api(int32_t version);
 *
 * (null when _core does not speak `version`); Python hands its address to the adapter
 * once, after loading both.
 *
 * Ownership (the memory-safety rule): an op's input and output memory belongs to the
 * adapter's `owner`, which the core holds until it has finished with the op, whatever
 * happens meanwhile, and then releases with `release_owner` (exactly once, on any thread,
 * with no lock held and no Python; also when `enqueue` refuses the op). What the core allocates
 * (allgather, alltoall and reducescatter outputs) belongs to the op's shvd_work and stays valid
 * until the adapter calls `release` on it.
 *
 * Completion: `done(done_arg)` is called exactly once per op that `enqueue` accepted,
 * right after the op completed, on whichever thread completed it (the engine's, the one
 * that polls GPU work, or a thread stopping the engine). It must return at once and
 * must not call into this table: an adapter hands the completion to a thread of its
 * own. Ops that `enqueue` refused are never completed: their callbacks are not called.
 *
 * Version 1. The numbers (op, dtype, reduce_op, status codes) are spark_hvd._core's
 * OpType, DataType, ReduceOp and StatusCode.
 */
#ifndef SHVD_C_API_H_
#define SHVD_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHVD_C_API_VERSION 1

typedef struct shvd_work shvd_work; /* one accepted op, until `release` */

typedef struct shvd_op {
  int32_t op; /* OpType: allreduce 0, allgather 1, broadcast 2, alltoall 3, reducescatter 4,
                 barrier 5, join 6 */
  const char* name;
  int32_t dtype;
  const int64_t* shape;
  int32_t ndim;
  const void* input;
  void* output; /* allreduce and broadcast: where the result goes; else null */
  int32_t reduce_op;
  double prescale;
  double postscale;
  int32_t root; /* broadcast: a rank within the process set */
  int32_t process_set;
  int32_t device;        /* -1: host memory; else the CUDA device ordinal of input and output */
  void* stream;          /* a device input: the CUDA stream that produced it (null: the default) */
  const int64_t* splits; /* alltoall: rows sent to each rank of the set */
  int32_t nsplits;
  const char* group; /* grouped ops: the group's name, negotiated together; "" or null: none */
  int32_t group_size;
  void* owner;
  void (*release_owner)(void* owner);
  void (*done)(void* done_arg);
  void* done_arg;
} shvd_op;

typedef struct shvd_result {
  int32_t code;         /* StatusCode: 0 when the op succeeded */
  const char* message;  /* the failure: what happened, the evidence and the fix */
  const char* tensor;   /* the op the failure is about ("" when none) */
  const int32_t* ranks; /* the ranks the failure is about */
  int32_t nranks;
  void* data; /* an output the core allocated (allgather, alltoall, reducescatter), else null */
  int64_t bytes;
  int32_t device;       /* of data: -1 host, else the CUDA device ordinal */
  const int64_t* shape; /* of data */
  int32_t ndim;
  const int64_t* received_splits; /* alltoall: rows received from each rank of the set */
  int32_t nreceived;
  int64_t value; /* join: the last rank to join */
} shvd_result;

typedef struct shvd_api {
  int32_t version;
  int32_t struct_size; /* sizeof(shvd_api) of the core: later versions only append */

  /* Validates and queues ops[0..n) together: all of them, or none when any is refused (a
   * group is never left half submitted). On success works[i] is op i's handle (written
   * before any op can complete, so a `done` may read it) and 0 is returned; else the StatusCode,
   * with the reason in error[0..error_size) (what was wrong and the fix), and no callback of these
   * ops is ever called. */
  int32_t (*enqueue)(const shvd_op* ops, int32_t n, shvd_work** works, char* error,
                     size_t error_size);
  /* The outcome of a completed op (after its `done`); the pointers stay valid until
   * `release`. Before completion, code is -1. */
  void (*result)(const shvd_work* work, shvd_result* out);
  /* Gives up the handle (and with it the output the core allocated). Any thread. */
  void (*release)(shvd_work* work);

  /* This process's rank in process set `id`, -1 when not a member or the set is unknown;
   * the set's size, 0 when unknown; both read when called (an elastic job changes them). */
  int32_t (*process_set_rank)(int32_t id);
  int32_t (*process_set_size)(int32_t id);
  int32_t (*initialized)(void);
} shvd_api;

#ifdef __cplusplus
}
#endif

#endif /* SHVD_C_API_H_ */
