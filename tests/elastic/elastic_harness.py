"""An elastic job in a test: a rendezvous server and a Coordinator in this process, the
workers as subprocesses, no launcher (the workers import this module too).

Each worker is started with the elastic launch contract (``elastic_env``: no rank or
size, a worker id) plus ``ELASTIC_OUT``, a folder where the worker script writes
``worker<id>.json`` when it finishes (see :func:`write_result`, used on the worker side)
and where its output goes (``worker<id>.log``). The test reads every worker's result,
exit code and output, and the coordinator's log lines.

Nothing can hang a test: the job has a wall-clock limit after which every worker is
killed (each runs in its own session, so its children go too), the coordinator fails
the job when too few workers are left for ``elastic_timeout_s``, and a worker waits for
a place at most that long plus the start timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_ENV_VAR = "ELASTIC_OUT"


# -- the worker side ---------------------------------------------------------------

def out_dir() -> str:
    return os.environ[OUT_ENV_VAR]


def worker_id() -> int:
    from spark_hvd._job import env as job_env

    return int(os.environ[job_env.ELASTIC_WORKER_ENV_VAR])


def write_result(result: dict) -> None:
    """This worker's result, as JSON, for the test to read (written once, at the end)."""
    path = os.path.join(out_dir(), f"worker{worker_id()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def append_record(record: dict) -> None:
    """One JSON line in ``worker<id>.jsonl``, flushed at once (it survives a SIGKILL)."""
    with open(os.path.join(out_dir(), f"worker{worker_id()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def die_once(marker: str) -> None:
    """SIGKILLs this process the first time any worker of the job calls it with
    ``marker``: the marker file (created exclusively) makes it once per job."""
    try:
        fd = os.open(os.path.join(out_dir(), f"killed.{marker}"),
                     os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(worker_id()).encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


# -- the test side -----------------------------------------------------------------

@dataclass
class Outcome:
    codes: Dict[int, Optional[int]]          # worker -> exit code (None: killed at the limit)
    results: Dict[int, dict]                 # worker -> its result file
    records: Dict[int, List[dict]]           # worker -> its jsonl records
    output: Dict[int, str]                   # worker -> its stdout and stderr
    log: List[str] = field(default_factory=list)  # the coordinator's lines
    killed: Optional[int] = None             # the worker that died through die_once
    timed_out: bool = False

    def describe(self) -> str:
        """Everything a failed assertion should show."""
        parts = [f"exit codes: {self.codes}" + (" (the job hit its time limit)"
                                               if self.timed_out else ""),
                 "coordinator:\n  " + "\n  ".join(self.log)]
        for w, text in sorted(self.output.items()):
            tail = "\n    ".join(text.splitlines()[-25:])
            parts.append(f"worker {w} output (tail):\n    {tail}")
        return "\n".join(parts)


def run_job(script: str, num_proc: int, outdir: str, *, min_np: Optional[int] = None,
            max_np: Optional[int] = None, args: Sequence[str] = (),
            late: int = 0, start_late: Callable[[], bool] = lambda: True,
            timeout_s: float = 60.0, elastic_timeout_s: float = 10.0,
            start_timeout_s: float = 30.0, env: Optional[dict] = None) -> Outcome:
    """Runs ``python <script> *args`` (a path relative to tests/elastic, or absolute) as
    ``num_proc`` elastic workers (ids 0..num_proc-1) until they all exit or ``timeout_s``
    passes. ``late`` more workers (the next ids) start once ``start_late()`` is true; the
    job starts forming its first epoch with ``num_proc``."""
    from _ranks import ENV, PYTHON, poll_until, wait_gone  # tests/: not on a worker's path
    from spark_hvd._job import env as job_env
    from spark_hvd.runner._elastic import Coordinator
    from spark_hvd.runner.rendezvous import RendezvousServer

    log: List[str] = []
    lock = threading.Lock()

    def add_line(line: str) -> None:
        with lock:
            log.append(line)

    server = RendezvousServer(host="127.0.0.1")
    server.start()
    coordinator = Coordinator(server, num_proc=num_proc, min_num_proc=min_np or num_proc,
                              max_num_proc=max_np or num_proc, start_timeout_s=start_timeout_s,
                              elastic_timeout_s=elastic_timeout_s, reset_limit=None,
                              log=add_line).start()
    procs: Dict[int, subprocess.Popen] = {}
    logs = {}

    def start(w: int) -> None:
        worker_env = dict(ENV, **(env or {}))
        worker_env.update(job_env.elastic_env("127.0.0.1", server.port, server.secret,
                                              server.run_id, w, elastic_timeout_s,
                                              start_timeout_s))
        worker_env[OUT_ENV_VAR] = outdir
        logs[w] = open(os.path.join(outdir, f"worker{w}.log"), "wb")
        procs[w] = subprocess.Popen([PYTHON, os.path.join(HERE, script), *args],
                                    env=worker_env, stdout=logs[w],
                                    stderr=subprocess.STDOUT, start_new_session=True)

    deadline = time.monotonic() + timeout_s
    try:
        for w in range(num_proc):
            start(w)
        if late and poll_until(lambda: start_late() or all(p.poll() is not None
                                                           for p in procs.values()),
                               timeout_s) and start_late():
            for w in range(num_proc, num_proc + late):
                start(w)
        still = wait_gone([p.pid for p in procs.values()],
                          max(0.0, deadline - time.monotonic()))
        for p in procs.values():
            if p.pid in still:
                os.killpg(p.pid, signal.SIGKILL)
        codes = {w: p.wait() if p.pid not in still else None for w, p in procs.items()}
    finally:
        for w, p in procs.items():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            logs[w].close()
        coordinator.stop()
        server.stop()
    return _collect(outdir, codes, log, timed_out=bool(still))


def records_of(outdir: str, worker: int) -> List[dict]:
    """The records a worker appended so far (the test side, while the job runs too)."""
    path = os.path.join(outdir, f"worker{worker}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _collect(outdir: str, codes: Dict[int, Optional[int]], log: List[str],
             timed_out: bool) -> Outcome:
    results, records, output = {}, {}, {}
    for w in codes:
        path = os.path.join(outdir, f"worker{w}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[w] = json.load(f)
        records[w] = records_of(outdir, w)
        with open(os.path.join(outdir, f"worker{w}.log"), "rb") as f:
            output[w] = f.read().decode(errors="replace")
    killed = None
    for name in os.listdir(outdir):
        if name.startswith("killed."):
            with open(os.path.join(outdir, name)) as f:
                killed = int(f.read())
    return Outcome(codes, results, records, output, list(log), killed, timed_out)
