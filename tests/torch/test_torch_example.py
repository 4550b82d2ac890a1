"""examples/pytorch_digits.py under spark-hvdrun -np 2 reaches >= 0.9 test accuracy."""

import os
import re
import sys

from _ranks import ROOT, hvdrun

EXAMPLE = os.path.join(ROOT, "examples", "pytorch_digits.py")


def test_pytorch_digits_example_two_ranks(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = hvdrun(2, [sys.executable, EXAMPLE, "--checkpoint-dir", str(ckpt)], timeout=240,
                  cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    found = re.findall(r"^\[0\] final test accuracy: ([0-9.]+) \(2 ranks", out, re.M)
    assert found, out[-3000:]
    assert float(found[0]) >= 0.9, out[-3000:]
    assert not re.search(r"^\[1\] (final|Test set)", out, re.M), "only rank 0 reports"
    saved = sorted(os.listdir(ckpt))
    assert saved == [f"checkpoint-{e}.pt" for e in range(1, 9)], saved
