"""``spark-hvdrun``'s elastic mode: workers that come and go with the hosts (Horovod's
``horovodrun --min-np/--max-np/--host-discovery-script``).

    spark-hvdrun -np 4 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py

The hosts come from the discovery script (:mod:`spark_hvd.runner._discovery`), else
from ``-H`` or this host with ``-np`` slots, fixed. The launcher keeps one worker process per
available slot, up to ``--max-np``; the workers find their epochs (rank, size) through the
:class:`~spark_hvd.runner._elastic.Coordinator`, which runs here beside the rendezvous
server. A worker has no fixed rank, so its output lines are prefixed ``[w<id>] ``.

The loop (each ``TICK_S``, and at once when a worker exits):

1. Exits. A worker that exits 0 and was not asked to leave has finished training: from
   then on no worker starts. One that exits otherwise failed: its host cools down (no
   worker starts there) for ``low * 2**(failures - 1)`` seconds, at most ``high``
   (``--blacklist-cooldown-range``); the survivors re-form without it.
2. The coordinator failed (reset limit, fewer than ``--min-np`` for the elastic
   timeout): every worker ends, exit 1.
3. Finished: once every worker of the current epoch has exited, the job ends with 0 if
   they all exited 0 (workers still waiting for a place are ended), else with the code
   of the first that did not.
4. Hosts: a host gone, or with fewer slots, loses workers (those outside the current
   epoch first, then the newest): the coordinator removes them at its next epoch and
   they exit; after ``leave_grace_s`` they are ended. Free slots of hosts that are not
   cooling down get new workers (a fresh worker id each), up to ``--max-np``; another
   host's first worker waits for an ssh probe of it (in a thread).
5. No worker left alive, once some started: the job fails (the committed state lived
   in the workers).
"""

from __future__ import annotations

import argparse
import ipaddress
import shlex
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from spark_hvd import _config
from spark_hvd._job import env as _env
from spark_hvd.exceptions import InvalidArgumentError, SparkHvdError
from spark_hvd.runner import _addresses, _hosts, _ssh
from spark_hvd.runner._discovery import DiscoveryScript, HostSource
from spark_hvd.runner._elastic import Coordinator, check_sizes
from spark_hvd.runner._hosts import Slot
from spark_hvd.runner._procs import Prefixed, ProcessGroup, Sink, describe_exit, exit_code
from spark_hvd.runner.rendezvous import RendezvousServer

PROG = _ssh.PROG
TICK_S = 0.1
DEFAULT_COOLDOWN_RANGE_S = (10.0, 300.0)
DEFAULT_DISCOVERY_INTERVAL_S = 1.0
DEFAULT_DISCOVERY_TIMEOUT_S = 10.0
DEFAULT_LEAVE_GRACE_S = 60.0
JOB_FAILED_EXIT_CODE = 1
# How the coordinator's messages spell its settings: as this command's flags.
CLI_NAMES = {"min_num_proc": "--min-np {}", "reset_limit": "--reset-limit {}",
             "elastic_timeout_s": "--elastic-timeout {:g}"}


@dataclass(frozen=True)
class ElasticOptions:
    """The elastic flags of ``spark-hvdrun`` (see the module docstring)."""

    min_np: Optional[int] = None
    max_np: Optional[int] = None
    discovery_script: Optional[str] = None
    slots_per_host: int = 1
    reset_limit: Optional[int] = None
    elastic_timeout_s: float = field(default_factory=_config.elastic_timeout_s)
    cooldown_range_s: Tuple[float, float] = DEFAULT_COOLDOWN_RANGE_S
    discovery_interval_s: float = DEFAULT_DISCOVERY_INTERVAL_S
    discovery_timeout_s: float = DEFAULT_DISCOVERY_TIMEOUT_S
    leave_grace_s: float = DEFAULT_LEAVE_GRACE_S

    def sizes(self, np: int) -> Tuple[int, int, int]:
        """``(np, min, max)`` checked; InvalidArgumentError naming the flag."""
        if self.reset_limit is not None and self.reset_limit < 0:
            raise InvalidArgumentError(f"--reset-limit must be >= 0, got {self.reset_limit}")
        low, high = self.cooldown_range_s
        if not 0 <= low <= high:
            raise InvalidArgumentError(f"--blacklist-cooldown-range {low:g} {high:g}: needs "
                                       f"0 <= LOW <= HIGH")
        for flag, value in (("--elastic-timeout", self.elastic_timeout_s),
                            ("--slots-per-host", self.slots_per_host)):
            if not value > 0:
                raise InvalidArgumentError(f"{flag} must be > 0, got {value:g}")
        return check_sizes(np, self.min_np, self.max_np, self.reset_limit,
                           what=("-np", "--min-np", "--max-np"))


