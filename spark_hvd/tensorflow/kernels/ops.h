// The ops of spark_hvd's TensorFlow adapter: their inputs, attributes and shapes.
//
// Each collective op takes a list of tensors: one for a plain collective, several for a
// group negotiated together (`grouped`) or a batch submitted together (broadcast of many
// variables). `tensor_name` is the collective's name, the same on every rank (a list's members
// are `<name>.<i>`): an input, not an attribute, so that an eager loop of ops named anew
// each call keeps using one kernel instead of filling TensorFlow's kernel cache. The collectives
// are not stateful, as Horovod's are not: a graph runs independent ones in any order, so ranks may
// build them in different orders, and one whose result nothing uses is pruned (on every rank
// alike). Barrier, join and the process-set queries are stateful (they have no data to depend on,
// or their answer changes between runs in an elastic job).
#pragma once

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace spark_hvd_tf {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

#define SHVD_REDUCED_TYPES "{uint8, int8, int16, int32, int64, half, bfloat16, float, double, bool}"
#define SHVD_ALL_TYPES                                                                         \
  "{uint8, int8, uint16, int16, int32, uint32, int64, uint64, half, bfloat16, float, double, " \
  "bool}"

inline absl::Status SameShapes(InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
  return absl::OkStatus();
}

// Outputs whose first dimension is known only once every rank has answered.
inline absl::Status FirstDimUnknown(InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) {
    ShapeHandle in = c->input(i), out;
    if (!c->RankKnown(in)) {
      c->set_output(i, c->UnknownShape());
      continue;
    }
    if (c->Rank(in) == 0) {  // a scalar counts as one row
      c->set_output(i, c->Vector(c->UnknownDim()));
      continue;
    }
    TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
    c->set_output(i, out);
  }
  return absl::OkStatus();
}

inline absl::Status Scalar(InferenceContext* c) {
  c->set_output(0, c->Scalar());
  return absl::OkStatus();
}

// Allreduce and reducescatter: the tensors, then the prescale and postscale factors.
#define SHVD_REDUCTION_OP(op_name, shape_fn)        \
  REGISTER_OP(op_name)                              \
      .Input("tensors: T")                          \
      .Input("prescale: double")                    \
      .Input("postscale: double")                   \
      .Input("tensor_name: string")                 \
      .Output("reduced: T")                         \
      .Attr("T: list(" SHVD_REDUCED_TYPES ") >= 1") \
      .Attr("reduce_op: int")                       \
      .Attr("process_set_id: int = 0")              \
      .Attr("grouped: bool = false")                \
      .SetShapeFn(shape_fn)

SHVD_REDUCTION_OP("SparkHvdAllreduce", SameShapes);
SHVD_REDUCTION_OP("SparkHvdReducescatter", FirstDimUnknown);

REGISTER_OP("SparkHvdAllgather")
    .Input("tensors: T")
    .Input("tensor_name: string")
    .Output("gathered: T")
    .Attr("T: list(" SHVD_ALL_TYPES ") >= 1")
    .Attr("process_set_id: int = 0")
    .Attr("grouped: bool = false")
    .SetShapeFn(FirstDimUnknown);

REGISTER_OP("SparkHvdBroadcast")
    .Input("tensors: T")
    .Input("tensor_name: string")
    .Output("broadcast: T")
    .Attr("T: list(" SHVD_ALL_TYPES ") >= 1")
    .Attr("root_rank: int")  // a rank of the process set
    .Attr("process_set_id: int = 0")
    .Attr("grouped: bool = false")
    .SetShapeFn(SameShapes);

// splits: rows sent to each rank of the set (empty: the first dimension split evenly).
REGISTER_OP("SparkHvdAlltoall")
    .Input("tensor: T")
    .Input("splits: int32")
    .Input("tensor_name: string")
    .Output("received: T")
    .Output("received_splits: int32")
    .Attr("T: " SHVD_ALL_TYPES)
    .Attr("process_set_id: int = 0")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(FirstDimUnknown(c));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    });

REGISTER_OP("SparkHvdBarrier")
    .Input("tensor_name: string")
    .Output("done: bool")
    .Attr("process_set_id: int = 0")
    .SetIsStateful()
    .SetShapeFn(Scalar);

REGISTER_OP("SparkHvdJoin").Output("last_rank: int32").SetIsStateful().SetShapeFn(Scalar);

// size, rank (within the set, -1 outside it) or included (1 or 0), read when it runs.
REGISTER_OP("SparkHvdProcessSetQuery")
    .Output("value: int32")
    .Attr("query: {'size', 'rank', 'included'}")
    .Attr("process_set_id: int = 0")
    .SetIsStateful()
    .SetShapeFn(Scalar);

}  // namespace spark_hvd_tf
