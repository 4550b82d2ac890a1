"""How a rank's process ends once its result is handed over: as the interpreter would, but
without tearing the interpreter down.

``exit_now`` does what the interpreter's exit does first (``threading._shutdown``: thread
pools left open are told to finish, non-daemon threads joined), runs the ``atexit`` handlers
(spark_hvd's own shutdown is one; ``logging`` flushes its handlers in another), flushes
Python's and C's standard streams, then calls ``os._exit`` with the code, as
``multiprocessing`` ends a forked child. Tearing down an interpreter that imported torch (and
``torch._dynamo``, which any optimizer imports) takes seconds the job waits for; what is
skipped is only the destruction of the remaining modules and objects, which Python does not
promise to finalize at exit anyway. Used by a Spark rank's child (``spark_hvd.spark._child``)
and a rank of ``spark_hvd.runner.run`` (``spark_hvd.runner._run_rank``). Standard library only.
"""

import atexit
import os
import sys
import threading


def exit_now(code: int) -> None:
    """End the process with ``code``: what Python's exit does before the interpreter's
    teardown, then ``os._exit``."""
    # What the interpreter's exit does first (CPython's own function): the hooks that tell
    # thread pools left open to finish (concurrent.futures), then joining non-daemon threads.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by the function
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # what native code printf'ed
    except (OSError, AttributeError):
        pass
    os._exit(code)
