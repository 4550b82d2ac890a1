// HostAdasum: op=Adasum on host-memory tensors, for every CPU backend (tcp, gloo,
// mpi, plugins), built on the communicator's Alltoallv used between pairs of ranks.
//
// Adasum (Maleki et al., 2021) combines two vectors as
//
//   adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
//
// (a coefficient is 1 when its vector's squared norm is below 1e-8, as in Horovod),
// and 2^k ranks' vectors as a binary tree: ranks (0, 1), (2, 3), ... first, then the
// results pairwise, and so on. The algorithm is the paper's (and Horovod's) recursive
// vector halving, distance doubling; no rank ever holds more than its own vector
// plus half of it:
//
// 1. Each rank copies its tensors, prescaled, into one vector W of N elements
//    (a lone tensor is worked on in its output); tensor i is W[off_i, off_i + n_i).
//    The rank "holds" W[lo, hi) = [0, N).
// 2. For d = 1, 2, 4, ..., size / 2: rank r pairs with r ^ d. Of the held range the
//    lower rank of the pair (r & d == 0) keeps the first floor(len / 2) elements, the
//    upper one the rest; each sends its partner the partner's part of W and receives
//    the partner's values of its own part (one exchange, into a scratch of
//    ceil(N / 2) elements). Call a the lower rank's values, b the upper rank's.
// 3. Per tensor, over the elements of it the rank keeps: a.b, |a|^2 and |b|^2 in
//    double. The 2d ranks of r's block (r with its low bits cleared) together keep
//    every element exactly once, so summing these 3 doubles per tensor over the block
//    gives the whole tensors' values. The sum is recursive doubling: exchanges with
//    r ^ 1, r ^ 2, ..., r ^ d, each adding the partner's sums (both sides add the same
//    two numbers, so every rank of the block gets the same bits).
// 4. Each rank combines its part per tensor, W = ca a + cb b: W[lo, hi) is now its
//    part of the Adasum of the 2d vectors of its block.
// 5. After the last level each rank holds 1/size of the result. The levels are
//    undone in reverse order (d = size / 2, ..., 1): each rank sends its range to
//    r ^ d and receives the partner's into W, until every rank holds all of W.
// 6. W is multiplied by the postscale and copied into the outputs.
//
// Arithmetic: the dot products in double; the combination in double for float32 and
// float64, in float32 for float16 and bfloat16 (rounded to the dtype at every level,
// as Horovod's). Every element of the result is computed by one rank and sent to the
// others, so all ranks end bit-identical.
//
// Preconditions (the engine refuses the others at submit): a power-of-two number of
// ranks (Horovod's rule), a floating-point dtype, host memory. A rank that holds no
// tensor (input null) contributes zeros, Adasum's neutral vector.
#pragma once

#include "backends/communicator.h"

namespace spark_hvd {

Status HostAdasum(const ReduceArgs& args, Communicator* comm);

// The dtypes HostAdasum combines: float16, bfloat16, float32, float64.
bool AdasumDataType(DataType dtype);

}  // namespace spark_hvd