class _Say:
    """The launcher's elastic lines: ``spark-hvdrun: elastic: ...`` on stderr."""

    def __init__(self, err: Sink) -> None:
        self._err = err

    def __call__(self, message: str) -> None:
        self._err.write(f"{PROG}: elastic: {message}\n".encode())


@dataclass
class _Worker:
    slot: Slot                             # slot.rank is the worker id
    leaving_since: Optional[float] = None  # when the launcher removed it
    returncode: Optional[int] = None
    ended_with: int = 0                    # the last signal the launcher sent it

    @property
    def alive(self) -> bool:
        return self.returncode is None


class _Remotes:
    """Other hosts found after the start: each is probed over ssh once, in a thread,
    before a worker starts there (the probe also tells where it reaches the server)."""

    def __init__(self, ssh: Optional[_ssh.Ssh], addrs: _addresses.Addresses, env: Mapping[str, str],
                 timeout_s: float, failed: Callable[[str, str], None]) -> None:
        self._ssh, self._addrs, self._env, self._timeout_s = ssh, addrs, dict(env), timeout_s
        self._failed = failed
        self._probing: Dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def address(self, host: str) -> Optional[str]:
        """Where workers on ``host`` reach the server, or None while it is not ready."""
        with self._lock:
            if host in self._addrs.remote:
                return self._addrs.remote[host]
            if host in self._probing and self._probing[host].is_alive():
                return None
            self._probing.pop(host, None)
        if self._ssh is None:
            self._failed(host, f"{PROG} reaches other hosts over ssh, and there is no ssh on "
                               f"PATH (Debian/Ubuntu: apt-get install openssh-client)")
        elif not self._addrs.pinned and ipaddress.ip_address(self._addrs.bind).is_loopback:
            self._failed(host, f"the launcher listens on {self._addrs.bind} only (the job "
                               f"started with this host alone), where other hosts cannot "
                               f"reach it: give --network-interface for a job whose hosts "
                               f"may change")
        else:
            thread = threading.Thread(target=self._probe, args=(host,), daemon=True,
                                      name="spark_hvd-ssh-probe")
            with self._lock:
                self._probing[host] = thread
            thread.start()
        return None

    def _probe(self, host: str) -> None:
        try:
            seen = self._ssh.probe([host], self._env, self._timeout_s)[host]
        except SparkHvdError as e:
            return self._failed(host, str(e))
        with self._lock:
            self._addrs.learn(host, seen)


