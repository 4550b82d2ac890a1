"""Rank functions for test_compat_ranks.py: DistributedOptimizer and
broadcast_optimizer_state behave as Horovod's. Each holds at any number of ranks."""

import copy
import warnings

import torch

import spark_hvd.torch as hvd

VOCAB, DIM, BATCH = 12, 3, 4


class Skip(Exception):
    pass


def _batch(rank: int):
    """Rank ``rank``'s embedding indices: overlapping and distinct rows across ranks."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, VOCAB, (BATCH,), generator=g)


def _embedding_loss(emb, idx):
    out = emb(idx)
    return ((out - 1.0) ** 2).mean()


# -- 1. sparse gradients stay sparse: SparseAdam steps --------------------------------

def check_sparse_gradient_stays_sparse_for_sparse_adam():
    for as_dense in (False, True):  # Horovod: sparse again after a dense allreduce
        _train_sparse_adam(as_dense)


def _train_sparse_adam(sparse_as_dense: bool):
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(7)
    emb = torch.nn.Embedding(VOCAB, DIM, sparse=True)
    ref = torch.nn.Embedding(VOCAB, DIM, sparse=True)
    ref.load_state_dict(emb.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters(),
                                   sparse_as_dense=sparse_as_dense)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        _embedding_loss(emb, _batch(r * 10 + step)).backward()
        opt.synchronize()
        grad = emb.weight.grad
        assert grad.is_sparse and grad.is_coalesced(), (sparse_as_dense, grad)
        with opt.skip_synchronize():
            opt.step()
        # single process on the concatenated batch: the mean over it is the mean of the
        # per-rank means (equal batch sizes), Horovod's Average
        ref_opt.zero_grad()
        everyone = torch.cat([_batch(k * 10 + step) for k in range(n)])
        _embedding_loss(ref, everyone).backward()
        ref_opt.step()
        torch.testing.assert_close(emb.weight.detach(), ref.weight.detach())
    gathered = hvd.allgather(emb.weight.detach().unsqueeze(0),
                             name=f"compat.opt.sparse.w.{sparse_as_dense}")
    for k in range(n):
        assert torch.equal(gathered[k], gathered[0]), f"rank {k} differs"


# -- 2. broadcast_optimizer_state: frozen parameters, model= --------------------------

class _Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM, sparse=True)
        self.frozen = torch.nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)

    def forward(self, idx):
        return self.frozen(self.emb(idx))


def check_broadcast_optimizer_state_frozen_params_and_model():
    r, n = hvd.rank(), hvd.size()
    root = n - 1
    torch.manual_seed(11 + r)  # different weights and state on every rank
    model = _Frozen()
    opt = torch.optim.SparseAdam([model.emb.weight], lr=0.05 * (r + 1))
    dense = torch.optim.Adam(model.parameters(), lr=0.01)  # frozen ones included
    for _ in range(r + 1):  # a state that differs per rank
        opt.zero_grad()
        dense.zero_grad()
        _embedding_loss(model, _batch(r)).backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root)
    hvd.broadcast_optimizer_state(opt, root, model=model)  # Horovod's positional order
    hvd.broadcast_optimizer_state(dense, root, model)  # empty: made by a zero step, as Horovod
    assert set(dense.state) == {model.emb.weight}, "the frozen parameters have no state"
    want = hvd.broadcast_object(opt.state_dict(), root, name="compat.opt.state")
    got = opt.state_dict()
    assert got["param_groups"] == want["param_groups"], got["param_groups"]
    for k, st in want["state"].items():
        for key, v in st.items():
            torch.testing.assert_close(got["state"][k][key], v, msg=f"{k}.{key}")
    try:
        hvd.broadcast_optimizer_state(opt, root, hvd.global_process_set)
    except hvd.InvalidArgumentError as exc:
        assert "process_set" in str(exc), str(exc)
    else:
        raise AssertionError("a process set given as model was accepted")
    # training on together keeps every rank equal
    dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for step in range(2):
        dopt.zero_grad()
        _embedding_loss(model, _batch(r * 10 + step)).backward()
        dopt.step()
    w = hvd.allgather(model.emb.weight.detach().unsqueeze(0), name="compat.opt.frozen.w")
    for k in range(n):
        assert torch.equal(w[k], w[0]), f"rank {k} differs"


# -- 3. without named_parameters; Horovod's attributes and warning ------------------

def check_optimizer_without_names_has_horovods_attributes_and_warning():
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    hvd.broadcast_parameters(model.state_dict(), 0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    ref.load_state_dict(model.state_dict())
    head = [model[1].weight, model[1].bias]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": [model[0].weight, model[0].bias]}, {"params": head, "lr": 0.05}], lr=0.1))
    names = opt._parameter_names
    assert names[model[0].bias] == "allreduce.noname.0.1", names
    assert names[model[1].weight] == "allreduce.noname.1.0", names
    assert (opt.op, opt.gradient_predivide_factor, opt.sparse_as_dense) == \
        (hvd.Average, 1.0, False)
    assert opt.process_set is hvd.global_process_set
    assert opt._compression is hvd.Compression.none
    assert opt.backward_passes_per_step == 1
    opt.backward_passes_per_step = 2  # Horovod code assigns it
    assert opt.backward_passes_per_step == 2
    opt.set_backward_passes_per_step(1)
    x = torch.arange(8 * n, dtype=torch.float32).reshape(2 * n, 4) / 10
    opt.zero_grad()
    model(x[2 * r:2 * r + 2]).pow(2).mean().backward()
    opt.synchronize()
    assert opt._synchronized
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            assert not opt._should_synchronize
            opt.step()
    assert not caught, [str(w.message) for w in caught]
    ref_opt = torch.optim.SGD([{"params": [ref[0].weight, ref[0].bias]},
                               {"params": [ref[1].weight, ref[1].bias], "lr": 0.05}], lr=0.1)
    # mean over the whole batch = mean of the per-rank means (equal shards)
    ref(x).pow(2).mean().backward()
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach())
    opt.zero_grad()
    model(x[2 * r:2 * r + 2]).pow(2).mean().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # a filter written for Horovod's message matches
        warnings.filterwarnings("error", message=r"optimizer\.step\(\) called without "
                                r"optimizer\.skip_synchronize\(\) context after")
        try:
            opt.step()
        except UserWarning:
            pass
        else:
            raise AssertionError("no warning for step() after synchronize()")
    opt.synchronize()  # the warning ended step() before its allreduce: catch up together


# -- 4. broadcast_optimizer_state of optimizers that have taken no step --------------------

def check_broadcast_optimizer_state_of_new_optimizers_is_horovods():
    """Parameters without gradients yet, no state: as Horovod's, each rank makes the state
    with one step on zero gradients (a DistributedOptimizer's wrapped step, which does not
    reduce), leaves the parameters a zero gradient, then takes root's state; training then
    goes on alike everywhere."""
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].bias.requires_grad_(False)
    plain = torch.optim.Adam(model[0].parameters(), lr=0.1 * (r + 1))
    wrapped = hvd.DistributedOptimizer(torch.optim.RMSprop(model[1].parameters(), lr=0.01),
                                       named_parameters=model[1].named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    for opt in (plain, wrapped):
        hvd.broadcast_optimizer_state(opt, root_rank=n - 1)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    zero_grad = model[0].weight.grad is not None and not model[0].weight.grad.any()
    states = copy.deepcopy({"adam": plain.state_dict(), "rmsprop": wrapped.state_dict()})
    root = hvd.broadcast_object(states, n - 1, name="compat.fresh.states")
    wrapped.zero_grad()
    model(torch.full((2, 4), float(r))).sum().backward()
    wrapped.step()
    w = torch.cat([p.detach().reshape(-1) for p in model[1].parameters()])
    ws = hvd.allgather(w.unsqueeze(0), name="compat.fresh.w")
    assert set(plain.state) == {model[0].weight}, "state for the parameter that requires grad"
    assert float(plain.state[model[0].weight]["step"]) == 1.0
    assert plain.param_groups[0]["lr"] == 0.1 * n, "root's options"
    assert zero_grad, "Horovod's initialization leaves zero gradients"
    assert unchanged, "a zero step of Adam and RMSprop moves no parameter"
    for name, sd in states.items():
        for pid, st in root[name]["state"].items():
            for key, v in st.items():
                torch.testing.assert_close(sd["state"][pid][key], v, msg=f"{name} {pid}.{key}")
    assert all(torch.equal(ws[k], ws[0]) for k in range(n)), "training went on alike"


# -- 5. a process set: the optimizer averages within the set only ----------------------

def check_optimizer_on_a_process_set_averages_within_the_set():
    """DistributedOptimizer(process_set=ps), as Horovod's: the members' gradients are
    averaged over the members only (a rank outside is not waited for and adds nothing),
    so every member takes the same step, the average of the members' gradients; a rank
    outside the set trains alone on its own gradient."""
    r, n = hvd.rank(), hvd.size()
    if n < 3:
        raise Skip("a set that leaves a rank out, with 2 members, needs 3 ranks")
    members = [0, n - 1]  # leaves rank 1 out
    ps = hvd.add_process_set(members)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        x = torch.full((2, 3), float(r + 1))  # rank r's gradient: d/dw sum(w.x) = 2 (r + 1)
        if r in members:
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           process_set=ps)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        grad = (sum(2.0 * (m + 1) for m in members) / len(members) if r in members
                else 2.0 * (r + 1))
        want = torch.full((1, 3), 1.0 - 0.1 * grad)
        assert torch.allclose(model.weight.detach(), want), (r, model.weight, want)
    finally:
        hvd.remove_process_set(ps)
