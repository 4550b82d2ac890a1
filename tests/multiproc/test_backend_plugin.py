"""A backend added through the registry alone: tests/backends/recording_backend.cc,
compiled here and loaded with SPARK_HVD_BACKEND_PLUGINS, takes the ops of a made-up
device (77). On 2 ranks its device's allreduce (fused and not), allgather, broadcast
and barrier run on it with right results, CPU ops still run on the built-in backends,
a process set splits it, and a device no backend takes is a clear error."""

import json
import os
import subprocess
import sys

import pytest

from _ranks import PYTHON, ROOT, TESTS, hvdrun, output_tail

RANK_SCRIPT = r'''
import json, sys
import numpy as np
import spark_hvd as hvd
from spark_hvd import _ops
from spark_hvd._types import DataType, OpType

hvd.init()
me, n = hvd.rank(), hvd.size()
out = {}

def on_device(op, arr, name, device=77, **kw):
    res = np.empty_like(arr) if op in (OpType.ALLREDUCE, OpType.BROADCAST) else None
    h = _ops.submit(op, name, DataType.FLOAT32, arr.shape, arr.ctypes.data,
                    0 if res is None else res.ctypes.data, (arr, res),
                    (lambda r: res) if res is not None else
                    (lambda r: r[0].view(np.float32).reshape(r[1])), device=device, **kw)
    return _ops.synchronize(h)

x = np.arange(6, dtype=np.float32) + me
out["allreduce"] = on_device(OpType.ALLREDUCE, x, "dev.ar", reduce_op=hvd.Sum).tolist()
with _ops.submit_together():
    hs = [_ops.submit(OpType.ALLREDUCE, f"dev.g.{i}", DataType.FLOAT32, (3,), a.ctypes.data,
                      a.ctypes.data, a, (lambda r, a=a: a), reduce_op=hvd.Average, device=77,
                      group="dev.g", group_size=2)
          for i, a in enumerate([np.full(3, me + 1.0, np.float32),
                                 np.full(3, 10.0 * (me + 1), np.float32)])]
out["grouped_average"] = [_ops.synchronize(h).tolist() for h in hs]
out["allgather"] = on_device(OpType.ALLGATHER, np.full((me + 1, 2), me, np.float32),
                             "dev.ag").tolist()
out["broadcast"] = on_device(OpType.BROADCAST, np.full(4, me + 5, np.float32), "dev.bc",
                             root=1).tolist()
_ops.synchronize(_ops.submit(OpType.BARRIER, "dev.barrier", DataType.UINT8, (), 0, 0, None,
                             lambda r: None, device=77))
out["cpu_allreduce"] = hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum, name="cpu").tolist()
ps = hvd.add_process_set([1])
if me == 1:
    out["set_allreduce"] = on_device(OpType.ALLREDUCE, x, "dev.ps", reduce_op=hvd.Sum,
                                     process_set=ps).tolist()
try:
    on_device(OpType.ALLREDUCE, x, "dev.none", device=78, reduce_op=hvd.Sum)
except hvd.InvalidArgumentError as e:
    out["no_backend"] = str(e)  # at submit: no other rank takes part
hvd.barrier()
hvd.shutdown()
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    out = tmp_path_factory.mktemp("plugin") / "librecording_backend.so"
    src = os.path.join(TESTS, "backends", "recording_backend.cc")
    subprocess.run(["g++", "-std=c++17", "-shared", "-fPIC", "-O1", "-I",
                    os.path.join(ROOT, "csrc"), "-o", str(out), src], check=True)
    return str(out)


def test_a_plugin_backend_gets_its_devices_ops(plugin, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    log = tmp_path / "recorded.log"
    proc = hvdrun(2, [PYTHON, str(script)], env={"SPARK_HVD_BACKEND_PLUGINS": plugin,
                                                "SHVD_RECORDING_LOG": str(log)}, timeout=120)
    assert proc.returncode == 0, output_tail(proc)
    results = {}
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            rank = int(line.split("]", 1)[0].lstrip("["))
            results[rank] = json.loads(line.split("RESULT ", 1)[1])
    assert sorted(results) == [0, 1], output_tail(proc)
    for me, got in results.items():
        assert got["allreduce"] == [2.0 * i + 1 for i in range(6)]
        assert got["grouped_average"] == [[1.5] * 3, [15.0] * 3]
        assert got["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert got["broadcast"] == [6.0] * 4
        assert got["cpu_allreduce"] == [2.0] * 3
        assert "device 78" in got["no_backend"], got["no_backend"]
    assert results[1]["set_allreduce"] == [1.0 + i for i in range(6)]

    lines = log.read_text().splitlines()
    for rank in (0, 1):
        mine = [ln.split(" ", 4)[4] for ln in lines if ln.startswith(f"rank {rank} set 0 ")]
        # the grouped pair arrives fused: one allreduce of two tensors
        assert mine == ["allreduce tensors=1 count=6", "allreduce tensors=2 count=6",
                        "allgather bytes=24", "broadcast bytes=16 root=1", "barrier"], lines
    assert [ln for ln in lines if " set 1 " in ln] == ["rank 1 set 1 allreduce tensors=1 count=6"]
    assert not any("count=3" in ln and "tensors=1" in ln for ln in lines), \
        "the CPU allreduce must not reach the plugin"


def test_a_plugin_that_does_not_load_is_a_clear_init_error(tmp_path):
    bad = tmp_path / "missing.so"
    code = "import spark_hvd as hvd\ntry:\n    hvd.init()\nexcept Exception as e:\n" \
           "    print(type(e).__name__, e)\n"
    env = dict(os.environ, SPARK_HVD_BACKEND_PLUGINS=str(bad), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.startswith("InvalidArgumentError"), proc.stdout + proc.stderr
    assert str(bad) in proc.stdout and "SPARK_HVD_BACKEND_PLUGINS" in proc.stdout
