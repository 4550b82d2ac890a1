"""examples/tensorflow2_digits.py and tensorflow1_digits.py run as a user would:
spark-hvdrun -np 2."""

import importlib.util
import os
import re
import sys

import pytest

import tf_harness
from _ranks import ROOT, hvdrun

pytestmark = tf_harness.needs_tensorflow

EXAMPLE = os.path.join(ROOT, "examples", "tensorflow2_digits.py")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")
def test_tensorflow2_digits_example_reaches_90_percent(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = hvdrun(2, [sys.executable, EXAMPLE, "--epochs", "6", "--checkpoint-dir", str(ckpt)],
                  env=tf_harness.TF_ENV, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    found = re.findall(r"^\[0\] test accuracy: ([0-9.]+) \(2 ranks", proc.stdout, re.M)
    assert found, output[-4000:]
    assert float(found[0]) >= 0.9, found
    assert not re.search(r"^\[1\] (test accuracy|step|checkpoint)", proc.stdout, re.M), \
        "only rank 0 logs"
    assert any(name.startswith("ckpt-1") for name in os.listdir(ckpt))


EXAMPLE_TF1 = os.path.join(ROOT, "examples", "tensorflow1_digits.py")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")
def test_tensorflow1_digits_example_trains_in_graph_mode(tmp_path):
    """The TF1 graph-mode example (MonitoredTrainingSession, BroadcastGlobalVariablesHook,
    DistributedOptimizer on a tf.compat.v1 optimizer), 200 // 2 steps per rank."""
    ckpt = tmp_path / "ckpt"
    proc = hvdrun(2, [sys.executable, EXAMPLE_TF1, "--steps", "200", "--checkpoint-dir",
                      str(ckpt)], env=tf_harness.TF_ENV, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    found = re.findall(r"^\[0\] test accuracy: ([0-9.]+) \(2 ranks, global batch 64, 100 steps",
                       proc.stdout, re.M)
    assert found, output[-4000:]
    assert float(found[0]) >= 0.9, found
    assert not re.search(r"^\[1\] (test accuracy|step|checkpoint)", proc.stdout, re.M), \
        "only rank 0 logs"
    assert (ckpt / "model.ckpt-100.index").exists(), os.listdir(ckpt)


EXAMPLE_KERAS = os.path.join(ROOT, "examples", "keras_digits.py")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")
def test_keras_digits_example_written_the_horovod_way(tmp_path):
    """model.fit with DistributedOptimizer and Horovod's callbacks, 2 ranks, 4 epochs."""
    ckpt = tmp_path / "ckpt"
    proc = hvdrun(2, [sys.executable, EXAMPLE_KERAS, "--epochs", "4", "--checkpoint-dir",
                      str(ckpt)], env=tf_harness.TF_ENV, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    found = re.findall(r"^\[0\] test accuracy: ([0-9.]+) \(2 ranks", proc.stdout, re.M)
    assert found, output[-4000:]
    assert float(found[0]) >= 0.85, found
    assert not re.search(r"^\[1\] (test accuracy|Epoch)", proc.stdout, re.M), "only rank 0 logs"
    assert sorted(os.listdir(ckpt)) == [f"checkpoint-{e}.keras" for e in range(1, 5)]
