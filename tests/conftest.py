"""Puts tests/ on sys.path, so every test directory imports the shared multi-rank
machinery (tests/_ranks.py) however pytest is pointed at them; ``--np N`` keeps the
tests parametrized by a rank count at N ranks only."""

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def pytest_addoption(parser):
    parser.addoption("--np", type=int, default=None, metavar="N",
                     help="run the tests parametrized by a rank count (np) only at N ranks "
                          "(make test-fast)")


def pytest_collection_modifyitems(config, items):
    np = config.getoption("--np")
    if np is None:
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        (drop if params.get("np", np) != np else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
