"""One rank of :func:`spark_hvd.runner.run`: ``python -m spark_hvd.runner._run_rank`` fetches
the pickled call from the rendezvous store, runs it, and stores the return value under
this rank (the rank spark_hvd gave it last: an elastic job's final rank), then ends without
the interpreter's teardown (``spark_hvd._job.exit``)."""

import os
import sys

import cloudpickle

from spark_hvd._job import env as job_env
from spark_hvd.runner._run_func import FUNC_KEY, RESULT_PREFIX


def _main() -> None:
    """A rank: fetch the call, run it, store the value under this rank."""
    from spark_hvd._runtime import RUNTIME

    client = job_env.client_from_env()
    if client is None:
        raise SystemExit("spark_hvd.runner._run_rank runs under spark_hvd.runner.run only")
    try:
        func, args, kwargs = cloudpickle.loads(client.get(FUNC_KEY))
        value = func(*args, **kwargs)
        topology = RUNTIME.topology
        rank = topology.rank if topology is not None else job_env.rank_and_size()[0]
        client.set(f"{RESULT_PREFIX}{rank}", cloudpickle.dumps(value))
    finally:
        client.close()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    _main()
    # The value is stored: end as the interpreter would, but without its teardown (seconds
    # once torch is imported), as a Spark rank's child does. A failure above exits as usual.
    from spark_hvd._job.exit import exit_now

    exit_now(0)
