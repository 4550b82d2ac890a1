"""Where an elastic job's hosts come from: fixed (``-H``, or this host) or a host
discovery script (``spark-hvdrun --host-discovery-script``), as ``{host: slots}``.

The script is any executable; each run prints the hosts available now, one a line:
``host:slots``, or ``host`` for ``--slots-per-host`` slots (blank lines and ``#``
comments are skipped; a host named twice gets both counts). It runs once before the job
starts (a failure there fails the launch), then every ``interval_s`` in a thread; a
failing or hanging run (``timeout_s``) is reported, at most once per RateLimitedLog
interval, and the last good answer is kept.
"""

from __future__ import annotations

import os
import subprocess
import threading
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from spark_hvd.exceptions import InvalidArgumentError, SparkHvdError
from spark_hvd.runner import _hosts
from spark_hvd.runner._procs import describe_exit
from spark_hvd.runner._ratelimit import RateLimitedLog


class HostSource:
    """The job's hosts, ``{host: slots}`` in order: fixed (``-H``, or this host)."""

    def __init__(self, hosts: Sequence[Tuple[str, int]]) -> None:
        self._hosts = _merge(hosts)
        self._lock = threading.Lock()

    def latest(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._hosts)

    def start(self, say: Callable[[str], None]) -> None:
        pass

    def stop(self) -> None:
        pass


class DiscoveryScript(HostSource):
    """Hosts from ``--host-discovery-script`` (module docstring). The first run happens
    in the constructor and raises InvalidArgumentError when it fails."""

    def __init__(self, path: str, slots_per_host: int, interval_s: float, timeout_s: float,
                 env: Mapping[str, str]) -> None:
        self.path = os.path.abspath(path)
        if not os.path.isfile(self.path):
            raise InvalidArgumentError(f"--host-discovery-script {path}: no such file")
        if not os.access(self.path, os.R_OK | os.X_OK):
            raise InvalidArgumentError(f"--host-discovery-script {path}: not readable and "
                                       f"executable by this user (chmod +x it)")
        self.slots_per_host, self.interval_s, self.timeout_s = slots_per_host, interval_s, timeout_s
        self._env = dict(env)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        try:
            first = self.discover()
        except SparkHvdError as e:
            raise InvalidArgumentError(f"--host-discovery-script failed: {e}") from None
        super().__init__(list(first.items()))

    def discover(self) -> Dict[str, int]:
        """One run of the script: its hosts, or SparkHvdError saying what went wrong."""
        try:
            proc = subprocess.run([self.path], env=self._env, stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise SparkHvdError(f"{self.path} gave no answer within {self.timeout_s:g} s") \
                from None
        except OSError as e:
            raise SparkHvdError(f"cannot run {self.path}: {e.strerror or e}") from None
        if proc.returncode != 0:
            said = proc.stderr.decode(errors="replace").strip().splitlines()[-3:]
            raise SparkHvdError(f"{self.path} {describe_exit(proc.returncode)}"
                                + (": " + " / ".join(said) if said else ""))
        hosts: List[Tuple[str, int]] = []
        for line in proc.stdout.decode(errors="replace").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                hosts += _hosts.parse_hosts(line, self.slots_per_host,
                                            what=f"{self.path} printed {line!r}")
        return _merge(hosts)

    def start(self, say: Callable[[str], None]) -> None:
        failures = RateLimitedLog(_Warnings(say))  # type: ignore[arg-type]

        def watch() -> None:
            while not self._stop.wait(self.interval_s):
                try:
                    hosts = self.discover()
                except SparkHvdError as e:
                    failures.warning("discovery", "host discovery failed, keeping the last "
                                     "hosts: %s", e)
                    continue
                with self._lock:
                    before, self._hosts = self._hosts, hosts
                if hosts != before:
                    say(f"hosts now {_spell(hosts)} (were {_spell(before)})")

        self._thread = threading.Thread(target=watch, name="spark_hvd-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1.0)


def _merge(hosts: Sequence[Tuple[str, int]]) -> Dict[str, int]:
    """``{host: slots}`` in order of first mention; a host named twice gets both counts."""
    merged: Dict[str, int] = {}
    for host, n in hosts:
        merged[host] = merged.get(host, 0) + n
    return merged


def _spell(hosts: Mapping[str, int]) -> str:
    return ",".join(f"{h}:{n}" for h, n in hosts.items()) or "none"


class _Warnings:
    """RateLimitedLog's logger: its warnings as ``say`` lines."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say

    def warning(self, message: str, *args: object) -> None:
        self._say(message % args if args else message)
