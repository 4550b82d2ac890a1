"""Adasum on CPU tensors, in the framework layer.

The core reduces with Sum/Average/Min/Max/Product only, so ``op=Adasum`` is an
allgather of every rank's (flattened) tensor followed by the same deterministic
combination on every rank:

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

applied pairwise up a binary tree over the ranks in rank order: level 0 pairs
(r0, r1), (r2, r3), ...; each level pairs the previous level's results the same
way. With a number of ranks that is not a power of two, the element left without
a partner at a level moves up unchanged and is paired at the next level where
it has one (3 ranks: adasum(adasum(r0, r1), r2)); so with 2^k ranks this is
exactly the recursive halving tree of the Adasum paper, and otherwise the last
ranks sit higher in the tree. A zero vector is the neutral element (adasum(a, 0)
= a), which is also how ranks that have called join() take part: they
contribute no rows to the allgather.

Dot products and the combination run in float64 and the result is cast back to
the input's dtype, so every rank computes bit-identical results.
"""

from __future__ import annotations

from typing import List

import torch

from spark_hvd.exceptions import InvalidArgumentError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_dtype(tensor: torch.Tensor) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(f"op=Adasum needs a floating-point tensor, got {tensor.dtype}")


def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two float64 vectors."""
    dot = torch.dot(a, b)
    na = torch.dot(a, a)
    nb = torch.dot(b, b)
    ca = 1.0 - dot / (2.0 * na) if na > 0 else a.new_tensor(1.0)
    cb = 1.0 - dot / (2.0 * nb) if nb > 0 else b.new_tensor(1.0)
    return ca * a + cb * b


def combine(vectors: List[torch.Tensor]) -> torch.Tensor:
    """Binary-tree Adasum of 1-D vectors, in their order (see the module docstring)."""
    if not vectors:
        raise InvalidArgumentError("Adasum of zero tensors")
    level = [v.to(torch.float64) for v in vectors]
    while len(level) > 1:
        nxt = [pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def combine_gathered(gathered: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """gathered: every active rank's flattened tensor, concatenated; returns the
    Adasum with the shape and dtype of ``like``."""
    n = like.numel()
    if n == 0:
        return like.clone()
    rows = gathered.reshape(-1, n)
    return combine(list(rows.unbind(0))).to(like.dtype).reshape(like.shape)
