"""Rank side of torch_harness: ``rank_entry.py FILE::FN...`` (under spark-hvdrun).

Initializes spark_hvd, then runs each named function of its rank module FILE (a
path relative to this directory), printing one ``@@HVDTEST {json}`` line when it
starts and one with its outcome. On a failure
the rank exits at once (status 1): its peers may be blocked in a collective the
failed rank will never join, and the launcher ends them.
"""

import importlib.util
import json
import os
import sys
import time
import traceback

import torch

MARK = "@@HVDTEST "


class Skip(Exception):
    """Raise from a check_* function to skip it (with the reason)."""


def _emit(**rec) -> None:
    sys.stdout.write(MARK + json.dumps(rec) + "\n")
    sys.stdout.flush()


def main() -> None:
    torch.set_num_threads(1)
    import spark_hvd.torch as hvd

    hvd.init()
    rank = hvd.rank()
    here = os.path.dirname(os.path.abspath(__file__))
    modules = {}
    for spec_text in sys.argv[1:]:
        file, _, fn = spec_text.partition("::")
        if file not in modules:
            spec = importlib.util.spec_from_file_location(os.path.splitext(file)[0],
                                                          os.path.join(here, file))
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            modules[file] = module
        _emit(event="start", fn=spec_text, rank=rank)
        t0 = time.monotonic()
        torch.manual_seed(1234)
        try:
            getattr(modules[file], fn)()
        except Exception as exc:  # noqa: BLE001 - reported to the harness
            skip = type(exc).__name__ == "Skip"
            _emit(event="skip" if skip else "fail", fn=spec_text, rank=rank,
                  detail=str(exc) if skip else traceback.format_exc(),
                  seconds=time.monotonic() - t0)
            if not skip:
                sys.stderr.flush()
                os._exit(1)
            continue
        _emit(event="ok", fn=spec_text, rank=rank, seconds=time.monotonic() - t0)
    hvd.barrier()  # a rank that shuts down early would fail its peers' pending work
    hvd.shutdown()


if __name__ == "__main__":
    main()
