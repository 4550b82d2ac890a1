"""Fixtures of tests/fakes: the fake CUDA runtime and NCCL, built once per session.
Tests elsewhere use :mod:`fakes.build` directly (its ``cached_fakes`` and ``fake_env``)."""

from typing import Dict

import pytest

from fakes.build import cached_fakes


@pytest.fixture(scope="session")
def fakes() -> Dict[str, str]:
    """Paths of ``cudart``, ``nccl`` (the fake libraries) and ``driver`` (fake_driver)."""
    return cached_fakes(with_driver=True)
