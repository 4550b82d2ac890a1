"""``spark-hvdrun``: run a command as N ranks on this host.

Gloo mode (default) starts a rendezvous server on 127.0.0.1 and the N ranks
itself; ``--mpi`` hands the ranks to Open MPI's ``mpirun``.  Either way each
output line of rank r appears as ``[r] line`` on the same stream (stdout or
stderr), a failing rank ends the whole job with its exit code, and Ctrl-C or
SIGTERM ends every rank.

    spark-hvdrun -np 4 python train.py
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import BinaryIO, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from spark_hvd.exceptions import InvalidArgumentError, SparkHvdError
from spark_hvd.runner import _mpi_exec, env as _env
from spark_hvd.runner._procs import (LineRouter, Prefixed, ProcessGroup, Sink,
                                     describe_exit, exit_code)
from spark_hvd.runner.rendezvous import RendezvousServer
from spark_hvd.runner.topology import assign

PROG = "spark-hvdrun"
DEFAULT_KILL_GRACE_S = 3.0
# mpirun tears its ranks down itself on SIGTERM; give it longer before SIGKILL.
MPIRUN_KILL_GRACE_S = 10.0
_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
_MPI_TAG = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr|stddiag)>:")


class CommandNotFoundError(InvalidArgumentError):
    """The rank command (or mpirun) cannot be executed."""


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def parse_hosts(spec: str) -> List[Tuple[str, int]]:
    """``host:slots,host:slots`` (slots default 1) as a list of ``(host, slots)``."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, slots = item.rpartition(":")
        if not sep or host.endswith(":"):  # no slots given, or a bare IPv6 address
            host, slots = item, "1"
        try:
            n = int(slots)
        except ValueError:
            raise InvalidArgumentError(f"-H {spec!r}: slots of {host!r} must be an int, "
                                       f"got {slots!r}") from None
        if n < 1:
            raise InvalidArgumentError(f"-H {spec!r}: slots of {host!r} must be >= 1")
        hosts.append((host.strip("[]"), n))
    if not hosts:
        raise InvalidArgumentError(f"-H {spec!r} names no host")
    return hosts


def _is_local(host: str) -> bool:
    if host in _LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_hosts(spec: Optional[str], np: int) -> None:
    if spec is None:
        return
    hosts = parse_hosts(spec)
    remote = [h for h, _ in hosts if not _is_local(h)]
    if remote:
        raise InvalidArgumentError(
            f"-H names {', '.join(remote)}, which is not this host: multi-host launch is not "
            f"supported yet; run all ranks here with -H localhost:{np} (or no -H)")
    slots = sum(n for _, n in hosts)
    if np > slots:
        raise InvalidArgumentError(f"-np {np} is more than the {slots} slots given by -H {spec}")


def _binary(stream) -> BinaryIO:
    return getattr(stream, "buffer", stream)


def launch(command: Sequence[str], np: int, env: Optional[Mapping[str, str]] = None,
           mpi: bool = False, hosts: Optional[str] = None,
           start_timeout_s: float = _env.DEFAULT_START_TIMEOUT_S, verbose: bool = False,
           stdout: Optional[BinaryIO] = None, stderr: Optional[BinaryIO] = None,
           kill_grace_s: float = DEFAULT_KILL_GRACE_S) -> int:
    """Run ``command`` as ``np`` ranks on this host and return the job's exit code.

    Parameters
    ----------
    command:
        The program and its arguments, run once per rank.
    np:
        Number of ranks.
    env:
        Variables added to ``os.environ`` for every rank.
    mpi:
        Launch through ``mpirun`` (SPARK_HVD_CONTROLLER=mpi) instead of directly (gloo).
    hosts:
        ``-H`` host list; only this host is supported for now.
    start_timeout_s:
        Passed to the ranks as SPARK_HVD_START_TIMEOUT_S (rendezvous waits at startup).
    stdout, stderr:
        Binary streams for the ranks' prefixed output and the launcher's messages;
        default this process's stdout and stderr.
    kill_grace_s:
        How long ranks get between SIGTERM and SIGKILL when the job is torn down.

    Returns
    -------
    int
        0 when every rank succeeded, else the first failing rank's exit code
        (128+signum for a signal), or mpirun's exit code under ``mpi``.

    Raises
    ------
    InvalidArgumentError
        for a bad ``np``/``hosts``/command; CommandNotFoundError when the command
        or mpirun cannot be executed.
    """
    command = list(command)
    if not command:
        raise InvalidArgumentError("no command given to run")
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise InvalidArgumentError(f"-np must be an int >= 1, got {np!r}")
    _check_hosts(hosts, np)
    out = Sink(stdout if stdout is not None else _binary(sys.stdout))
    err = Sink(stderr if stderr is not None else _binary(sys.stderr))
    base_env = dict(os.environ)
    base_env.update(env or {})
    with RendezvousServer(host="127.0.0.1") as server:
        rdv_env = _env.rendezvous_env("127.0.0.1", server.port, server.secret, server.run_id)
        if verbose:
            err.write(f"{PROG}: rendezvous server at 127.0.0.1:{server.port} (run id "
                      f"{server.run_id}), {np} ranks, {'mpi' if mpi else 'gloo'}\n".encode())
        if mpi:
            return _launch_mpi(command, np, base_env, dict(env or {}), rdv_env,
                               start_timeout_s, verbose, out, err)
        return _launch_gloo(command, np, base_env, server, start_timeout_s, out, err,
                            kill_grace_s)


