"""Supervision of a job's local processes: output forwarding, exits, teardown.

Each process runs in its own session (so its whole process tree can be
signalled as one group), its stdout and stderr are read by one thread each,
and one waiter thread per process records its exit under a condition
variable, so the launcher sleeps until something happens and never polls.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import BinaryIO, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

class Sink:
    """A binary output stream written one whole line at a time, flushed per line."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            try:
                self._stream.write(data)
                self._stream.flush()
            except (OSError, ValueError):
                pass  # our own stdout went away (closed pipe): keep supervising


class LineRouter:
    """Turns each raw output line (newline included) into ``(sink, bytes)`` writes."""

    def route(self, line: bytes) -> Iterable[Tuple[Sink, bytes]]:
        raise NotImplementedError

    def finish(self) -> Iterable[Tuple[Sink, bytes]]:
        """Writes still owed at end of stream (held partial lines)."""
        return ()


class Prefixed(LineRouter):
    """Every line to one sink with a prefix in front."""

    def __init__(self, prefix: bytes, sink: Sink) -> None:
        self._prefix, self._sink = prefix, sink

    def route(self, line: bytes) -> Iterable[Tuple[Sink, bytes]]:
        return [(self._sink, self._prefix + line)]


def exit_code(returncode: int) -> int:
    """A shell-style exit code: 128+signum for a process killed by a signal."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def _pump(pipe: BinaryIO, router: LineRouter) -> None:
    with pipe:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            for sink, data in router.route(line):
                sink.write(data)
    for sink, data in router.finish():
        sink.write(data)


def _signal_groups(pgids: Iterable[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class ProcessGroup:
    """Local processes of one job, each in its own session, watched until they end."""

    def __init__(self, on_exit: Optional[Callable[[object, int], None]] = None) -> None:
        self._on_exit = on_exit  # (label, returncode) as each process ends, in its waiter
        self._procs: Dict[object, subprocess.Popen] = {}
        self._exits: List[Tuple[object, int]] = []
        self._cond = threading.Condition()
        self._threads: List[threading.Thread] = []
        # More process groups to SIGKILL when the processes outlive SIGTERM (e.g. the
        # ranks of an mpirun that did not exit).
        self.extra_kill_groups: Callable[[], Iterable[int]] = lambda: ()

    def spawn(self, label: object, command: Sequence[str], env: Dict[str, str],
              stdout: LineRouter, stderr: LineRouter,
              stdin: Optional[bytes] = None) -> subprocess.Popen:
        """Start ``command``; raises OSError (e.g. FileNotFoundError) when it cannot.

        Its stdin is /dev/null, or with ``stdin`` a pipe that gets those bytes and is
        then held open until :meth:`shutdown` (or this process's death) closes it, so
        the process can take EOF there as the end of the job.
        """
        proc = subprocess.Popen(list(command), env=env,
                                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        self._procs[label] = proc
        if stdin is not None:
            try:
                proc.stdin.write(stdin)
                proc.stdin.flush()
            except OSError:
                pass  # it ended already; its exit tells why
        for pipe, route in ((proc.stdout, stdout), (proc.stderr, stderr)):
            self._start(_pump, pipe, route)
        self._start(self._wait_one, label, proc)
        return proc

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True,
                                  name=f"spark_hvd-launch-{target.__name__}")
        thread.start()
        self._threads.append(thread)

    def _wait_one(self, label: object, proc: subprocess.Popen) -> None:
        returncode = proc.wait()
        if self._on_exit is not None:
            self._on_exit(label, returncode)
        with self._cond:
            self._exits.append((label, returncode))
            self._cond.notify_all()

    def wait_first_failure(self) -> Optional[Tuple[object, int]]:
        """Block until a process fails (returns ``(label, returncode)``) or all succeed (None)."""
        seen = 0
        with self._cond:
            while True:
                for label, returncode in self._exits[seen:]:
                    if returncode != 0:
                        return label, returncode
                seen = len(self._exits)
                if seen == len(self._procs):
                    return None
                self._cond.wait()

    def wait_exits(self, seen: int, timeout_s: float) -> List[Tuple[object, int]]:
        """The exits after the first ``seen``, in order, waiting up to ``timeout_s`` for one."""
        with self._cond:
            if len(self._exits) <= seen:
                self._cond.wait(timeout_s)
            return list(self._exits[seen:])

    def end(self, label: object, sig: int = signal.SIGTERM) -> None:
        """Ends one process: closes its stdin pipe (a remote rank's end) and signals its
        process group with ``sig`` (SIGKILL after a grace, as the caller decides)."""
        proc = self._procs[label]
        if sig != signal.SIGKILL and proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
        _signal_groups([proc.pid], sig)

    def _wait_all(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._exits) < len(self._procs):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def _signal_all(self, sig: int, groups: Iterable[int] = ()) -> None:
        _signal_groups([p.pid for p in self._procs.values()] + list(groups), sig)

    def shutdown(self, grace_s: float) -> None:
        """End every process and what it started: close the stdin pipes, SIGTERM, then
        SIGKILL after ``grace_s``.

        Also joins the output threads, so all output is written when this returns.
        """
        deadline = time.monotonic() + grace_s
        for proc in self._procs.values():
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        self._signal_all(signal.SIGTERM)
        done = self._wait_all(grace_s)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if not done or any(t.is_alive() for t in self._threads):
            self._signal_all(signal.SIGKILL, self.extra_kill_groups())
            self._wait_all(5.0)
            for thread in self._threads:
                thread.join(1.0)