class _ElasticJob:
    """One elastic run of ``command`` (the loop of the module docstring)."""

    def __init__(self, command: List[str], options: ElasticOptions, sizes: Tuple[int, int, int],
                 source: HostSource, base_env: Dict[str, str], server: RendezvousServer,
                 addrs: _addresses.Addresses, ssh: Optional[_ssh.Ssh], start_timeout_s: float,
                 verbose: bool, out: Sink, err: Sink, kill_grace_s: float) -> None:
        self.command, self.options, self.source = command, options, source
        self.base_env, self.server, self.addrs, self.ssh = base_env, server, addrs, ssh
        self.start_timeout_s, self.verbose = start_timeout_s, verbose
        self.kill_grace_s = kill_grace_s
        self.out, self.err, self.say = out, err, _Say(err)
        np, min_np, self.max_np = sizes
        self.coordinator = Coordinator(server, np, min_np, self.max_np, start_timeout_s,
                                       options.elastic_timeout_s, options.reset_limit,
                                       log=self.say, names=CLI_NAMES)
        self.group = ProcessGroup()
        self.workers: Dict[int, _Worker] = {}
        self.failures: Dict[str, int] = {}
        self.cool_until: Dict[str, float] = {}
        self.finishing = False
        self.last_failure: Optional[Tuple[_Worker, int]] = None
        self.local_identity = _env.hostname(base_env)
        self.remotes = _Remotes(ssh, addrs, base_env,
                                max(start_timeout_s, _ssh.DEFAULT_CONNECT_TIMEOUT_S + 5),
                                self._cool)
        self._seen = 0  # exits of self.group taken
        self._lock = threading.Lock()  # cool-downs: the probe threads report failures too

    def run(self) -> int:
        self.coordinator.start()
        self.source.start(self.say)
        try:
            return self._loop()
        finally:
            self.source.stop()
            self.coordinator.stop()
            self.group.shutdown(self.kill_grace_s)

    def _take_exits(self) -> List[Tuple[int, int]]:
        exits = self.group.wait_exits(self._seen, TICK_S)
        self._seen += len(exits)
        return exits  # type: ignore[return-value]  (labels are worker ids)

    def _loop(self) -> int:
        while True:
            exits = self._take_exits()
            now = time.monotonic()
            for worker_id, returncode in exits:
                self._exited(self.workers[worker_id], returncode, now)
            if self.coordinator.error is not None:
                return self._job_failed()
            code = self._finished()
            if code is not None:
                return code
            if not self.finishing:
                self._place(now)
            self._end_leavers(now)
            if self.workers and not any(w.alive for w in self.workers.values()):
                return self._none_left()

    # -- events --------------------------------------------------------------------

    def _exited(self, worker: _Worker, returncode: int, now: float) -> None:
        worker.returncode = returncode
        where = f"worker {worker.slot.rank} on {worker.slot.host}"
        if worker.leaving_since is not None:
            self.say(f"{where} left ({describe_exit(returncode)})")
        elif returncode == 0:
            self.finishing = True
        elif not self.finishing and self.coordinator.error is None:
            self.last_failure = (worker, returncode)
            self._cool(worker.slot.host, describe_exit(returncode))

    def _cool(self, host: str, why: str) -> None:
        """A failure on ``host``: no worker starts there for its cool-down."""
        low, high = self.options.cooldown_range_s
        with self._lock:
            n = self.failures[host] = self.failures.get(host, 0) + 1
            seconds = min(high, low * 2 ** (n - 1))
            self.cool_until[host] = time.monotonic() + seconds
        self.say(f"failure {n} on {host}: {why}; no new worker there for {seconds:g} s")

    def _job_failed(self) -> int:
        """The coordinator answered the waiting workers with its error: give them the
        grace to print it, then end the rest."""
        deadline = time.monotonic() + self.kill_grace_s
        while any(w.alive for w in self.workers.values()) and time.monotonic() < deadline:
            for worker_id, returncode in self._take_exits():
                self.workers[worker_id].returncode = returncode
        self.err.write(f"{PROG}: the elastic job failed; stopped every worker\n".encode())
        return JOB_FAILED_EXIT_CODE

    def _finished(self) -> Optional[int]:
        """The job's exit code once every worker of the final epoch has exited."""
        if not self.finishing:
            return None
        members = self.coordinator.members()
        final = [self.workers[m] for m in members if m in self.workers] or \
            [w for w in self.workers.values() if w.leaving_since is None]
        if any(w.alive for w in final):
            return None
        failed = [w for w in final if w.returncode != 0 and w.leaving_since is None]
        if failed:
            w = failed[0]
            self.err.write(f"{PROG}: worker {w.slot.rank} on {w.slot.host} "
                           f"{describe_exit(w.returncode)} at the end of the job\n".encode())
            return exit_code(w.returncode)
        left = sum(w.alive for w in self.workers.values())
        epoch = self.coordinator.epoch
        self.say((f"done: the {len(final)} workers of epoch {epoch} exited 0" if epoch else
                  "done: every worker exited 0")
                 + (f"; ending the {left} others (waiting for a place, or leaving)" if left
                    else ""))
        return 0

    def _none_left(self) -> int:
        why = ""
        if self.last_failure is not None:
            w, returncode = self.last_failure
            why = f" (the last to fail: worker {w.slot.rank} on {w.slot.host}, which " \
                  f"{describe_exit(returncode)})"
        self.err.write(f"{PROG}: no workers left{why}; the job's state went with them\n"
                       .encode())
        return exit_code(self.last_failure[1]) if self.last_failure else JOB_FAILED_EXIT_CODE

    # -- hosts ---------------------------------------------------------------------

    def _place(self, now: float) -> None:
        hosts = self.source.latest()
        staying: Dict[str, List[_Worker]] = {}
        for w in self.workers.values():
            if w.alive and w.leaving_since is None:
                staying.setdefault(w.slot.host, []).append(w)
        members = set(self.coordinator.members())
        for host, ws in staying.items():
            extra = len(ws) - hosts.get(host, 0)
            if extra > 0:  # outside the epoch first, then the newest
                ws.sort(key=lambda w: (w.slot.rank not in members, w.slot.rank))
                for w in ws[-extra:]:
                    self.coordinator.remove(w.slot.rank)
                    w.leaving_since = now
                    self.say(f"worker {w.slot.rank} on {host} is to leave ({host} "
                             f"{'has fewer slots' if host in hosts else 'left'})")
                del ws[-extra:]
        count = sum(len(ws) for ws in staying.values())
        for host, slots in hosts.items():
            free = slots - len(staying.get(host, ()))
            with self._lock:
                if now < self.cool_until.get(host, 0.0):
                    continue
            while free > 0 and count < self.max_np:
                slot = _hosts.slot(len(self.workers), host, self.local_identity)
                addr = self.remotes.address(host) if slot.remote else self.addrs.local
                if addr is None:
                    break
                self._start(slot, addr)
                free, count = free - 1, count + 1

    def _start(self, slot: Slot, addr: str) -> None:
        worker_env = dict(self.base_env)
        worker_env.update(_env.elastic_env(addr, self.server.port, self.server.secret,
                                           self.server.run_id, slot.rank,
                                           self.options.elastic_timeout_s, self.start_timeout_s))
        worker_env[_env.HOSTNAME_ENV_VAR] = slot.identity
        argv, spawn_env, stdin = _ssh.start_args(self.command, slot, self.ssh, self.base_env,
                                                 worker_env, self.kill_grace_s)
        self.workers[slot.rank] = worker = _Worker(slot)
        prefix = f"[w{slot.rank}] ".encode()
        try:
            self.group.spawn(slot.rank, argv, spawn_env, Prefixed(prefix, self.out),
                             Prefixed(prefix, self.err), stdin=stdin)
        except OSError as e:
            worker.returncode = 127
            self.last_failure = (worker, 127)
            return self._cool(slot.host, f"cannot run {argv[0]!r}: {e.strerror or e}")
        if self.verbose or self.coordinator.epoch:  # after the start, each start is news
            shown = shlex.join(argv[argv.index("--") + 1:]) if self.verbose and slot.remote else ""
            self.say(f"worker {slot.rank} started on {slot.host} {shown}".rstrip())

    def _end_leavers(self, now: float) -> None:
        """Workers removed ``leave_grace_s`` ago get SIGTERM, then SIGKILL after the
        kill grace."""
        for w in self.workers.values():
            if w.alive and w.leaving_since is not None:
                waited = now - w.leaving_since - self.options.leave_grace_s
                sig = signal.SIGKILL if waited >= self.kill_grace_s else \
                    signal.SIGTERM if waited >= 0 else 0
                if sig and sig != w.ended_with:
                    self.say(f"worker {w.slot.rank} on {w.slot.host} did not leave within "
                             f"{self.options.leave_grace_s:g} s: {signal.Signals(sig).name}")
                    self.group.end(w.slot.rank, sig)
                    w.ended_with = sig


