"""Run by ``spark-hvdrun`` in front of each rank's command, so that the rank ends with the launcher.

    python -I -S .../spark_hvd/runner/_supervise.py [--parent PID] [--grace S]
                                   [--stdin-env] [--sigterm-ignored] -- command [args...]

It starts ``command`` in its own process group, which it leads (the launcher
starts it in a new session; over ssh it calls setsid itself), so a signal to the
group, the launcher's teardown included, reaches everything the command started.
Then:

1. It dies with its parent (``--parent``, default the one it has when it starts):
   PR_SET_PDEATHSIG(SIGTERM) on Linux (checking right after that the parent is
   still there), a watchdog thread elsewhere.  With ``--stdin-env`` (a remote
   rank, started over ssh) stdin reaching EOF means the same: the launcher, or
   the ssh connection, is gone.  Either way it ends its group: SIGTERM, then
   SIGKILL after ``--grace`` seconds (it exits without waiting if nothing else is
   left in the group once the command has exited).
2. Without ``--stdin-env``, a SIGTERM while its parent lives is the launcher's
   teardown, which signalled the whole group: the command got it too, so it only
   waits for the command (and the launcher SIGKILLs the group after its grace).
3. Otherwise it ends as the command did: with the same exit code, or killed by
   the same signal (re-raised on itself, so the launcher's reports are unchanged).
   A signal does not cross ssh, so under ``--stdin-env`` it exits with 128+signum.

``--stdin-env``: the first line of stdin is a JSON object of variables added to
the command's environment (how the launcher passes a remote rank its variables,
the job's secret included, without a command line that ``ps`` shows); the command
gets /dev/null as stdin.  ``--sigterm-ignored`` starts the command with SIGTERM
ignored, which ``ssh`` keeps: the launcher then ends a remote rank by closing
ssh's stdin, and the rank's last output still arrives.

It imports only the standard library and is run by path in isolated mode, so it
costs a few tens of milliseconds and never shadows the user's modules.
"""

import json
import os
import signal
import subprocess
import sys
import threading

PR_SET_PDEATHSIG = 1
WATCHDOG_PERIOD_S = 1.0
DEFAULT_GRACE_S = 3.0
_END_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_USAGE = ("usage: _supervise.py [--parent PID] [--grace S] [--stdin-env] [--sigterm-ignored] "
          "-- command [args...]")