def _launch_gloo(command: List[str], np: int, base_env: Dict[str, str],
                 server: RendezvousServer, start_timeout_s: float, out: Sink, err: Sink,
                 kill_grace_s: float) -> int:
    host = _env.hostname(base_env)
    ranks = ProcessGroup()
    try:
        for topo in assign([host] * np):
            rank_env = dict(base_env)
            rank_env.update(_env.rank_env(topo, "127.0.0.1", server.port, server.secret,
                                          server.run_id, _env.CONTROLLER_GLOO, start_timeout_s))
            prefix = f"[{topo.rank}] ".encode()
            try:
                ranks.spawn(topo.rank, command, rank_env, Prefixed(prefix, out),
                            Prefixed(prefix, err))
            except OSError as e:
                raise CommandNotFoundError(
                    f"cannot run {command[0]!r}: {e.strerror or e}") from None
        failure = ranks.wait_first_failure()
    finally:
        ranks.shutdown(kill_grace_s)
    if failure is None:
        return 0
    rank, returncode = failure
    others = "; terminated the other ranks" if np > 1 else ""
    err.write(f"{PROG}: rank {rank} {describe_exit(returncode)}{others}\n".encode())
    return exit_code(returncode)


class _MpiTags(LineRouter):
    """Rewrites Open MPI's ``[job,rank]<stdout>:`` tags into ``[rank] `` prefixes.

    Open MPI tags every chunk it reads from a rank, not every line, so one rank's
    line can arrive in several tagged pieces, interleaved with other ranks' pieces
    on one physical line.  Pieces are joined per (rank, stream) and only whole lines
    are written; mpirun's own, untagged, lines go to ``default`` as they are.
    """

    def __init__(self, out: Sink, err: Sink, default: Sink) -> None:
        self._out, self._err, self._default = out, err, default
        self._partial: Dict[Tuple[bytes, bytes], bytes] = {}

    def route(self, line: bytes) -> Iterable[Tuple[Sink, bytes]]:
        tags = list(_MPI_TAG.finditer(line))
        head = line[:tags[0].start()] if tags else line
        writes = [(self._default, head if head.endswith(b"\n") else head + b"\n")] \
            if head else []
        for i, tag in enumerate(tags):
            end = tags[i + 1].start() if i + 1 < len(tags) else len(line)
            rank, stream = tag.group(1), tag.group(2)
            text = self._partial.pop((rank, stream), b"") + line[tag.end():end]
            *whole, rest = text.split(b"\n")
            if rest:
                self._partial[(rank, stream)] = rest
            sink = self._out if stream == b"stdout" else self._err
            writes += [(sink, b"[" + rank + b"] " + w + b"\n") for w in whole]
        return writes

    def finish(self) -> Iterable[Tuple[Sink, bytes]]:
        return [(self._out if stream == b"stdout" else self._err,
                 b"[" + rank + b"] " + rest + b"\n")
                for (rank, stream), rest in sorted(self._partial.items())]


def _pids_in(directory: str) -> List[int]:
    pids = []
    for name in os.listdir(directory):
        try:
            with open(os.path.join(directory, name)) as f:
                pids.append(int(f.read()))
        except (OSError, ValueError):
            pass
    return pids


