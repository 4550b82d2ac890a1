"""spark_hvd's asynchronous TensorFlow kernels: built against the installed TensorFlow on
first use, cached, loaded and bound to the core.

The kernels (``kernels/``: C++ against TensorFlow's headers and spark_hvd's C entry
points, ``spark_hvd/include/spark_hvd/c_api.h``) are a library apart from the core, which
includes no framework header. They are compiled with ``tf.sysconfig``'s flags into
``SPARK_HVD_TF_KERNELS_DIR`` (a folder per TensorFlow version and source hash, so an
upgrade builds anew and never loads a stale library); ranks sharing the folder build it
once, under a file lock. ``SPARK_HVD_TF_KERNELS`` chooses: ``auto`` falls back to host
functions (with one warning saying why) when the library cannot be built, ``async``
raises instead, ``host`` never builds it. ``python -m spark_hvd.tensorflow.build_kernels``
builds it ahead of time (an image, a CI cache).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import List

from spark_hvd import _config
from spark_hvd.exceptions import InvalidArgumentError

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "kernels" / "kernels.cc"]
HEADERS = sorted((HERE / "kernels").glob("*.h")) + [
    HERE.parent / "include" / "spark_hvd" / "c_api.h"]
LIBRARY = "libspark_hvd_tf.so"
C_API_VERSION = 1  # SHVD_C_API_VERSION of c_api.h
BUILD_TIMEOUT_S = 600.0
MODES = ("auto", "async", "host")


class _State:
    lock = threading.Lock()
    decided = False
    ops = None  # the loaded op library (tf.load_op_library's module)
    reason = ""  # why there is none


def mode() -> str:
    value = _config.tf_kernels()
    if value not in MODES:
        raise InvalidArgumentError(
            f"{_config.TF_KERNELS_ENV_VAR}={value!r} is not one of {', '.join(MODES)}: auto "
            "(spark_hvd's asynchronous TensorFlow kernels where they build), async (those "
            "kernels, or an error) or host (host functions)")
    return value


def ops():
    """The op library, or None when collectives run as host functions (``reason()``)."""
    if not _State.decided:
        with _State.lock:
            if not _State.decided:
                _decide()
    return _State.ops


def reason() -> str:
    """Why ``ops()`` is None ("" when it is not)."""
    ops()
    return _State.reason


def _decide() -> None:
    chosen = mode()
    if chosen == "host":
        _State.reason = f"{_config.TF_KERNELS_ENV_VAR}=host"
    else:
        import tensorflow as tf

        try:
            _State.ops = _load(build())
        except (OSError, RuntimeError, subprocess.SubprocessError, tf.errors.OpError) as exc:
            _State.reason = str(exc)
            if chosen == "async":
                raise InvalidArgumentError(
                    f"spark_hvd's TensorFlow kernels are unavailable ({_config.TF_KERNELS_ENV_VAR}"
                    f"=async): {exc}") from exc
            logger.warning(
                "spark_hvd.tensorflow runs collectives as host functions: its asynchronous "
                "kernels are unavailable (%s). Graphs with more independent collectives than "
                "TensorFlow has inter-op threads may then hang. Install a C++ compiler, or "
                "set %s=host to silence this.", exc, _config.TF_KERNELS_ENV_VAR)
    _State.decided = True


def cache_dir() -> Path:
    configured = _config.tf_kernels_dir()
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spark_hvd"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    return cxx


def _command(cxx: str, output: Path) -> List[str]:
    import tensorflow as tf

    return [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-Wno-deprecated-declarations",
            *map(str, SOURCES), "-I", str(HERE.parent / "include"),
            *tf.sysconfig.get_compile_flags(), "-o", str(output),
            *tf.sysconfig.get_link_flags()]


def library_path() -> Path:
    """Where this TensorFlow's build of the kernels is (or will be) cached."""
    import tensorflow as tf

    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(" ".join(_command("c++", Path("out"))).encode())
    digest.update(f"{platform.machine()} {sys.platform}".encode())
    return cache_dir() / f"tf{tf.__version__}-{digest.hexdigest()[:16]}" / LIBRARY


def build() -> Path:
    """Compiles the kernels unless this TensorFlow's build is cached; returns the library."""
    lib = library_path()
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank builds; the others wait, then load it
        if lib.exists():
            return lib
        cxx = _compiler()
        logger.warning("spark_hvd: compiling its TensorFlow kernels into %s (once per "
                       "TensorFlow version; about a minute)", lib.parent)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = Path(tmp) / LIBRARY
            proc = subprocess.run(_command(cxx, out), capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if proc.returncode != 0:
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
                raise RuntimeError(f"compiling {SOURCES[0].name} with {cxx} failed "
                                   f"(exit {proc.returncode}):\n{tail}")
            os.replace(out, lib)  # whole or not at all: a reader never sees half a library
    return lib


def _load(lib: Path):
    import tensorflow as tf

    from spark_hvd import _core

    library = tf.load_op_library(str(lib))
    get_api = ctypes.CDLL(_core.__file__).spark_hvd_c_api
    get_api.restype, get_api.argtypes = ctypes.c_void_p, [ctypes.c_int32]
    api = get_api(C_API_VERSION)
    if not api:
        raise RuntimeError(f"spark_hvd's core does not speak version {C_API_VERSION} of its C "
                           "entry points (a stale build: reinstall spark_hvd)")
    bind = ctypes.CDLL(str(lib)).spark_hvd_tf_bind
    bind.restype, bind.argtypes = ctypes.c_int, [ctypes.c_void_p]
    if bind(api) != 0:
        raise RuntimeError(f"{lib} does not speak version {C_API_VERSION} of spark_hvd's C "
                           "entry points (remove it to rebuild)")
    return library