def launch_elastic(command: List[str], options: ElasticOptions, sizes: Tuple[int, int, int],
                   source: HostSource, base_env: Dict[str, str], server: RendezvousServer,
                   addrs: _addresses.Addresses, ssh: Optional[_ssh.Ssh], start_timeout_s: float,
                   verbose: bool, out: Sink, err: Sink, kill_grace_s: float) -> int:
    """Runs ``command`` as an elastic job (module docstring); returns its exit code.
    ``sizes``: ``options.sizes(np)``."""
    return _ElasticJob(command, options, sizes, source, base_env, server, addrs, ssh,
                       start_timeout_s, verbose, out, err, kill_grace_s).run()


def host_source(options: ElasticOptions, hosts: Optional[str], np: int,
                env: Mapping[str, str]) -> HostSource:
    """Where the hosts come from: the discovery script (run once now), ``-H``, or this
    host with ``np`` slots. InvalidArgumentError for a bad script or combination."""
    if options.discovery_script is None:
        fixed = _hosts.parse_hosts(hosts) if hosts is not None else [("localhost", np)]
        total = sum(n for _, n in fixed)
        if total < np:
            raise InvalidArgumentError(f"-np {np} is more than the {total} slots given by -H "
                                       f"{hosts}")
        return HostSource(fixed)
    if hosts is not None:
        raise InvalidArgumentError("give either -H or --host-discovery-script, not both (the "
                                   "script says which hosts the job has)")
    return DiscoveryScript(options.discovery_script, options.slots_per_host,
                           options.discovery_interval_s, options.discovery_timeout_s, env)


