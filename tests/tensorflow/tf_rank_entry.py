"""Rank side of tf_harness: ``tf_rank_entry.py MODULE_FILE [CHECK...]`` (under spark-hvdrun).

Pins TensorFlow to one thread each way (the test machine has two cores for two ranks),
initializes spark_hvd, then runs every ``check_*`` function of MODULE_FILE in file order
(or only the named ones),
printing ``@@TFTEST {json}`` lines (start, then pass / fail / skip). A check may return a
JSON-able value, reported as ``result``.
"""

import importlib.util
import json
import os
import sys
import time
import traceback

import keras
import tensorflow as tf

MARK = "@@TFTEST "


class Skip(Exception):
    """Raise from a check to skip it (with the reason)."""


def _emit(**rec) -> None:
    sys.stdout.write(MARK + json.dumps(rec) + "\n")
    sys.stdout.flush()


def main() -> None:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import spark_hvd.tensorflow as hvd

    hvd.init()
    rank = hvd.rank()
    path, only = sys.argv[1], set(sys.argv[2:])
    spec = importlib.util.spec_from_file_location(
        os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    checks = sorted((f for name, f in vars(module).items()
                     if name.startswith("check_") and callable(f)
                     and (not only or name in only)),
                    key=lambda f: f.__code__.co_firstlineno)
    for fn in checks:
        _emit(event="start", fn=fn.__name__, rank=rank)
        t0 = time.monotonic()
        keras.utils.set_random_seed(1234)
        try:
            result = fn()
        except AssertionError:  # raised after the check's collectives: ranks stay in step
            _emit(event="fail", fn=fn.__name__, rank=rank, error=traceback.format_exc())
            continue
        except Exception as exc:  # noqa: BLE001 - reported to the harness
            if type(exc).__name__ == "Skip":
                _emit(event="skip", fn=fn.__name__, rank=rank, reason=str(exc))
                continue
            _emit(event="fail", fn=fn.__name__, rank=rank, error=traceback.format_exc())
            sys.stdout.flush()
            os._exit(1)
        _emit(event="pass", fn=fn.__name__, rank=rank, seconds=round(time.monotonic() - t0, 3),
              result=result)
    hvd.shutdown()


if __name__ == "__main__":
    main()
