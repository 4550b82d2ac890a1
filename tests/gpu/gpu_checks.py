"""GPU checks for a machine with an NVIDIA GPU (run_gpu_checks.sh runs this; CI has no
GPU and tests the NCCL backend through tests/fakes instead). One line per check:
``PASS name detail``, ``FAIL name detail`` or ``SKIP name why``; exit 1 if any failed.

Run as one rank (``python tests/gpu/gpu_checks.py``) or under spark-hvdrun.
"""

from __future__ import annotations

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


def main() -> int:
    if not torch.cuda.is_available():
        report("SKIP", "all", "torch sees no CUDA device")
        return 0
    hvd.init()
    dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    n = hvd.size()
    report("PASS" if hvd.nccl_built() else "FAIL", "nccl_built",
           f"nccl_built={hvd.nccl_built()} cuda_built={hvd.cuda_built()}")

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
        # The input is written on a side stream by a long matmul chain; the op must wait
        # for that stream (the tensor's current stream), not read stale memory.
        side = torch.cuda.Stream(device=dev)
        a = torch.randn(2048, 2048, device=dev)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            y = a
            for _ in range(20):
                y = (y @ a) / 2048.0
            x = torch.full((1 << 20,), float(hvd.rank() + 1), device=dev) + y.sum() * 0
            got = hvd.allreduce(x, op=hvd.Sum, name="gpu.stream")
        side.synchronize()
        want = float(sum(r + 1 for r in range(n)))
        ref = want + (y.sum() * 0).item()
        assert torch.allclose(got, torch.full_like(got, ref)), (got[:4], ref)

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

    @check("distributed_optimizer_step")
    def _():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 10)).to(dev)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for _ in range(5):
            opt.zero_grad()
            loss = model(torch.randn(16, 32, device=dev)).square().mean()
            loss.backward()
            opt.step()
        return f"loss {loss.item():.4f}"

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