def slots_of(source: HostSource, local_identity: str) -> Sequence[Slot]:
    """One Slot per host the job has now (for the ssh probes before the start)."""
    return [_hosts.slot(i, host, local_identity) for i, host in enumerate(source.latest())]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The elastic flags of ``spark-hvdrun``."""
    el = parser.add_argument_group(
        "elastic mode", "on with --min-np, --max-np or --host-discovery-script: workers come "
                        "and go with the hosts, output lines are prefixed [w<worker id>]")
    el.add_argument("--min-np", dest="min_np", type=int, default=None,
                    help="fewest workers the job trains with (default -np)")
    el.add_argument("--max-np", dest="max_np", type=int, default=None,
                    help="most workers the job trains with (default -np)")
    el.add_argument("--host-discovery-script", dest="discovery_script", default=None,
                    metavar="SCRIPT",
                    help="an executable printing the available hosts, one 'host:slots' (or "
                         "'host', of --slots-per-host slots) a line; run about every second. "
                         "Without it the hosts are -H (or this host), fixed")
    el.add_argument("--slots-per-host", dest="slots_per_host", type=int, default=None,
                    help="slots of a host the discovery script prints without ':slots' "
                         "(default 1)")
    el.add_argument("--reset-limit", dest="reset_limit", type=int, default=None,
                    help="fail the job once it re-formed more than this many times "
                         "(default: no limit)")
    el.add_argument("--elastic-timeout", dest="elastic_timeout", type=float, default=None,
                    help=f"seconds the job waits with fewer than --min-np workers before it "
                         f"fails (default: {_config.ELASTIC_TIMEOUT_S_ENV_VAR}, else "
                         f"{_config.DEFAULT_ELASTIC_TIMEOUT_S:g})")
    el.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=float, nargs=2,
                    default=None, metavar=("LOW", "HIGH"),
                    help="seconds a host where a worker failed gets no new worker: LOW after "
                         "its first failure, doubling with each one, at most HIGH (default "
                         "%g %g)" % DEFAULT_COOLDOWN_RANGE_S)


def options_from(args: argparse.Namespace) -> Optional[ElasticOptions]:
    """The elastic flags, or None when elastic mode is off (InvalidArgumentError when
    only its tuning flags are given)."""
    tuning = {"--slots-per-host": args.slots_per_host, "--reset-limit": args.reset_limit,
              "--elastic-timeout": args.elastic_timeout,
              "--blacklist-cooldown-range": args.cooldown_range}
    if args.min_np is None and args.max_np is None and args.discovery_script is None:
        given = [flag for flag, value in tuning.items() if value is not None]
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} applies to elastic mode only: add "
                                       f"--min-np, --max-np or --host-discovery-script")
        return None
    chosen = {"min_np": args.min_np, "max_np": args.max_np,
              "discovery_script": args.discovery_script, "slots_per_host": args.slots_per_host,
              "reset_limit": args.reset_limit, "elastic_timeout_s": args.elastic_timeout,
              "cooldown_range_s": tuple(args.cooldown_range) if args.cooldown_range else None}
    return ElasticOptions(**{k: v for k, v in chosen.items() if v is not None})
