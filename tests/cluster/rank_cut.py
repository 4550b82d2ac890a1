"""A rank that allreduces until a collective fails, for the fault tests: what failed, when.

``allreduce_until_failure(out_dir)`` runs in every rank of a job (spark-hvdrun, or
spark.run/run_elastic through ``train_elastic``): after a few allreduces it writes
``running-<rank>@<host>`` in ``out_dir`` (the shared disk: a test waits for every rank
there, then cuts a host off), and on the first failure ``failed-<rank>.json`` with the
exception's class, message, ``ranks`` and the wall-clock time it was raised (the hosts
share the machine's clock). With ``linger_s``, it then waits (up to that) for the file
``release``: a survivor that exited at once would be lost to the survivors still
waiting, which would name it beside the cut host's ranks. Then it raises the error again.

Run as a script: ``rank_cut.py OUT_DIR [NBYTES]`` (lingering up to 60 s).
"""

import json
import os
import socket
import sys
import time

import numpy as np

NBYTES = 4 << 20


def _write(out_dir: str, name: str, record=None) -> None:
    path = os.path.join(out_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(record or {}, f)
    os.replace(path + ".tmp", path)


def allreduce_until_failure(out_dir: str, nbytes: int = NBYTES, marks: int = 3,
                            linger_s: float = 0.0) -> None:
    import spark_hvd as hvd

    hvd.init()
    rank, host = hvd.rank(), socket.gethostname()
    x = np.ones(nbytes // 4, np.float32)
    done = 0
    try:
        while True:
            hvd.allreduce(x, op=hvd.Sum, name="cut.x")
            done += 1
            if done == marks:
                _write(out_dir, f"running-{rank}@{host}")
    except Exception as e:
        _write(out_dir, f"failed-{rank}.json",
               {"rank": rank, "host": host, "time": time.time(), "allreduces": done,
                "error": type(e).__name__, "message": str(e),
                "ranks": sorted(getattr(e, "ranks", None) or [])})
        deadline = time.monotonic() + linger_s
        while time.monotonic() < deadline and not os.path.exists(os.path.join(out_dir,
                                                                              "release")):
            time.sleep(0.05)
        raise


def train_elastic(out_dir: str, nbytes: int = NBYTES) -> dict:
    """An elastic loop of allreduces: marks ``running-<worker>@<host>`` once every rank
    of the first epoch has trained a few steps, then trains until the job has lost a
    host and gone on without it for 20 more steps."""
    import spark_hvd as hvd
    import spark_hvd.elastic

    hvd.init()
    host = socket.gethostname()
    state = spark_hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0, after=0,
                                          sizes=[])
    x = np.ones(nbytes // 4, np.float32)
    resets = []

    @spark_hvd.elastic.run
    def train(state):
        resets.append((state.step, hvd.size()))
        while state.after < 20:
            total = hvd.allreduce(x, op=hvd.Sum, name="cut.elastic")
            assert total[0] == hvd.size(), (total[0], hvd.size())
            state.step += 1
            if len(resets) > 1:
                state.after += 1
            if state.step == 3 and len(resets) == 1:
                _write(out_dir, f"running-{hvd.rank()}@{host}")
            state.commit()

    train(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "host": host, "resets": resets,
            "step": state.step}


if __name__ == "__main__":
    try:
        allreduce_until_failure(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else NBYTES,
                                linger_s=60.0)
    except Exception:
        sys.exit(1)
