"""GPU checks for a machine with an NVIDIA GPU (run_gpu_checks.sh runs this; CI has no
GPU and tests the NCCL backend through tests/fakes instead). One line per check:
``PASS name detail``, ``FAIL name detail`` or ``SKIP name why``; exit 1 if any failed.

Run as one rank (``python tests/gpu/gpu_checks.py``) or under spark-hvdrun.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

import spark_hvd.torch as hvd

RESULTS = []


def report(status: str, name: str, detail: str = "") -> None:
    RESULTS.append(status)
    if hvd.is_initialized() and hvd.rank() != 0 and status == "PASS":
        return
    print(f"{status} {name} {detail}".rstrip(), flush=True)


def check(name: str):
    def deco(fn):
        try:
            detail = fn() or ""
            report("PASS", name, detail)
        except Exception as exc:  # noqa: BLE001 - reported
            report("FAIL", name, f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
        return fn
    return deco


DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]

# The producer-stream checks queue CHAIN_ITERS fp32 matmuls of MATMUL_N x MATMUL_N (~7
# TFLOP, ~0.1 s on an H200) before the kernel that writes the reduced tensor, so an op
# that does not wait for the producing stream reads the old contents (STALE) whatever the
# timing. The DistributedOptimizer check trains an MLP of MLP_DEPTH Linear(MLP_WIDTH,
# MLP_WIDTH) + ReLU layers on MLP_BATCH rows (backward ~1 TFLOP): the gradient hooks
# submit allreduces long before the GPU has computed the gradients.
MATMUL_N, CHAIN_ITERS = 4096, 50
MLP_WIDTH, MLP_DEPTH, MLP_BATCH = 2048, 8, 8192
STALE = -1000.0


def _write_after_chain(buf: torch.Tensor, a: torch.Tensor, value: float) -> None:
    """Queues CHAIN_ITERS matmuls on the current stream, then writes ``value`` into every
    element of ``buf`` with the last kernel (through a zero that depends on the chain)."""
    y = a
    for _ in range(CHAIN_ITERS):
        y = torch.tanh(y @ a)  # bounded: the sum below stays finite
    zero = y.sum() * 0
    buf.copy_((zero + value).expand_as(buf))


def _gpu_busy() -> bool:
    """True while the current stream still has queued work (nothing waits here)."""
    ev = torch.cuda.Event()
    ev.record()
    return not ev.query()


def _check_reduced(got: torch.Tensor, want: float, what: str) -> None:
    """``got`` (a reduced CUDA tensor) must hold ``want`` everywhere: read once as the op
    returned it (ordered only by what synchronize did) and once after a device sync, to
    tell a missing producer wait from a missing consumer wait."""
    early = got.detach().cpu()
    torch.cuda.synchronize()
    late = got.detach().cpu()
    if not torch.all(late == want):
        bad = int((late != want).sum())
        raise AssertionError(
            f"{what}: {bad}/{late.numel()} elements wrong even after a device sync (values "
            f"{late.unique()[:6].tolist()}, want {want}; the input held {STALE} before its "
            "producer's last kernel): the op did not wait for the stream that produced it")
    if not torch.all(early == want):
        bad = int((early != want).sum())
        raise AssertionError(
            f"{what}: right after a device sync but {bad}/{early.numel()} elements wrong when "
            "read as synchronize returned it: the reading stream did not wait for the op")


def main() -> int:
    if not torch.cuda.is_available():
        report("SKIP", "all", "torch sees no CUDA device")
        return 0
    hvd.init()
    dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    n = hvd.size()
    # SHVD_GPU_EXPECT_NCCL=0: NCCL is kept from loading (SPARK_HVD_NCCL_LIBRARY points
    # nowhere), so CUDA tensors must be staged through host memory instead
    want_nccl = os.environ.get("SHVD_GPU_EXPECT_NCCL", "1") == "1"
    report("PASS" if hvd.nccl_built() == want_nccl and hvd.cuda_built() else "FAIL",
           "nccl_built", f"nccl_built={hvd.nccl_built()} (expected {want_nccl}) "
           f"cuda_built={hvd.cuda_built()}")

    @check("allreduce_every_dtype_and_op")
    def _():
        count = 0
        for dt in DTYPES:
            ops = [hvd.Sum, hvd.Min, hvd.Max] if dt == torch.bool else \
                [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
            for op in ops:
                x = (torch.arange(37, device=dev) % 3 + hvd.rank()).to(dt)
                got = hvd.allreduce(x, op=op, name=f"gpu.ar.{dt}.{op}")
                ref = hvd.allreduce(x.cpu(), op=op, name=f"cpu.ar.{dt}.{op}")
                assert got.device == dev, got.device
                tol = 1e-2 if dt in (torch.float16, torch.bfloat16) else 1e-6
                assert torch.allclose(got.cpu().double(), ref.double(), rtol=tol, atol=tol), \
                    (dt, op, got, ref)
                count += 1
        return f"{count} dtype x op pairs on {dev}"

    @check("fused_inplace_and_scaled")
    def _():
        xs = [torch.full((i + 1,), float(hvd.rank() + 1), device=dev) for i in range(64)]
        hs = [hvd.allreduce_async_(x, op=hvd.Sum, name=f"gpu.f.{i}", prescale_factor=2.0,
                                   postscale_factor=0.5) for i, x in enumerate(xs)]
        for h in hs:
            hvd.synchronize(h)
        want = float(sum(r + 1 for r in range(n)))
        assert all(torch.all(x == want) for x in xs)

    @check("broadcast_allgather_alltoall_reducescatter")
    def _():
        b = torch.full((5,), float(hvd.rank()), device=dev)
        assert torch.all(hvd.broadcast(b, 0, name="gpu.bc").cpu() == 0)
        g = hvd.allgather(torch.full((hvd.rank() + 1, 2), hvd.rank(), device=dev), name="gpu.ag")
        assert g.device == dev and g.shape[0] == n * (n + 1) // 2
        a = hvd.alltoall(torch.arange(2 * n, device=dev, dtype=torch.float32), name="gpu.a2a")
        assert a.device == dev and a.numel() == 2 * n
        rs = hvd.reducescatter(torch.ones(2 * n, 3, device=dev), op=hvd.Sum, name="gpu.rs")
        assert rs.device == dev and torch.all(rs == n)

    @check("grouped_allreduce_and_process_set")
    def _():
        xs = [torch.full((i + 3,), float(hvd.rank() + 1), device=dev) for i in range(5)]
        outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="gpu.grouped")
        want = float(sum(r + 1 for r in range(n)))
        assert all(o.device == dev and torch.all(o == want) for o in outs), outs
        ps = hvd.add_process_set([0])  # every rank adds it; only rank 0 is in it
        try:
            if ps.included():
                y = hvd.allreduce(torch.full((4,), 3.0, device=dev), op=hvd.Sum,
                                  process_set=ps, name="gpu.ps")
                assert y.device == dev and torch.all(y == 3.0), y
        finally:
            hvd.remove_process_set(ps)

    @check("producer_stream_is_waited_for")
    def _():
        # The input is written on a side stream by the last kernel of a long matmul chain;
        # the op, submitted at once, must wait for that stream (the tensor's current
        # stream), not read the old contents.
        side = torch.cuda.Stream(device=dev)
        a = torch.randn(MATMUL_N, MATMUL_N, device=dev) / MATMUL_N ** 0.5
        buf = torch.full((1 << 22,), STALE, device=dev)
        (a @ a).sum().item()  # cuBLAS and allocator warm before the timed chain
        torch.cuda.synchronize()
        want = float(sum(r + 1 for r in range(n)))
        with torch.cuda.stream(side):
            assert torch.cuda.current_stream(dev).cuda_stream != 0
            _write_after_chain(buf, a, hvd.rank() + 1.0)
            busy = _gpu_busy()
            got = hvd.allreduce(buf, op=hvd.Sum, name="gpu.stream")
            _check_reduced(got, want, "allreduce on a side stream")
        return f"{CHAIN_ITERS} matmuls {MATMUL_N}^2 on a side stream; GPU busy at submit: {busy}"

    @check("default_stream_producer_is_waited_for")
    def _():
        # The same on torch's default stream (no torch.cuda.stream context): its handle is
        # 0, the legacy stream, which the core's stream must wait for like any other.
        assert torch.cuda.current_stream(dev).cuda_stream == 0, \
            torch.cuda.current_stream(dev)
        a = torch.randn(MATMUL_N, MATMUL_N, device=dev) / MATMUL_N ** 0.5
        (a @ a).sum().item()
        want = float(sum(r + 1 for r in range(n)))
        busy = []
        for inplace in (False, True):
            buf = torch.full((1 << 22,), STALE, device=dev)
            torch.cuda.synchronize()
            _write_after_chain(buf, a, hvd.rank() + 1.0)
            busy.append(_gpu_busy())
            if inplace:
                got = hvd.allreduce_(buf, op=hvd.Sum, name="gpu.default_stream_")
                assert got is buf
            else:
                got = hvd.allreduce(buf, op=hvd.Sum, name="gpu.default_stream")
            _check_reduced(got, want, "allreduce_" if inplace else "allreduce")
        return f"allreduce and allreduce_ after {CHAIN_ITERS} matmuls {MATMUL_N}^2 on the " \
               f"default stream; GPU busy at submit: {busy}"

    @check("compression_sync_bn_optimizer_state")
    def _():
        x = torch.full((1000,), 0.5 * (hvd.rank() + 1), device=dev)
        c = hvd.allreduce(x, op=hvd.Average, compression=hvd.Compression.fp16, name="gpu.fp16")
        assert c.device == dev and c.dtype == torch.float32
        assert torch.allclose(c, torch.full_like(c, 0.25 * (n + 1)), atol=1e-3), c[:4]
        torch.manual_seed(7)
        bn = torch.nn.BatchNorm2d(3).to(dev)
        sbn = hvd.SyncBatchNorm(3).to(dev)
        sbn.load_state_dict(bn.state_dict())
        full = torch.randn(4 * n, 3, 5, 5, device=dev)  # the same on every rank (seeded)
        mine = full[4 * hvd.rank():4 * (hvd.rank() + 1)].clone().requires_grad_()
        out = sbn(mine)
        out.square().sum().backward()
        ref = bn(full)[4 * hvd.rank():4 * (hvd.rank() + 1)]
        assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()
        assert torch.allclose(sbn.running_mean, bn.running_mean, atol=1e-5)
        assert mine.grad is not None and mine.grad.device == dev
        model = torch.nn.Linear(8, 4).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.randn(2, 8, device=dev)).sum().backward()
        opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        state = opt.state_dict()["state"]
        assert all(v["exp_avg"].device == dev for v in state.values())

    @check("adasum_through_host_memory")
    def _():
        if n & (n - 1):
            return f"skipped: {n} ranks is not a power of two"
        x = torch.randn(1001, generator=torch.Generator().manual_seed(hvd.rank())).to(dev)
        got = hvd.allreduce(x, op=hvd.Adasum, name="gpu.adasum")
        ref = hvd.allreduce(x.cpu(), op=hvd.Adasum, name="cpu.adasum")
        assert got.device == dev and torch.equal(got.cpu(), ref), (got, ref)
        hvd.allreduce_(x, op=hvd.Adasum, name="gpu.adasum_")
        assert x.device == dev and torch.equal(x.cpu(), ref)

    @check("distributed_optimizer_averages_grads")
    def _():
        # Each rank trains on its own batch, on the default stream, with a backward long
        # enough that the gradient hooks submit their allreduces while the GPU is still
        # computing the gradients. After synchronize() (step 0) or step() (steps 1, 2),
        # every p.grad must be the average over ranks of the local gradients, which each
        # rank recomputes here for every rank's batch with a plain torch copy of the model,
        # and SGD must have applied it. One rank: nothing to average (the optimizer adds no
        # hooks), so this only checks that the gradients are left alone.
        def mlp():
            torch.manual_seed(1)
            layers = []
            for _ in range(MLP_DEPTH):
                lin = torch.nn.Linear(MLP_WIDTH, MLP_WIDTH)
                torch.nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")
                layers += [lin, torch.nn.ReLU()]
            return torch.nn.Sequential(*layers, torch.nn.Linear(MLP_WIDTH, 16)).to(dev)

        def batch(step, r):
            g = torch.Generator(device=dev).manual_seed(1000 * step + r)
            return torch.randn(MLP_BATCH, MLP_WIDTH, device=dev, generator=g)

        def close(got, want, what, rtol=1e-4):
            err = float((got.detach().double().cpu() - want).abs().max())
            scale = float(want.abs().max())
            assert err <= rtol * scale + 1e-12, \
                f"{what}: max error {err:.3g} (values up to {scale:.3g})"

        lr = 0.1
        model, plain = mlp(), mlp()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        names = [k for k, _ in model.named_parameters()]
        busy, checked = [], 0
        for step in range(3):
            plain.load_state_dict(model.state_dict())
            local = []
            for r in range(n):
                plain.zero_grad(set_to_none=True)
                plain(batch(step, r)).square().mean().backward()
                local.append([p.grad.detach().double().cpu() for p in plain.parameters()])
            want = [sum(gs) / n for gs in zip(*local)]
            before = [p.detach().double().cpu() for p in model.parameters()]
            opt.zero_grad(set_to_none=step != 1)  # step 1: the old grads stay, zeroed
            torch.cuda.synchronize()
            model(batch(step, hvd.rank())).square().mean().backward()
            busy.append(_gpu_busy())
            if step == 0:
                opt.synchronize()
                for k, p, w in zip(names, model.parameters(), want):
                    close(p.grad, w, f"step 0 grad {k} after synchronize()")
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            for k, p, w, b in zip(names, model.parameters(), want, before):
                close(p.grad, w, f"step {step} grad {k} after step()")
                close(p, b - lr * w, f"step {step} parameter {k} after step()", rtol=1e-5)
                checked += 1
        how = f"the average of {n} ranks' local grads" if n > 1 else \
            "the local grads (one rank: no hooks, nothing averaged)"
        return f"{checked} grads and parameters over 3 steps match {how}; GPU busy when " \
               f"backward() returned: {busy}"

    @check("lightning_fit_on_cuda")
    def _():
        try:
            from spark_hvd.torch.lightning import HorovodStrategy, lightning_package
        except ImportError as e:
            return f"skipped: {e}"
        import importlib

        pl = importlib.import_module(lightning_package())

        class Net(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(16, 4)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = torch.nn.functional.cross_entropy(self.layer(x), y)
                self.log("loss", loss, sync_dist=True)
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=g),
                                              torch.randint(0, 4, (256,), generator=g))
        net = Net()
        trainer = pl.Trainer(strategy=HorovodStrategy(), accelerator="gpu", devices=1,
                             max_epochs=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(net, torch.utils.data.DataLoader(data, batch_size=32))
        assert net.layer.weight.device == dev, net.layer.weight.device
        digest = float(net.layer.weight.double().sum())
        assert hvd.allgather_object(digest) == [digest] * n, "ranks ended with other weights"
        return f"{lightning_package()} on {dev}, loss {float(trainer.callback_metrics['loss']):.4f}"

    @check("single_gpu_step_overhead")
    def _():
        if n != 1:
            return "measured on one rank only"
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).to(dev)
        x = torch.randn(256, 512, device=dev)

        def run(opt, steps=50):
            for _ in range(5):
                opt.zero_grad(); model(x).square().mean().backward(); opt.step()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(steps):
                opt.zero_grad(); model(x).square().mean().backward(); opt.step()
            torch.cuda.synchronize()
            return (time.perf_counter() - t) / steps

        plain = min(run(torch.optim.SGD(model.parameters(), lr=1e-3)) for _ in range(3))
        dist = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                        named_parameters=model.named_parameters())
        ours = min(run(dist) for _ in range(3))
        return f"step {1e3 * ours:.2f} ms vs plain torch {1e3 * plain:.2f} ms " \
               f"({100 * (ours / plain - 1):+.1f} %, goal <= 3 %)"

    hvd.shutdown()
    return 1 if "FAIL" in RESULTS else 0


if __name__ == "__main__":
    sys.exit(main())
