"""Starting ranks on other hosts over ssh.

A remote rank is ``ssh [opts] host 'cd CWD && exec PYTHON -I -S .../_supervise.py
--stdin-env -- command...'``, itself run locally under the supervisor with SIGTERM
ignored.  Its environment travels as the first line of ssh's stdin (so the job's
secret is on no command line), and the launcher then holds that stdin open: when
the launcher closes it, or dies, the remote supervisor sees EOF and ends the rank
and everything it started.  Every host needs the same Python and spark_hvd at the
same paths as this one, as horovodrun needs.

Before any rank starts, each host is probed once (in parallel) with the same
ssh options: an unreachable host or a refused login fails the job at once with
ssh's message and the fix, and the probe's ``$SSH_CONNECTION`` tells the address
at which that host reaches this one (where the rendezvous server is).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from spark_hvd.exceptions import SparkHvdError
from spark_hvd.runner import _hosts, _supervise

PROG = "spark-hvdrun"
DEFAULT_CONNECT_TIMEOUT_S = 10.0
_PROBE_MARK = "spark-hvdrun-ssh-ok"
# Variables of this login session or this host, not the job's: a remote rank gets its
# own from its ssh login.  Everything else in the launcher's environment travels.
_NOT_SENT = frozenset({"HOME", "USER", "LOGNAME", "SHELL", "MAIL", "PWD", "OLDPWD", "SHLVL",
                       "HOSTNAME", "TERM", "DISPLAY", "_", "TMUX", "TMUX_PANE", "COLORTERM",
                       "LS_COLORS", "PS1", "PROMPT_COMMAND"})
_NOT_SENT_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_", "DBUS_")


class HostUnreachableError(SparkHvdError):
    """ssh could not run a command on one of the ``-H`` hosts."""


class Ssh:
    """How to reach the other hosts: ``ssh -o BatchMode=yes [-p PORT] [-i FILE]``."""

    def __init__(self, executable: str, port: Optional[int] = None,
                 identity_file: Optional[str] = None,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        self.executable = executable
        self.port = port
        self.identity_file = identity_file
        self.options = ["-o", "BatchMode=yes",
                        "-o", f"ConnectTimeout={max(1, math.ceil(connect_timeout_s))}"]
        if port is not None:
            self.options += ["-p", str(port)]
        if identity_file is not None:
            self.options += ["-i", identity_file]

    def argv(self, host: str, remote_command: str) -> List[str]:
        return [self.executable, *self.options, "--", host, remote_command]

    def _manual(self, host: str) -> str:
        """The ssh command a user can try by hand."""
        port = f" -p {self.port}" if self.port is not None else ""
        ident = f" -i {shlex.quote(self.identity_file)}" if self.identity_file else ""
        return f"ssh -o BatchMode=yes{port}{ident} {shlex.quote(host)} true"

    def probe(self, hosts: Sequence[str], env: Mapping[str, str],
              timeout_s: float) -> Dict[str, str]:
        """Run a no-op on every host; the address at which each one reaches this host.

        Raises HostUnreachableError naming every host that failed, with ssh's message.
        """
        needed = [sys.executable, os.path.abspath(_supervise.__file__)]
        probe = (f'echo {_PROBE_MARK} "$SSH_CONNECTION"; test -x {shlex.quote(needed[0])} && '
                 f'test -f {shlex.quote(needed[1])} || echo {_PROBE_MARK}-missing')

        def one(host: str) -> Tuple[Optional[str], Optional[str], bool]:
            """(address, what went wrong, whether ssh itself failed)"""
            try:
                proc = subprocess.run(self.argv(host, probe), env=dict(env),
                                      stdin=subprocess.DEVNULL, capture_output=True,
                                      timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return None, f"no answer within {timeout_s:g} s", True
            said = proc.stdout.decode(errors="replace").split()
            if f"{_PROBE_MARK}-missing" in said:
                return None, f"there is no {' or no '.join(needed)}", False
            if _PROBE_MARK in said:
                addr = said[said.index(_PROBE_MARK) + 1:][:1]
                return (addr[0] if addr else _hosts.source_address(host)), None, False
            lines = [x.strip() for x in proc.stderr.decode(errors="replace").splitlines()
                     if x.strip()]
            return None, (f"exit {proc.returncode}: " + " / ".join(lines[-3:]) if lines
                          else f"exit {proc.returncode}, nothing on stderr"), True

        with ThreadPoolExecutor(max_workers=min(32, len(hosts)),
                                thread_name_prefix="spark_hvd-ssh-probe") as pool:
            results = dict(zip(hosts, pool.map(one, hosts)))
        failed = {h: (why, by_ssh) for h, (_, why, by_ssh) in results.items() if why is not None}
        if failed:
            lines = "\n".join(f"  {h}: {why}" for h, (why, _) in failed.items())
            fixes = []
            login = [h for h, (_, by_ssh) in failed.items() if by_ssh]
            if login:
                fixes.append(
                    f"{PROG} logs in with keys only (BatchMode=yes): check that "
                    f"`{self._manual(login[0])}` works from here without a prompt (install a key "
                    f"with ssh-copy-id, or give -i/--ssh-identity-file; --ssh-port for sshd on "
                    f"another port; an unknown host key: ssh-keyscan the host into "
                    f"~/.ssh/known_hosts), and that sshd runs there")
            if len(login) < len(failed):
                fixes.append(f"{PROG} runs the same Python, with spark_hvd at the same path, on "
                             f"every host: install them there as here (or share the directory)")
            raise HostUnreachableError(f"cannot start ranks over ssh on {', '.join(failed)}:\n"
                                       f"{lines}\n" + "\n".join(fixes))
        unknown = [h for h, (addr, _, _) in results.items() if not addr]
        if unknown:
            raise HostUnreachableError(
                f"cannot tell at which address {', '.join(unknown)} reach this host (no "
                f"$SSH_CONNECTION there, no route here): give it with --network-interface")
        return {h: addr for h, (addr, _, _) in results.items()}


def remote_command(command: Sequence[str], cwd: str, grace_s: float,
                   python: str = sys.executable) -> str:
    """The shell command line ssh runs on the remote host for one rank."""
    supervised = _supervise.argv(command, grace_s, stdin_env=True, python=python)
    return f"cd {shlex.quote(cwd)} && exec {shlex.join(supervised)}"


def start_args(command: Sequence[str], slot: "_hosts.Slot", ssh: Optional[Ssh],
               base_env: Mapping[str, str], rank_env: Mapping[str, str],
               grace_s: float) -> Tuple[List[str], Dict[str, str], Optional[bytes]]:
    """``(argv, env, stdin)`` for ProcessGroup.spawn that run ``command`` on ``slot`` under
    the supervisor: here with ``rank_env``, or over ``ssh`` with ``rank_env`` on stdin."""
    if not slot.remote:
        return _supervise.argv(command, grace_s, parent=os.getpid()), dict(rank_env), None
    argv = _supervise.argv(ssh.argv(slot.host, remote_command(command, os.getcwd(), grace_s)),
                           grace_s, parent=os.getpid(), sigterm_ignored=True)
    return argv, dict(base_env), env_line(rank_env)


def env_line(env: Mapping[str, str]) -> bytes:
    """The first line of a remote rank's stdin: its variables, as one JSON object."""
    sent = {k: v for k, v in env.items()
            if k not in _NOT_SENT and not k.startswith(_NOT_SENT_PREFIXES)}
    return json.dumps(sent, sort_keys=True).encode("ascii") + b"\n"
