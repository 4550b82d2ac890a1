"""Builds the test doubles of the CUDA runtime and NCCL (tests/fakes/*.cc) that the NCCL
backend's tests load where there is no GPU, and the driver that tests the doubles.

Importable from any test directory (tests/conftest.py puts tests/ on sys.path)::

    from fakes.build import cached_fakes, fake_env
    env = fake_env(cached_fakes(), devices=2)   # SPARK_HVD_CUDA_LIBRARY=..., ...

Each output is rebuilt only when one of its inputs (sources, shared headers, this file)
is newer; concurrent builds of one directory serialize on a lock file.
"""

from __future__ import annotations

import fcntl
import functools
import glob
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence

FAKES = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(FAKES))
CSRC = os.path.join(ROOT, "csrc")
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ["-std=c++17", "-O1", "-fPIC", "-pthread", "-I", CSRC]
CUDART = "libshvd_fake_cudart.so"
NCCL = "libshvd_fake_nccl.so"
DRIVER = "fake_driver"
# A test driver of the core's C entry points (what a framework adapter does): cases_nccl.py
# runs device ops through it, and finds it through this variable.
CAPI_DRIVER = "libshvd_capi_driver.so"
CAPI_DRIVER_ENV_VAR = "SHVD_CAPI_DRIVER"
_C_API_H = os.path.join(ROOT, "spark_hvd", "include", "spark_hvd", "c_api.h")

# The fakes' knobs (read by the libraries; see the top of fake_cudart.cc and fake_nccl.cc).
DEVICES_ENV_VAR = "SHVD_FAKE_CUDA_DEVICES"  # fake GPUs per process
DEFAULT_DEVICES = 1
DELAY_US_ENV_VAR = "SHVD_FAKE_CUDA_DELAY_US"  # how long each queued stream item waits
DEFAULT_DELAY_US = 200
HOST_ENV_VAR = "SHVD_FAKE_NCCL_HOST"  # the host NCCL reports (default: gethostname())
# 1: the null stream is queued like the legacy default stream (torch's default stream)
LEGACY_STREAM_ENV_VAR = "SHVD_FAKE_CUDA_LEGACY_STREAM"

# Where cached_fakes() builds: this env var, else build/test-fakes in the checkout.
BUILD_DIR_ENV_VAR = "SHVD_FAKES_BUILD_DIR"
DEFAULT_BUILD_DIR = os.path.join(ROOT, "build", "test-fakes")

_API_H = os.path.join(CSRC, "backends", "cuda", "api.h")


def _src(name: str) -> List[str]:
    return [os.path.join(FAKES, name)]


def _stale(output: str, inputs: Sequence[str]) -> bool:
    if not os.path.exists(output):
        return True
    return os.path.getmtime(output) < max(os.path.getmtime(p) for p in inputs)


def _compile(output: str, sources: Sequence[str], headers: Sequence[str],
             flags: Sequence[str], libs: Sequence[str] = ()) -> str:
    if not _stale(output, [*sources, *headers, os.path.abspath(__file__)]):
        return output
    tmp = f"{output}.{os.getpid()}.tmp"
    cmd = [CXX, *CXXFLAGS, *flags, "-o", tmp, *sources, *libs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building {os.path.basename(output)} failed:\n$ {' '.join(cmd)}\n"
                           f"{proc.stderr}")
    os.replace(tmp, output)
    return output


def _shared(out_dir: str, name: str, sources: Sequence[str], headers: Sequence[str],
            libs: Sequence[str] = ()) -> str:
    return _compile(os.path.join(out_dir, name), sources, headers,
                    ["-shared", f"-Wl,-soname,{name}", "-Wl,--no-undefined"], libs)


class _Lock:
    def __init__(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self._f = open(os.path.join(out_dir, ".lock"), "w")

    def __enter__(self) -> "_Lock":
        fcntl.flock(self._f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()


def _build(out_dir: str, with_driver: bool) -> Dict[str, str]:
    headers = [_API_H, *sorted(glob.glob(os.path.join(FAKES, "*.h")))]
    with _Lock(out_dir), ThreadPoolExecutor(2) as pool:
        driver = pool.submit(_compile, os.path.join(out_dir, DRIVER), _src("fake_driver.cc"),
                             headers, [], ["-ldl"]) if with_driver else None
        cudart = _shared(out_dir, CUDART, _src("fake_cudart.cc"), headers)
        nccl_sources = sorted(glob.glob(os.path.join(FAKES, "fake_nccl*.cc")))
        # DT_NEEDED libshvd_fake_cudart.so, found next to it: one runtime for both.
        nccl = _shared(out_dir, NCCL, nccl_sources, [*headers, cudart],
                       ["-L", out_dir, f"-l:{CUDART}", "-Wl,-rpath,$ORIGIN"])
        capi = _compile(os.path.join(out_dir, CAPI_DRIVER), _src("capi_driver.cc"), [_C_API_H],
                        ["-shared", "-I", os.path.dirname(os.path.dirname(_C_API_H))])
        paths = {"cudart": cudart, "nccl": nccl, "capi_driver": capi}
        if driver is not None:
            paths["driver"] = driver.result()
    return paths


def build_fakes(out_dir: str) -> Dict[str, str]:
    """Builds the fake libraries into ``out_dir`` (where stale) and returns their paths.

    Returns
    -------
    dict
        ``cudart``: libshvd_fake_cudart.so, ``nccl``: libshvd_fake_nccl.so,
        ``capi_driver``: libshvd_capi_driver.so (drives the core's C entry points).
    """
    return _build(out_dir, with_driver=False)


def build_driver(out_dir: str) -> Dict[str, str]:
    """:func:`build_fakes` plus ``driver``: the fake_driver executable."""
    return _build(out_dir, with_driver=True)


@functools.lru_cache(maxsize=None)
def cached_fakes(with_driver: bool = False) -> Dict[str, str]:
    """Builds once per process into $SHVD_FAKES_BUILD_DIR (default build/test-fakes)."""
    out_dir = os.environ.get(BUILD_DIR_ENV_VAR) or DEFAULT_BUILD_DIR
    return dict(_build(out_dir, with_driver))


def fake_env(fakes: Dict[str, str], devices: int = DEFAULT_DEVICES,
             delay_us: Optional[int] = None) -> Dict[str, str]:
    """The environment that points the NCCL backend at the fakes, with ``devices`` fake
    GPUs per process (give each rank its own: NCCL refuses two ranks on one device) and
    the null stream queued as the legacy default stream (work a tensor's producer queued
    there is not done until the stream runs it)."""
    env = {"SPARK_HVD_CUDA_LIBRARY": fakes["cudart"], "SPARK_HVD_NCCL_LIBRARY": fakes["nccl"],
           DEVICES_ENV_VAR: str(devices), LEGACY_STREAM_ENV_VAR: "1",
           CAPI_DRIVER_ENV_VAR: fakes["capi_driver"]}
    if delay_us is not None:
        env[DELAY_US_ENV_VAR] = str(delay_us)
    return env
