"""The process that runs the user's function for one rank.

A rank's Spark task (:mod:`spark_hvd.spark._task`) starts it as a script::

    python .../spark_hvd/spark/_child.py PAYLOAD_FILE RESULT_FILE PARENT_PID

It loads ``(fn, args, kwargs)`` from PAYLOAD_FILE (cloudpickle), calls ``fn``,
and writes a record to RESULT_FILE: ``{"ok": True, "value": <pickled return
value>}`` or ``{"ok": False, "type", "message", "traceback", "peer_lost", "lost_ranks",
"collective"}`` (``peer_lost``: a PeerLostError, ``lost_ranks`` the ranks it names;
``collective``: any failed collective, i.e. a HorovodInternalError that is not an
InvalidArgumentError such as a tensor mismatch); a
failure also prints its traceback to stderr (which the driver shows with the
rank's other output) and exits with code 1.

It is run as a file, not with ``-m``, and imports nothing but the standard
library and cloudpickle (which the payload's functions are rebuilt with) until its record
is written, so a function that does not use spark_hvd does not pay for importing it.  It
dies with its parent, the task's Python worker: PR_SET_PDEATHSIG (SIGKILL) on Linux,
a watchdog thread elsewhere.  (Processes the function started itself are ended by
the task, which signals the child's whole session, unless the worker was killed
outright.)

Once the record is written the child ends as the interpreter would, but without tearing the
interpreter down (seconds once torch is imported): ``spark_hvd._job.exit.exit_now``, a
standard-library module, joins its threads, runs the ``atexit`` handlers, flushes the
standard streams and calls ``os._exit``.
"""

import os
import pickle
import signal
import sys
import time
import traceback

def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this child's group (it leads one) when the task's Python worker dies.

    The mechanism is the launcher supervisor's (spark_hvd/runner/_supervise.py, also
    standard library only), loaded by path so that nothing of spark_hvd is imported.
    """
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "runner", "_supervise.py")
    spec = importlib.util.spec_from_file_location("_spark_hvd_supervise", path)
    supervise = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(supervise)
    supervise.die_with_parent(parent_pid, signal.SIGKILL,
                              lambda: os.killpg(os.getpgrp(), signal.SIGKILL))


def _taxonomy(exc: BaseException) -> set:
    """The names of the spark_hvd.exceptions classes ``exc`` is an instance of."""
    return {c.__name__ for c in type(exc).__mro__ if c.__module__ == "spark_hvd.exceptions"}


def _dumps(value) -> bytes:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        import cloudpickle

        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _write(path: str, record: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def _failure(exc: BaseException, what: str, own_frame: bool = False) -> dict:
    """Print ``what`` and the traceback (without this module's frame when
    ``own_frame``) to stderr; the error record."""
    tb = exc.__traceback__
    if own_frame and tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    sys.stderr.write(f"{what}:\n{text}")
    kinds = _taxonomy(exc)
    return {"ok": False, "type": type(exc).__name__, "message": str(exc), "traceback": text,
            "peer_lost": "PeerLostError" in kinds,
            "lost_ranks": sorted(getattr(exc, "ranks", None) or []) if "PeerLostError" in kinds
            else [],
            "collective": "HorovodInternalError" in kinds and "InvalidArgumentError" not in kinds,
            "time": time.time()}


def main(argv) -> int:
    payload_path, result_path, parent_pid = argv[1], argv[2], int(argv[3])
    _die_with_parent(parent_pid)
    # Run as a script, Python put this file's directory first on sys.path, where its
    # sibling modules would shadow the user's (``import runner``...): take it off.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.argv = [argv[0]]
    try:
        with open(payload_path, "rb") as f:
            fn, args, kwargs = pickle.load(f)
    except BaseException as e:
        record = _failure(e, "spark_hvd: cannot load the function to run (is every module it "
                             "uses importable on the executors?)")
    else:
        try:
            value = fn(*args, **kwargs)
        except SystemExit as e:
            if e.code in (None, 0):
                value, record = None, None
            else:
                record = _failure(e, f"spark_hvd: the function called sys.exit({e.code!r})",
                                  own_frame=True)
        except BaseException as e:
            record = _failure(e, "spark_hvd: the function raised", own_frame=True)
        else:
            record = None
        if record is None:
            try:
                record = {"ok": True, "value": _dumps(value)}
            except BaseException as e:
                record = _failure(e, "spark_hvd: the function's return value cannot be pickled")
    sys.stdout.flush()
    sys.stderr.flush()
    _write(result_path, record)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    code = main(sys.argv)
    from spark_hvd._job.exit import exit_now  # standard library only

    exit_now(code)
