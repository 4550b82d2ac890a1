"""examples/pytorch_digits.py under spark-hvdrun -np 2 reaches >= 0.9 test accuracy."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pytorch_digits.py")


def test_pytorch_digits_example_two_ranks(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "2", sys.executable,
                           EXAMPLE, "--checkpoint-dir", str(ckpt)],
                          env=env, capture_output=True, timeout=240, cwd=ROOT)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out[-3000:] + proc.stderr.decode()[-3000:]
    found = re.findall(r"^\[0\] final test accuracy: ([0-9.]+) \(2 ranks", out, re.M)
    assert found, out[-3000:]
    assert float(found[0]) >= 0.9, out[-3000:]
    assert not re.search(r"^\[1\] (final|Test set)", out, re.M), "only rank 0 reports"
    saved = sorted(os.listdir(ckpt))
    assert saved == [f"checkpoint-{e}.pt" for e in range(1, 9)], saved
