"""``spark-hvdrun``: run a command as N ranks, on this host or on several over ssh.

Gloo mode (default) starts a rendezvous server and the N ranks itself: ranks on
this host directly, ranks on the other ``-H`` hosts over ssh (see
:mod:`spark_hvd.runner._ssh`); ``--mpi`` hands the ranks to Open MPI's
``mpirun``.  Either way each output line of rank r appears as ``[r] line`` on the
same stream (stdout or stderr), a failing rank ends the whole job with its exit
code, and Ctrl-C or SIGTERM ends every rank.  Every rank runs under a small
supervisor (:mod:`spark_hvd.runner._supervise`), so the ranks and what they
started end even when the launcher itself is killed outright.

    spark-hvdrun -np 4 python train.py
    spark-hvdrun -np 8 -H node1:4,node2:4 python train.py

With ``--min-np``, ``--max-np`` or ``--host-discovery-script`` the job is elastic
(:mod:`spark_hvd.runner._elastic_launch`): workers come and go with the hosts, and their
lines are prefixed ``[w<worker id>]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import BinaryIO, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from spark_hvd import _config
from spark_hvd._job import env as _env
from spark_hvd._job.topology import assign
from spark_hvd.exceptions import InvalidArgumentError, SparkHvdError
from spark_hvd.runner import _addresses, _elastic_launch, _hosts, _mpi_exec, _ssh, _supervise
from spark_hvd.runner._elastic_launch import ElasticOptions
from spark_hvd.runner._hosts import Slot, parse_hosts  # noqa: F401  (parse_hosts: public here)
from spark_hvd.runner._procs import (LineRouter, Prefixed, ProcessGroup, Sink,
                                     describe_exit, exit_code)
from spark_hvd.runner.rendezvous import RendezvousServer

PROG = "spark-hvdrun"
DEFAULT_KILL_GRACE_S = 3.0
# mpirun tears its ranks down itself on SIGTERM; give it longer before SIGKILL.
MPIRUN_KILL_GRACE_S = 10.0
SSH_EXIT_CODE = 255  # what ssh exits with when its connection fails
_MPI_TAG = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr|stddiag)>:")


class CommandNotFoundError(InvalidArgumentError):
    """The rank command (or mpirun, or ssh) cannot be executed."""


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _binary(stream) -> BinaryIO:
    return getattr(stream, "buffer", stream)


def _check_runnable(program: str, env: Mapping[str, str]) -> None:
    """CommandNotFoundError, as exec would fail, when ``program`` cannot run here."""
    path = program if os.sep in program else \
        shutil.which(program, path=env.get("PATH", os.defpath))
    if path is None or not os.path.exists(path):
        raise CommandNotFoundError(f"cannot run {program!r}: No such file or directory")
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise CommandNotFoundError(f"cannot run {program!r}: Permission denied")


def launch(command: Sequence[str], np: int, env: Optional[Mapping[str, str]] = None,
           mpi: bool = False, hosts: Optional[str] = None,
           start_timeout_s: float = _config.DEFAULT_START_TIMEOUT_S, verbose: bool = False,
           stdout: Optional[BinaryIO] = None, stderr: Optional[BinaryIO] = None,
           kill_grace_s: float = DEFAULT_KILL_GRACE_S, ssh_port: Optional[int] = None,
           ssh_identity_file: Optional[str] = None,
           network_interface: Optional[str] = None,
           elastic: Optional[ElasticOptions] = None, exchange=None) -> int:
    """Run ``command`` as ``np`` ranks and return the job's exit code.

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
        ``-H host:slots,...``: ranks fill the hosts in order; hosts other than this
        one (``localhost``, ``127.0.0.1``, ``::1``, its own names) are reached over
        ssh.  None: every rank on this host.
    start_timeout_s:
        Passed to the ranks as SPARK_HVD_START_TIMEOUT_S (rendezvous waits at startup);
        also bounds the ssh probe of each host.
    stdout, stderr:
        Binary streams for the ranks' prefixed output and the launcher's messages;
        default this process's stdout and stderr.
    kill_grace_s:
        How long ranks get between SIGTERM and SIGKILL when the job is torn down.
    ssh_port, ssh_identity_file:
        ``ssh -p`` and ``ssh -i`` for the other hosts.
    exchange:
        Used by :func:`spark_hvd.runner.run`: ``before(server)`` runs once the rendezvous
        server is up and before any rank starts, ``after(server)`` once the ranks ended.
    network_interface:
        A NIC name or an address of this host: the rendezvous server listens there
        and every rank is told to reach it there (default: 127.0.0.1 for a job on
        this host only; otherwise all addresses, and the one each host sees).
    elastic:
        Run as an elastic job (:mod:`spark_hvd.runner._elastic_launch`): ``np`` workers
        to start with, between ``elastic.min_np`` and ``elastic.max_np``, on the hosts of
        ``elastic.discovery_script`` or of ``hosts``; output prefixed ``[w<id>]``.

    Returns
    -------
    int
        0 when every rank succeeded, else the first failing rank's exit code
        (128+signum for a signal), or mpirun's exit code under ``mpi``. Elastic: 0 when
        every worker of the final epoch exited 0, 1 when the job failed (reset limit,
        too few workers), else a failing worker's code.

    Raises
    ------
    InvalidArgumentError
        for a bad ``np``/``hosts``/command; CommandNotFoundError when the command,
        mpirun or ssh cannot be executed; HostUnreachableError when ssh cannot run a
        command on one of the hosts.
    """
    command = list(command)
    if not command:
        raise InvalidArgumentError("no command given to run")
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise InvalidArgumentError(f"-np must be an int >= 1, got {np!r}")
    out = Sink(stdout if stdout is not None else _binary(sys.stdout))
    err = Sink(stderr if stderr is not None else _binary(sys.stderr))
    base_env = dict(os.environ)
    base_env.update(env or {})
    source, sizes = None, (np, np, np)
    if elastic is not None:
        if mpi:
            raise InvalidArgumentError("elastic mode (--min-np, --max-np or "
                                       "--host-discovery-script) needs the gloo controller: "
                                       "drop --mpi")
        sizes = elastic.sizes(np)
        source = _elastic_launch.host_source(elastic, hosts, np, base_env)
        slots = _elastic_launch.slots_of(source, _env.hostname(base_env))
    else:
        slots = _hosts.place(hosts, np, _env.hostname(base_env))
    remote = sorted({s.host for s in slots if s.remote})
    ssh = None
    executable = shutil.which("ssh", path=base_env.get("PATH", os.defpath))
    if remote and executable is None:
        raise CommandNotFoundError(
            f"{'-H names' if source is None else 'the job has'} other hosts "
            f"({', '.join(remote)}), which {PROG} reaches over ssh, but there is no ssh on "
            f"PATH: install the OpenSSH client (Debian/Ubuntu: apt-get install openssh-client)")
    if executable is not None and (remote or (elastic and elastic.discovery_script)):
        ssh = _ssh.Ssh(executable, ssh_port, ssh_identity_file,
                       min(start_timeout_s, _ssh.DEFAULT_CONNECT_TIMEOUT_S))
    if not mpi and any(not s.remote for s in slots):
        _check_runnable(command[0], base_env)
    addrs = _addresses.addresses(slots, ssh, network_interface, base_env,
                                 max(start_timeout_s, _ssh.DEFAULT_CONNECT_TIMEOUT_S + 5), err)
    with RendezvousServer(host=addrs.bind) as server:
        if exchange is not None:  # spark_hvd.runner.run: the function in, the results out
            exchange.before(server)
        try:
            return _launch_on(command, np, env, mpi, hosts, remote, slots, source, elastic,
                              sizes, base_env, server, addrs, ssh, start_timeout_s, verbose,
                              out, err, kill_grace_s)
        finally:
            if exchange is not None:
                exchange.after(server)


def _launch_on(command, np, env, mpi, hosts, remote, slots, source, elastic, sizes, base_env,
               server, addrs, ssh, start_timeout_s, verbose, out, err, kill_grace_s) -> int:
    """The launch once the rendezvous server runs (see :func:`launch`)."""
    rdv_env = _env.rendezvous_env(addrs.local, server.port, server.secret, server.run_id)
    if verbose:
        told = "" if not addrs.remote else "; ranks reach it at " + ", ".join(
            [f"{addrs.local} (here)"] + [f"{a} ({h})" for h, a in addrs.remote.items()])
        err.write(f"{PROG}: rendezvous server at {addrs.bind}:{server.port}{told} (run id "
                  f"{server.run_id}), {np} ranks, {'mpi' if mpi else 'gloo'}\n".encode())
    if source is not None:
        return _elastic_launch.launch_elastic(command, elastic, sizes, source, base_env,
                                              server, addrs, ssh, start_timeout_s, verbose,
                                              out, err, kill_grace_s)
    if mpi:
        return _launch_mpi(command, np, base_env, dict(env or {}), rdv_env,
                           start_timeout_s, verbose, out, err, hosts if remote else None,
                           ssh)
    return _launch_gloo(command, slots, base_env, server, addrs, ssh, start_timeout_s,
                        verbose, out, err, kill_grace_s)


def _launch_gloo(command: List[str], slots: Sequence[Slot], base_env: Dict[str, str],
                 server: RendezvousServer, addrs: _addresses.Addresses, ssh: Optional[_ssh.Ssh],
                 start_timeout_s: float, verbose: bool, out: Sink, err: Sink,
                 kill_grace_s: float) -> int:
    # A rank that ends before its init() registered it is lost for the others at once.
    ranks = ProcessGroup(on_exit=lambda rank, code: server.rank_ended(
        rank, why=f"its process {describe_exit(code)}"))
    multi_host = ssh is not None
    try:
        for slot, topo in zip(slots, assign([s.identity for s in slots])):
            rank_env = dict(base_env)
            rank_env.update(_env.rank_env(topo, addrs.of(slot), server.port, server.secret,
                                          server.run_id, _env.CONTROLLER_GLOO, start_timeout_s))
            if multi_host:
                rank_env[_env.HOSTNAME_ENV_VAR] = slot.identity
            prefix = f"[{topo.rank}] ".encode()
            argv, spawn_env, stdin = _ssh.start_args(command, slot, ssh, base_env, rank_env,
                                                     kill_grace_s)
            if verbose and slot.remote:
                err.write(f"{PROG}: rank {topo.rank}: {shlex.join(argv[argv.index('--') + 1:])}"
                          f"\n".encode())
            try:
                ranks.spawn(topo.rank, argv, spawn_env, Prefixed(prefix, out),
                            Prefixed(prefix, err), stdin=stdin)
            except OSError as e:
                raise CommandNotFoundError(f"cannot run {argv[0]!r}: {e.strerror or e}") from None
        failure = ranks.wait_first_failure()
    finally:
        ranks.shutdown(kill_grace_s)
    if failure is None:
        return 0
    rank, returncode = failure
    slot = slots[rank]
    where = f" on {slot.host}" if slot.remote else ""
    hint = ""
    if slot.remote and returncode == SSH_EXIT_CODE:
        hint = " (ssh's code when the connection fails: see its message above)"
    elif slot.remote and 128 < returncode <= 128 + 64:  # a signal there (it does not cross ssh)
        hint = f" (it {describe_exit(128 - returncode)} there)"
    others = "; terminated the other ranks" if len(slots) > 1 else ""
    err.write(f"{PROG}: rank {rank}{where} {describe_exit(returncode)}{hint}{others}\n".encode())
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
                err: Sink, remote_hosts: Optional[str], ssh: Optional[_ssh.Ssh]) -> int:
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
        mpi_env[_config.START_TIMEOUT_S_ENV_VAR] = f"{start_timeout_s:g}"
        mpi_env[_mpi_exec.PID_DIR_ENV_VAR] = pid_dir
        exported = sorted(set(rdv_env) | set(user_env) | {_config.START_TIMEOUT_S_ENV_VAR,
                                                          _mpi_exec.PID_DIR_ENV_VAR}
                          | ({"PYTHONPATH"} & set(mpi_env))
                          | ({"PATH"} & set(mpi_env) if remote_hosts else set()))
        argv = [mpirun, "-np", str(np), "--allow-run-as-root", "--oversubscribe",
                "--tag-output", "-x", f"{_config.CONTROLLER_ENV_VAR}={_env.CONTROLLER_MPI}"]
        if remote_hosts is not None:  # mpirun starts its daemons there over ssh itself
            argv += ["-H", ",".join(f"{h}:{n}" for h, n in parse_hosts(remote_hosts)),
                     "--mca", "plm_rsh_args", " ".join(ssh.options)]
        for name in exported:
            argv += ["-x", name]  # values travel in the environment, not on the command line
        argv += [sys.executable, os.path.abspath(_mpi_exec.__file__)] + command
        if verbose:
            err.write(f"{PROG}: {' '.join(argv)}\n".encode())
        job = ProcessGroup()
        job.extra_kill_groups = lambda: _pids_in(pid_dir)
        try:
            try:  # supervised: mpirun, and so its ranks, end with the launcher
                job.spawn("mpirun", _supervise.argv(argv, MPIRUN_KILL_GRACE_S,
                                                    parent=os.getpid()),
                          mpi_env, _MpiTags(out, err, out), _MpiTags(out, err, err))
            except OSError as e:
                raise CommandNotFoundError(f"cannot run {mpirun}: {e.strerror or e}") from None
            failure = job.wait_first_failure()
        finally:
            job.shutdown(MPIRUN_KILL_GRACE_S)
    if failure is None:
        return 0
    err.write(f"{PROG}: mpirun {describe_exit(failure[1])}\n".encode())
    return exit_code(failure[1])


# horovodrun's tuning flags: flag -> (the setting it sets for every rank, its type, the
# factor from the flag's unit to the setting's).
TUNING_FLAGS = {
    "--fusion-threshold-mb": (_config.FUSION_THRESHOLD_ENV_VAR, float, 1024 * 1024),
    "--cycle-time-ms": (_config.CYCLE_TIME_MS_ENV_VAR, float, 1),
    "--cache-capacity": (_config.CACHE_CAPACITY_ENV_VAR, int, 1),
    "--timeline-filename": (_config.TIMELINE_ENV_VAR, str, None),
    "--stall-check-warning-time-seconds": (_config.STALL_CHECK_TIME_S_ENV_VAR, float, 1),
    "--stall-check-shutdown-time-seconds": (_config.STALL_SHUTDOWN_TIME_S_ENV_VAR, float, 1),
    "--log-level": (_config.LOG_LEVEL_ENV_VAR, str, None),
    "--autotune-log-file": (_config.AUTOTUNE_LOG_ENV_VAR, str, None),
    "--autotune-warmup-samples": (_config.AUTOTUNE_WARMUP_SAMPLES_ENV_VAR, int, 1),
    "--autotune-steps-per-sample": (_config.AUTOTUNE_STEPS_PER_SAMPLE_ENV_VAR, int, 1),
}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def tuning_env(args: argparse.Namespace) -> Dict[str, str]:
    """The settings the tuning flags given set, as environment variables."""
    env = {_config.AUTOTUNE_ENV_VAR: "1"} if getattr(args, "autotune", False) else {}
    for flag, (var, _kind, scale) in TUNING_FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        if scale is None:
            env[var] = str(value)
        else:
            scaled = value * scale
            env[var] = str(int(scaled)) if float(scaled).is_integer() else f"{scaled:g}"
    return env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Run a command as N spark_hvd ranks, on this host or on "
                               "several over ssh.",
        usage=f"{PROG} -np N [--gloo | --mpi] [-H host:slots,...] [-p SSH_PORT] "
              f"[-i SSH_IDENTITY_FILE] [--network-interface NIC_OR_ADDRESS] [--start-timeout S] "
              f"[--verbose] [--min-np A] [--max-np B] [--host-discovery-script SCRIPT] "
              f"[--slots-per-host N] [--reset-limit K] [--elastic-timeout S] "
              f"[--blacklist-cooldown-range LOW HIGH] [--fusion-threshold-mb MB] "
              f"[--cycle-time-ms MS] [--cache-capacity N] [--timeline-filename PATH] "
              f"[--stall-check-warning-time-seconds S] [--stall-check-shutdown-time-seconds S] "
              f"[--log-level LEVEL] [--autotune] [--autotune-log-file PATH] "
              f"[--autotune-warmup-samples N] [--autotune-steps-per-sample N] "
              f"command [args...]")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                   help="number of ranks")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--gloo", dest="mpi", action="store_false",
                      help="start the ranks directly, Gloo controller (default)")
    mode.add_argument("--mpi", dest="mpi", action="store_true",
                      help="start the ranks with Open MPI's mpirun, MPI controller")
    p.set_defaults(mpi=False)
    p.add_argument("-H", "--hosts", dest="hosts", default=None, metavar="HOST:SLOTS,...",
                   help="host:slots,... (slots default 1): ranks fill the hosts in this order; "
                        "this host (localhost, 127.0.0.1, ::1, its name) starts them directly, "
                        "any other over ssh (keys only, BatchMode), with this working "
                        "directory, Python and environment. Default: every rank here")
    p.add_argument("-p", "--ssh-port", dest="ssh_port", type=int, default=None,
                   help="port of sshd on the other hosts")
    p.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", default=None,
                   help="private key for ssh to the other hosts")
    p.add_argument("--network-interface", dest="network_interface", default=None,
                   metavar="NIC_OR_ADDRESS",
                   help="NIC name or address of this host where the rendezvous server "
                        "listens and the ranks reach it (default: 127.0.0.1 for a job on "
                        "this host, else the address each host sees)")
    p.add_argument("--start-timeout", dest="start_timeout", type=float,
                   default=_config.DEFAULT_START_TIMEOUT_S,
                   help=f"seconds ranks wait for each other at startup "
                        f"(default {_config.DEFAULT_START_TIMEOUT_S:g})")
    p.add_argument("--verbose", action="store_true", help="say where the rendezvous server is")
    tuning = p.add_argument_group("tuning (horovodrun's flags; each sets a setting for the ranks)")
    tuning.add_argument("--autotune", action="store_true",
                        help=f"sets {_config.AUTOTUNE_ENV_VAR}=1")
    for flag, (var, kind, _scale) in TUNING_FLAGS.items():
        tuning.add_argument(flag, dest=_dest(flag), type=kind, default=None, metavar="VALUE",
                            help=f"sets {var}")
    _elastic_launch.add_arguments(p)
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
        code = launch(command, args.np, env=tuning_env(args), mpi=args.mpi, hosts=args.hosts,
                      start_timeout_s=args.start_timeout, verbose=args.verbose,
                      ssh_port=args.ssh_port, ssh_identity_file=args.ssh_identity_file,
                      network_interface=args.network_interface,
                      elastic=_elastic_launch.options_from(args))
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
