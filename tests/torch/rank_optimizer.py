"""Rank functions: DistributedOptimizer, broadcast_parameters/optimizer_state.

Equivalence: n ranks, each on its 1/n of every batch, with DistributedOptimizer
(Average) must end with the parameters a single process reaches on the whole
batches (same init, same optimizer); each rank trains that reference itself.
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import spark_hvd.torch as hvd

BATCH = 24  # divisible by 1, 2, 3 ranks and by 2 micro-batches
STEPS = 10
TOL = 1e-5


class Skip(Exception):
    pass


def rn():
    return hvd.rank(), hvd.size()


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def batches(steps=STEPS, seed=42):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g))
            for _ in range(steps)]


def shard(t):
    r, n = rn()
    k = t.shape[0] // n
    return t[r * k:(r + 1) * k]


def train_reference(make_opt, data, clip=None, loss_scale=1.0):
    model = make_model()
    opt = make_opt(model.parameters())
    for x, y in data:
        opt.zero_grad()
        (F.mse_loss(model(x), y) * loss_scale).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def train_distributed(make_opt, data, passes=1, clip=None, seed=0, **kwargs):
    model = make_model(seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    for x, y in data:
        opt.zero_grad()
        for xm, ym in zip(shard(x).chunk(passes), shard(y).chunk(passes)):
            (F.mse_loss(model(xm), ym) / passes).backward()
        if clip is None:
            opt.step()
        else:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
    return model, opt


def max_diff(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def assert_close_models(a, b, tol, what):
    d = max_diff(a, b)
    assert d <= tol, f"{what}: parameters differ by {d:.3g} (> {tol})"
    moved = max_diff(a, make_model())
    assert moved > 1e-3, f"{what}: training did not move the parameters ({moved})"


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


# -- numerical equivalence -------------------------------------------------------------

def check_equivalence_sgd_momentum():
    data = batches()
    model, opt = train_distributed(sgd, data)
    assert isinstance(opt, torch.optim.SGD)
    assert_close_models(model, train_reference(sgd, data), TOL, "SGD momentum")


def check_equivalence_adam():
    data = batches()
    model, _ = train_distributed(adam, data)
    assert_close_models(model, train_reference(adam, data), TOL, "Adam")


def check_equivalence_adamw_and_rmsprop():
    data = batches(5)
    for make in (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
                 lambda p: torch.optim.RMSprop(p, lr=0.01)):
        model, _ = train_distributed(make, data)
        assert_close_models(model, train_reference(make, data), TOL, "AdamW/RMSprop")


def check_equivalence_backward_passes_per_step():
    data = batches()
    for make in (sgd, adam):
        model, _ = train_distributed(make, data, passes=2)
        assert_close_models(model, train_reference(make, data), TOL, "backward_passes_per_step=2")


def check_equivalence_groups():
    data = batches()
    model, _ = train_distributed(sgd, data, groups=2)
    assert_close_models(model, train_reference(sgd, data), TOL, "groups=2")
    ref = train_reference(adam, data)
    # groups given as lists of parameters; model[4].weight stays ungrouped
    model = make_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    groups = [list(model[0].parameters()), list(model[2].parameters()) + [model[4].bias]]
    opt = hvd.DistributedOptimizer(adam(model.parameters()),
                                   named_parameters=model.named_parameters(), groups=groups)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(shard(x)), shard(y)).backward()
        opt.step()
    assert_close_models(model, ref, TOL, "groups as lists")


def check_equivalence_gradient_predivide_factor():
    data = batches()
    model, _ = train_distributed(sgd, data, gradient_predivide_factor=2.0)
    assert_close_models(model, train_reference(sgd, data), TOL, "gradient_predivide_factor=2")


def check_equivalence_sum_op_and_unnamed():
    _, n = rn()
    data = batches(5)
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), op=hvd.Sum)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(shard(x)), shard(y)).backward()
        opt.step()
    ref = train_reference(lambda p: torch.optim.SGD(p, lr=0.05), data, loss_scale=n)
    assert_close_models(model, ref, TOL, "op=Sum, no names")


def check_compression_fp16_bf16():
    data = batches()
    ref = train_reference(adam, data)
    for comp, tol in ((hvd.Compression.fp16, 1e-3), (hvd.Compression.bf16, 1e-2)):
        model, _ = train_distributed(adam, data, compression=comp)
        assert_close_models(model, ref, tol, f"compression {comp.__name__}")
        assert all(p.dtype == torch.float32 for p in model.parameters())
        # every rank holds the same parameters
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert torch.equal(hvd.broadcast(flat, 0), flat), "ranks diverged"


def check_gradient_clipping_with_synchronize():
    data = batches()
    model, opt = train_distributed(sgd, data, clip=0.05)
    assert_close_models(model, train_reference(sgd, data, clip=0.05), TOL, "clipping")
    x, y = data[0]
    F.mse_loss(model(shard(x)), shard(y)).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # after synchronize() without skip_synchronize(): a warning
    assert any("skip_synchronize" in str(w.message) for w in caught), caught


def check_zero_grad_while_pending_raises():
    r, n = rn()
    if n < 2:
        raise Skip("with one rank no allreduce is ever pending")
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    x, y = batches(1)[0]
    F.mse_loss(model(shard(x)), shard(y)).backward()
    try:
        opt.zero_grad()
    except hvd.GradientsPendingError as exc:
        assert "in flight" in str(exc) and "step()" in str(exc), str(exc)
    else:
        raise AssertionError("zero_grad() with pending allreduces did not raise")
    opt.step()  # the pending allreduces complete normally
    opt.zero_grad()
    # a second backward before step() with backward_passes_per_step=1 is an error too
    F.mse_loss(model(shard(x)), shard(y)).backward()
    try:
        F.mse_loss(model(shard(x)), shard(y)).backward()
    except hvd.GradientsPendingError as exc:
        assert "backward_passes_per_step" in str(exc), str(exc)
    else:
        raise AssertionError("a second backward pass before step() did not raise")
    opt.synchronize()


def check_unused_parameter_on_some_ranks():
    r, n = rn()
    torch.manual_seed(3)
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    hvd.broadcast_parameters(list(a.named_parameters()) + [("b." + k, v) for k, v in
                                                           b.named_parameters()], 0)
    params = [("a." + k, v) for k, v in a.named_parameters()] + \
        [("b." + k, v) for k, v in b.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=1.0),
                                   named_parameters=params)
    x = torch.ones(3, 4)
    layer = b if (r == 0 and n > 1) else a  # rank 0 uses b only, the others a only
    layer(x).sum().backward()
    opt.synchronize()
    grads = {k: v.grad for k, v in params}
    users_of_a = n - 1 if n > 1 else 1
    users_of_b = 1 if n > 1 else 0
    full = torch.full((2, 4), 3.0)  # d/dW of sum(W x + c) over 3 rows of ones
    torch.testing.assert_close(grads["a.weight"], full * users_of_a / n)
    if n > 1:  # (one rank: nothing to reduce, an unused parameter keeps grad None)
        torch.testing.assert_close(grads["b.weight"], full * users_of_b / n)
    with opt.skip_synchronize():
        opt.step()


def check_sparse_gradients():
    r, n = rn()
    idx_all = torch.tensor([[0, 1], [2, 2], [5, 1], [3, 9], [1, 1], [0, 7]])
    for as_dense in (False, True):
        emb = nn.Embedding(10, 3, sparse=True)
        ref = nn.Embedding(10, 3)
        torch.manual_seed(5)
        nn.init.normal_(emb.weight)
        hvd.broadcast_parameters(emb.state_dict(), 0)
        ref.weight.data.copy_(emb.weight.data)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=as_dense)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for _ in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            emb(shard(idx_all)).pow(2).mean().backward()
            opt.step()
            ref(idx_all).pow(2).mean().backward()
            ref_opt.step()
        torch.testing.assert_close(emb.weight.data, ref.weight.data, atol=TOL, rtol=0)


def check_adasum_optimizer():
    data = batches(5)
    if hvd.size() & (hvd.size() - 1):  # not a power of two: refused before the local step
        model = make_model()
        before = [p.detach().clone() for p in model.parameters()]
        opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                       named_parameters=model.named_parameters(), op=hvd.Adasum)
        F.mse_loss(model(data[0][0]), data[0][1]).backward()
        try:
            opt.step()
        except hvd.InvalidArgumentError as exc:
            assert "power-of-two" in str(exc), str(exc)
        else:
            raise AssertionError("Adasum optimizer on a non-power-of-two size did not raise")
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        return
    # Same data on every rank: the deltas are identical and their Adasum is the
    # delta itself, so the result is plain local training.
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    assert_close_models(model, train_reference(sgd, data), TOL, "Adasum, identical data")
    # Different data: every rank still ends with the same parameters.
    model, _ = train_distributed(adam, data, op=hvd.Adasum)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.broadcast(flat, 0), flat), "ranks diverged under Adasum"


def check_lr_scheduler_and_state_dict():
    data = batches(4)
    model, opt = train_distributed(sgd, data[:0])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(shard(x)), shard(y)).backward()
        opt.step()
        sched.step()
    assert abs(opt.param_groups[0]["lr"] - 0.025) < 1e-12
    sd = opt.state_dict()  # loads into a plain optimizer
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict(sd)


# -- broadcast_parameters / broadcast_optimizer_state -------------------------------------

def check_broadcast_parameters_forms():
    r, n = rn()
    for form in ("state_dict", "named_parameters", "list"):
        model = make_model(seed=100 + r)  # different on every rank
        target = make_model(seed=100)
        if form == "state_dict":
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        elif form == "named_parameters":
            hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
        else:
            hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
        assert max_diff(model, target) == 0.0, form
    bn = nn.BatchNorm1d(3)
    bn.running_mean.fill_(r)
    bn.num_batches_tracked.fill_(r + 5)
    hvd.broadcast_parameters(bn.state_dict(), root_rank=n - 1)
    assert torch.equal(bn.running_mean, torch.full((3,), float(n - 1)))
    assert int(bn.num_batches_tracked) == n + 4


def _state_fingerprint(opt):
    sd = opt.state_dict()
    out = {"groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]}
    for pid, st in sorted(sd["state"].items()):
        for k, v in sorted(st.items()):
            out[f"{pid}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def _same_fingerprint(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], (k, a[k], b[k])


def check_broadcast_optimizer_state_restores_adam():
    r, n = rn()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01 if r == 0 else 0.5,
                           betas=(0.9, 0.999) if r == 0 else (0.5, 0.6))
    for x, y in batches(3 if r == 0 else 1, seed=10 + r):  # rank-specific history
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), 0)
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), \
        "broadcast_optimizer_state changed the parameters"
    fp = _state_fingerprint(opt)
    root_fp = hvd.broadcast_object(fp, 0)
    _same_fingerprint(fp, root_fp)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert float(opt.state[next(iter(model.parameters()))]["step"]) == 3.0
    # and training continues identically on every rank
    x, y = batches(1, seed=99)[0]
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.broadcast(flat, 0), flat)


def check_broadcast_optimizer_state_empty_and_wrapped():
    r, n = rn()
    # root fresh (empty state), others with state: as Horovod's, root makes its state by a
    # step on zero gradients (Adam's moves nothing), and every rank ends with root's
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if r != 0:
        F.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 4)).backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), 0)
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, 0)
    fresh = _state_fingerprint(opt)
    _same_fingerprint(fresh, hvd.broadcast_object(fresh, 0))
    assert len(opt.state) == len(before), "state should be root's (made by a zero step)"
    assert all(float(st["step"]) == 1.0 and not st["exp_avg"].any() for st in opt.state.values())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # root with state, others fresh; broadcast through a DistributedOptimizer
    model = make_model()
    base = torch.optim.Adam(model.parameters(), lr=0.02)
    if r == 0:
        F.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 4)).backward()
        base.step()
        base.zero_grad()
    dopt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), 0)
    hvd.broadcast_optimizer_state(dopt, 0)
    fp = _state_fingerprint(dopt)
    _same_fingerprint(fp, hvd.broadcast_object(fp, 0))
    assert len(dopt.state) == len(list(model.parameters()))
    x, y = batches(1, seed=7)[0]
    dopt.zero_grad()
    F.mse_loss(model(shard(x)), shard(y)).backward()
    dopt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.broadcast(flat, 0), flat)


def check_broadcast_optimizer_state_nested_and_scalar_state():
    """LBFGS keeps ints and lists of tensors in its state (Horovod refuses it)."""
    r, n = rn()
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(4, dtype=torch.float64))
    hvd.broadcast_parameters([("w", w)], 0)
    opt = torch.optim.LBFGS([w], lr=0.5 if r == 0 else 0.1, history_size=3)
    target = torch.arange(4, dtype=torch.float64) + r

    def closure():
        opt.zero_grad()
        loss = (w - target).square().sum()
        loss.backward()
        return loss

    for _ in range(1 + (r == 0)):
        opt.step(closure)
    hvd.broadcast_parameters([("w", w)], 0)
    hvd.broadcast_optimizer_state(opt, 0)
    state = opt.state_dict()["state"][0]
    fp = {k: (v.clone() if isinstance(v, torch.Tensor) else
              [t.clone() for t in v] if isinstance(v, list) else v) for k, v in state.items()}
    root = hvd.broadcast_object(fp, 0)
    assert fp.keys() == root.keys()
    for k in fp:
        if isinstance(fp[k], torch.Tensor):
            assert torch.equal(fp[k], root[k]), k
        elif isinstance(fp[k], list):
            assert all(torch.equal(a, b) for a, b in zip(fp[k], root[k])), k
        else:
            assert fp[k] == root[k], k
    assert opt.param_groups[0]["lr"] == 0.5 and isinstance(state["n_iter"], int)
