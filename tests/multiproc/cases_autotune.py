"""Autotune (SPARK_HVD_AUTOTUNE) under the settings test_mp_autotune.py sets: results
stay right while the fusion threshold and cycle time switch, every rank applies the same
parameters at the same cycle, and rank 0's log holds the tried configurations."""

from __future__ import annotations

import csv
import os

import numpy as np

import spark_hvd as hvd
from harness import Registry
from refdata import Checks, reduce, values

CASES = Registry()
MIB = 1 << 20
THRESHOLDS = [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 128 * MIB]
CYCLE_TIMES = [0.5, 1.0, 2.5, 5.0]
# One training step: about 1.4 MB of float32 in six tensors, and a few others, all in
# flight together, so a 1 MiB threshold cuts the step into several fused responses.
SPECS = [(np.float32, (60_000,))] * 6 + [(np.int32, (3001,)), (np.float64, (513,)),
                                          (np.float32, (7,))]
STEPS = 70  # the search at test_mp_autotune.py's settings takes 60 steps (8 configurations)
SALTS = 3   # inputs repeat every SALTS steps (their expected sums are computed once)


def _env(*names):
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _dedupe(seq):
    out = []
    for x in seq:
        if not out or out[-1] != x:
            out.append(x)
    return out


@CASES.case("autotune/steps_stay_right_while_switching", timeout_s=120)
def _(ctx):
    n, me = ctx.size, ctx.rank
    chk = Checks()
    seen = set()
    inputs = [[values(dt, me, shape, salt=i + k) for i, (dt, shape) in enumerate(SPECS)]
              for k in range(SALTS)]
    wants = [[reduce([values(dt, r, shape, salt=i + k) for r in range(n)], "Sum", dt)
              for i, (dt, shape) in enumerate(SPECS)] for k in range(SALTS)]
    for step in range(STEPS):
        k = step % SALTS
        hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"at.{i}") for i, x in enumerate(inputs[k])]
        for i, h in enumerate(hs):
            chk.same(hvd.synchronize(h), wants[k][i], f"step {step} tensor {i}")
        seen.add(hvd._core.tuned_parameters()["fusion_threshold"])
    chk.done()
    if _env("SPARK_HVD_AUTOTUNE", "HOROVOD_AUTOTUNE") == "1" and \
            not _env("SPARK_HVD_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"):
        assert len(seen) > 1, f"rank {me} saw only the thresholds {seen} while searching"


@CASES.case("autotune/every_rank_applied_the_same_at_the_same_cycle")
def _(ctx):
    mine = hvd._core.tuned_parameters()
    everyone = hvd.allgather_object(mine, name="at.params")
    for r, theirs in enumerate(everyone):
        assert theirs == everyone[0], f"rank {r}: {theirs}\nrank 0: {everyone[0]}"
    tuned = _env("SPARK_HVD_AUTOTUNE", "HOROVOD_AUTOTUNE") == "1"
    fixed = _env("SPARK_HVD_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD")
    assert mine["autotune"] is tuned and mine["searching"] is False, mine
    history = mine["history"]
    if not tuned:
        assert history == [], mine
        assert mine["fusion_threshold"] == int(fixed or 64 * MIB), mine
        assert mine["cycle_time_ms"] == 1.0, mine
        return
    cycles = [c for c, _, _ in history]
    assert cycles == sorted(set(cycles)) and cycles[0] >= 1, history
    assert (mine["fusion_threshold"], mine["cycle_time_ms"]) == tuple(history[-1][1:]), mine
    if fixed:
        assert {t for _, t, _ in history} == {int(fixed)}, history
    # Rank 0's log: a header, one line per configuration tried, the chosen one last.
    if ctx.rank == 0:
        with open(os.environ["SPARK_HVD_AUTOTUNE_LOG"]) as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["fusion_threshold_bytes", "cycle_time_ms", "bytes_per_second",
                           "best"], rows
        tried = [(int(t), float(c), float(s)) for t, c, s, b in rows[1:-1]]
        assert all(b == "0" for *_, b in rows[1:-1]) and rows[-1][3] == "1", rows
        chosen = (int(rows[-1][0]), float(rows[-1][1]), float(rows[-1][2]))
        assert all(s > 0 for *_, s in tried), tried
        if fixed:
            want = [(int(fixed), c) for c in CYCLE_TIMES]
        else:
            first = [(t, 1.0) for t in THRESHOLDS]
            best_t = max(tried[:len(THRESHOLDS)], key=lambda x: x[2])[0]
            want = first + [(best_t, c) for c in CYCLE_TIMES if (best_t, c) not in first]
        assert [(t, c) for t, c, _ in tried] == want, tried
        assert chosen[2] == max(s for *_, s in tried), (chosen, tried)
        assert chosen[:2] in [(t, c) for t, c, s in tried if s == chosen[2]], (chosen, tried)
        assert (mine["fusion_threshold"], mine["cycle_time_ms"]) == chosen[:2], (mine, chosen)
        # Every configuration was in force on every rank, in the order tried.
        assert [tuple(h[1:]) for h in history] == _dedupe(want + [chosen[:2]]), history
