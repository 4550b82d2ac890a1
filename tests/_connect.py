"""Runs a Spark Connect driver script in a process of its own (``remote("local[2]")``
starts a local Connect server, which a process cannot hold beside a classic session) and
returns the dict it printed as its last ``RESULT <json>`` line; the test asserts on it."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_driver(script: Path, cwd: Path, timeout_s: float, **env_extra: str) -> dict:
    from pyspark.testing.connectutils import connect_requirement_message, should_test_connect
    assert should_test_connect, f"Spark Connect client dependencies: {connect_requirement_message}"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               **env_extra)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=str(cwd),
                          capture_output=True, text=True, timeout=timeout_s)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert proc.returncode == 0, tail
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, tail
    return json.loads(lines[-1][len("RESULT "):])
