"""Rank functions: DistributedOptimizer under what today's torch programs add to a step,
``torch.compile`` and ``torch.autocast`` with a GradScaler loss scale.

The same equivalence as rank_optimizer.py (n ranks on their 1/n of every batch end where
one process ends on the whole batches), plus: every rank holds bit-identical parameters,
and the compiled model's gradients still reach the allreduce from autograd's hooks during
backward (not only from step()'s catch-up).

The compiled model uses ``backend="aot_eager"``: AOTAutograd's joint forward/backward
graph, the part that decides whether the parameters' post-accumulate-grad hooks fire and
when, without inductor's C++ code generation (a compile of many seconds per rank and rank
count on the 2-core CI box; inductor was checked by hand with
``TEST_TORCH_COMPILE_BACKEND=inductor``). Even so the first compile in a process takes
7-11 s here (dynamo's imports and tracing), so it runs at 2 ranks only.
"""

import os

import torch
import torch.nn.functional as F

import spark_hvd.torch as hvd
from rank_optimizer import (TOL, assert_close_models, batches, make_model, rn, sgd, shard,
                            train_distributed, train_reference)

BACKEND = os.environ.get("TEST_TORCH_COMPILE_BACKEND", "aot_eager")
STEPS = 5
# bfloat16 keeps 8 bits of mantissa: a rank's forward and backward on its shard round
# differently from one process's on the whole batch (the updates agree to ~1e-3 here).
BF16_TOL = 2e-2
SCALE = 2.0 ** 12


def assert_same_on_every_rank(model, what):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.broadcast(flat, 0, name=f"same.{what}"), flat), \
        f"{what}: rank {hvd.rank()}'s parameters differ from rank 0's"


class Skip(Exception):
    pass


def check_compiled_model_matches_eager():
    _, n = rn()
    if n != 2:  # the first compile in a process costs 7-11 s here; one rank count will do
        raise Skip("torch.compile is checked at 2 ranks")
    data = batches(STEPS)
    eager, _ = train_distributed(sgd, data)
    model = make_model()
    compiled = torch.compile(model, backend=BACKEND)
    hvd.broadcast_parameters(compiled.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(sgd(compiled.parameters()),
                                   named_parameters=compiled.named_parameters())
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        out = compiled(shard(x))
        assert type(out.grad_fn).__name__ == "CompiledFunctionBackward", out.grad_fn
        F.mse_loss(out, shard(y)).backward()
        if n > 1:  # the hooks fired in backward: every gradient is already in flight
            assert len(opt._hvd_handles) == len(list(model.parameters())), \
                f"step {step}: {len(opt._hvd_handles)} allreduces started in backward"
        opt.step()
    assert_close_models(model, eager, TOL, f"compiled ({BACKEND}) vs eager")
    assert_close_models(model, train_reference(sgd, data), TOL, f"compiled ({BACKEND})")
    assert_same_on_every_rank(model, "compiled")


def _train_amp(data, distributed, poison_rank=None):
    """SGD steps under autocast(bfloat16) with a GradScaler; distributed in Horovod's order
    (synchronize, unscale_, step under skip_synchronize, update). ``poison_rank``'s loss is
    infinite at the first step. Returns the model and each step's scale."""
    model = make_model()
    opt = sgd(model.parameters())
    if distributed:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scales = []
    for step, (x, y) in enumerate(data):
        if distributed:
            x, y = shard(x), shard(y)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        assert out.dtype == torch.bfloat16
        loss = F.mse_loss(out.float(), y)
        if step == 0 and poison_rank == hvd.rank():
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if distributed:
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, scales


def check_autocast_bf16_with_grad_scaler():
    data = batches(STEPS)
    model, scales = _train_amp(data, distributed=True)
    ref, ref_scales = _train_amp(data, distributed=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert scales == ref_scales == [SCALE] * STEPS, (scales, ref_scales)
    assert_close_models(model, ref, BF16_TOL, "autocast bf16 + GradScaler")
    assert_same_on_every_rank(model, "amp")


def check_grad_scaler_inf_on_one_rank_skips_the_step_everywhere():
    # The last rank's first loss is infinite: the averaged gradients are inf/NaN on every
    # rank, so every rank skips that step and halves its scale, and then trains on.
    _, n = rn()
    data = batches(2)
    model, scales = _train_amp(data, distributed=True, poison_rank=n - 1)
    assert scales == [SCALE / 2, SCALE / 2], scales
    assert_same_on_every_rank(model, "inf")
    # one step (the second) from the initial parameters, as one process would take it
    ref, _ = _train_amp(data[1:], distributed=False)
    assert_close_models(model, ref, BF16_TOL, "after a skipped step")


def check_grad_scaler_step_before_synchronize_is_refused():
    # The plain single-process order (scaler.step right after backward) would unscale and
    # check the gradients while their allreduces write into them: refused, naming the order.
    _, n = rn()
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    x, y = batches(1)[0]
    scaler.scale(F.mse_loss(model(shard(x)), shard(y))).backward()
    if n == 1:  # nothing in flight with one rank: the plain order works
        scaler.step(opt)
        scaler.update()
        return
    try:
        scaler.step(opt)
    except hvd.GradientsPendingError as e:
        assert "optimizer.synchronize() after scaler.scale(loss).backward()" in str(e), e
    else:
        raise AssertionError("scaler.step() with allreduces in flight was not refused")
    opt.synchronize()  # the allreduces end before the next check