def _launch_mpi(command: List[str], np: int, base_env: Dict[str, str], user_env: Dict[str, str],
                rdv_env: Dict[str, str], start_timeout_s: float, verbose: bool, out: Sink,
                err: Sink) -> int:
    mpirun = shutil.which("mpirun", path=base_env.get("PATH"))
    if mpirun is None:
        raise CommandNotFoundError(
            f"{PROG} --mpi needs Open MPI's mpirun on PATH: install it (Debian/Ubuntu: "
            f"apt-get install openmpi-bin libopenmpi-dev) or drop --mpi to use Gloo")
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                             env=base_env, timeout=60)
    if "Open MPI" not in version.stdout + version.stderr:
        raise InvalidArgumentError(f"{PROG} --mpi supports Open MPI's mpirun; {mpirun} is "
                                   f"another MPI ({version.stdout.strip()[:80]!r})")
    with tempfile.TemporaryDirectory(prefix="spark_hvd_mpi_") as pid_dir:
        mpi_env = dict(base_env)
        mpi_env.update(rdv_env)
        mpi_env[_env.START_TIMEOUT_ENV_VAR] = f"{start_timeout_s:g}"
        mpi_env[_mpi_exec.PID_DIR_ENV_VAR] = pid_dir
        exported = sorted(set(rdv_env) | set(user_env) | {_env.START_TIMEOUT_ENV_VAR,
                                                          _mpi_exec.PID_DIR_ENV_VAR}
                          | ({"PYTHONPATH"} & set(mpi_env)))
        argv = [mpirun, "-np", str(np), "--allow-run-as-root", "--oversubscribe",
                "--tag-output", "-x", f"{_env.CONTROLLER_ENV_VAR}={_env.CONTROLLER_MPI}"]
        for name in exported:
            argv += ["-x", name]  # values travel in the environment, not on the command line
        argv += [sys.executable, os.path.abspath(_mpi_exec.__file__)] + command
        if verbose:
            err.write(f"{PROG}: {' '.join(argv)}\n".encode())
        job = ProcessGroup()
        job.extra_kill_groups = lambda: _pids_in(pid_dir)
        try:
            try:
                job.spawn("mpirun", argv, mpi_env, _MpiTags(out, err, out),
                          _MpiTags(out, err, err))
            except OSError as e:
                raise CommandNotFoundError(f"cannot run {mpirun}: {e.strerror or e}") from None
            failure = job.wait_first_failure()
        finally:
            job.shutdown(MPIRUN_KILL_GRACE_S)
    if failure is None:
        return 0
    err.write(f"{PROG}: mpirun {describe_exit(failure[1])}\n".encode())
    return exit_code(failure[1])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Run a command as N spark_hvd ranks on this host.",
        usage=f"{PROG} -np N [--gloo | --mpi] [-H host:slots,...] [--start-timeout S] "
              f"[--verbose] command [args...]")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                   help="number of ranks")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--gloo", dest="mpi", action="store_false",
                      help="start the ranks directly, Gloo controller (default)")
    mode.add_argument("--mpi", dest="mpi", action="store_true",
                      help="start the ranks with Open MPI's mpirun, MPI controller")
    p.set_defaults(mpi=False)
    p.add_argument("-H", "--hosts", dest="hosts", default=None,
                   help="host:slots,... (only this host is supported for now)")
    p.add_argument("--start-timeout", dest="start_timeout", type=float,
                   default=_env.DEFAULT_START_TIMEOUT_S,
                   help=f"seconds ranks wait for each other at startup "
                        f"(default {_env.DEFAULT_START_TIMEOUT_S:g})")
    p.add_argument("--verbose", action="store_true", help="say where the rendezvous server is")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``spark-hvdrun``; exits with the job's exit code."""
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        _parser().error("no command given")

    def interrupted(signum, frame):
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)  # let the teardown finish
        raise _Interrupted(signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, interrupted)
    try:
        code = launch(command, args.np, mpi=args.mpi, hosts=args.hosts,
                      start_timeout_s=args.start_timeout, verbose=args.verbose)
    except _Interrupted as e:
        sys.stderr.write(f"{PROG}: interrupted by {signal.Signals(e.signum).name}; "
                         f"stopped every rank\n")
        code = 128 + e.signum
    except CommandNotFoundError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        code = 127
    except SparkHvdError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        code = 2
    sys.stderr.flush()
    sys.exit(code)