def die_with_parent(parent_pid: int, sig: int, on_orphaned) -> None:
    """Have ``sig`` sent to this process when its parent ``parent_pid`` dies.

    On Linux through PR_SET_PDEATHSIG; if the parent died before that took effect,
    or elsewhere, ``on_orphaned()`` is called (at once, or from a watchdog thread).
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0:
                if os.getppid() != parent_pid:  # it died before prctl took effect
                    on_orphaned()
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        tick = threading.Event()
        while os.getppid() == parent_pid:
            tick.wait(WATCHDOG_PERIOD_S)  # nothing to wait on but the parent's pid
        on_orphaned()

    threading.Thread(target=watch, name="spark_hvd-parent-watchdog", daemon=True).start()


def _exit_as(returncode: int, signal_as_code: bool) -> None:
    """Exit with ``returncode`` (a Popen returncode: -signum for a signal)."""
    if returncode >= 0:
        os._exit(returncode)
    sig = -returncode
    if not signal_as_code:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the command dumped already
        except (ImportError, ValueError, OSError):
            pass
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these keep their default
            try:
                signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
            except (OSError, ValueError):
                pass
        try:
            os.kill(os.getpid(), sig)
        except OSError:
            pass
    os._exit(128 + sig)


def _others_in_group() -> bool:
    """Whether a process other than this one is in its process group (True if unknown)."""
    me, group = os.getpid(), os.getpgrp()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # after the command name: state, ppid, pgrp; a zombie has ended already
        if pid != me and int(fields[2]) == group and fields[0] != b"Z":
            return True
    return False


def _ignore_sigterm() -> None:  # in the child, before exec: SIG_IGN survives exec
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _Supervisor:
    def __init__(self, parent: int, grace_s: float, stdin_env: bool,
                 sigterm_ignored: bool) -> None:
        self.parent = parent
        self.grace_s = grace_s
        self.stdin_env = stdin_env
        self.sigterm_ignored = sigterm_ignored
        self.child = None
        self._ending = threading.Event()
        self._lock = threading.RLock()  # end_group may be re-entered by our signal handler

    def end_group(self) -> None:
        """SIGTERM the whole group (us included: the handler ignores it), SIGKILL it later."""
        with self._lock:
            if self._ending.is_set():
                return
            self._ending.set()
        self._killpg(signal.SIGTERM)
        timer = threading.Timer(self.grace_s, self._killpg, (signal.SIGKILL,))
        timer.daemon = True
        timer.start()

    @staticmethod
    def _killpg(sig: int) -> None:
        try:
            os.killpg(os.getpgrp(), sig)
        except OSError:
            pass

    def _on_signal(self, signum, frame) -> None:
        if self.stdin_env or os.getppid() != self.parent:
            self.end_group()
        # else: the launcher signalled our whole group; wait for the command to end

    def _watch_stdin(self, stdin) -> None:
        try:
            while stdin.read1(65536):
                pass
        except (OSError, ValueError):
            pass
        self.end_group()

    def run(self, command) -> None:
        if os.getpgrp() != os.getpid():
            try:
                os.setsid()
            except OSError:
                os.setpgid(0, 0)
        for s in _END_SIGNALS:
            signal.signal(s, self._on_signal)
        env = None
        if self.stdin_env:
            stdin = sys.stdin.buffer
            line = stdin.readline()
            if not line:
                os._exit(128 + signal.SIGTERM)  # the launcher went away before we started
            env = dict(os.environ)
            env.update(json.loads(line))
            threading.Thread(target=self._watch_stdin, args=(stdin,), daemon=True,
                             name="spark_hvd-stdin-watch").start()
        die_with_parent(self.parent, signal.SIGTERM, self.end_group)
        if self._ending.is_set():
            os._exit(128 + signal.SIGTERM)
        try:
            self.child = subprocess.Popen(
                command, env=env, preexec_fn=_ignore_sigterm if self.sigterm_ignored else None,
                stdin=subprocess.DEVNULL if self.stdin_env else None)
        except OSError as e:
            sys.stderr.write(f"spark-hvdrun: cannot run {command[0]!r}: {e.strerror or e}\n")
            sys.stderr.flush()
            os._exit(127)
        returncode = self.child.wait()
        if self._ending.is_set() and _others_in_group():
            # What the command left behind got SIGTERM with it: the timer SIGKILLs the
            # group, us included, when their grace is over.
            threading.Event().wait()
        _exit_as(returncode, signal_as_code=self.stdin_env)


def main(argv) -> None:
    parent, grace_s, stdin_env, sigterm_ignored = os.getppid(), DEFAULT_GRACE_S, False, False
    i = 0
    try:
        while argv[i] != "--":
            if argv[i] == "--parent":
                parent = int(argv[i + 1])
                i += 2
            elif argv[i] == "--grace":
                grace_s = float(argv[i + 1])
                i += 2
            elif argv[i] in ("--stdin-env", "--sigterm-ignored"):
                stdin_env = stdin_env or argv[i] == "--stdin-env"
                sigterm_ignored = sigterm_ignored or argv[i] == "--sigterm-ignored"
                i += 1
            else:
                raise ValueError(argv[i])
    except (IndexError, ValueError):
        sys.exit(_USAGE)
    command = argv[i + 1:]
    if not command:
        sys.exit(_USAGE)
    _Supervisor(parent, grace_s, stdin_env, sigterm_ignored).run(command)


def argv(command, grace_s: float, parent=None, stdin_env: bool = False,
         sigterm_ignored: bool = False, python: str = sys.executable) -> list:
    """The command line that runs ``command`` under this supervisor.

    ``parent``: the pid it dies with (default: its parent when it starts).
    """
    flags = ["--grace", f"{grace_s:g}"]
    if parent is not None:
        flags += ["--parent", str(parent)]
    if stdin_env:
        flags.append("--stdin-env")
    if sigterm_ignored:
        flags.append("--sigterm-ignored")
    return [python, "-I", "-S", os.path.abspath(__file__), *flags, "--", *command]


if __name__ == "__main__":
    main(sys.argv[1:])
