"""Builds spark_hvd: setuptools drives CMake for the native core (csrc/).

CMake, ninja and pybind11 come from pyproject.toml's build requirements, so ``pip install .``
needs no system packages beyond a C++ compiler; a cmake or ninja of the system is used when
the build environment has none (``--no-build-isolation`` without them). Optional backends
are CMake options (CMakeLists.txt): SPARK_HVD_WITHOUT_GLOO=1 / SPARK_HVD_WITHOUT_MPI=1 /
SPARK_HVD_WITHOUT_NCCL=1 turn them off; left on, Gloo and MPI are built when CMake finds
their library, NCCL always (it is loaded at run time).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# (CMake option, environment variable that turns it off)
OPTIONAL_BACKENDS = (("SPARK_HVD_WITH_GLOO", "SPARK_HVD_WITHOUT_GLOO"),
                     ("SPARK_HVD_WITH_MPI", "SPARK_HVD_WITHOUT_MPI"),
                     ("SPARK_HVD_WITH_NCCL", "SPARK_HVD_WITHOUT_NCCL"))


def build_tool(name: str) -> str | None:
    """The tool from its Python package (the build environment's), else the system's."""
    try:
        module = __import__(name)
        path = Path(module.BIN_DIR if name == "ninja" else module.CMAKE_BIN_DIR) / name
        if path.is_file():
            return str(path)
    except (ImportError, AttributeError):
        pass
    return shutil.which(name)


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        cmake = build_tool("cmake")
        if cmake is None:
            raise RuntimeError("building spark_hvd needs CMake: pip install cmake (pip install . "
                               "gets it from the build requirements), or apt-get install cmake")
        ninja = build_tool("ninja")
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # A stable build folder keeps CMake incremental across (editable) reinstalls; one per
        # generator, since CMake cannot switch a folder's generator.
        tag = f"py{sys.version_info.major}{sys.version_info.minor}"
        build_dir = ROOT / "build" / (f"cmake-{tag}-ninja" if ninja else f"cmake-{tag}")
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = os.environ.get("SPARK_HVD_BUILD_TYPE", "Release")
        configure = [
            cmake, str(ROOT),
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        ]
        if ninja:
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        # Always passed: an option left out would keep its cached value from the last build.
        for option, off_var in OPTIONAL_BACKENDS:
            configure.append(f"-D{option}={'OFF' if os.environ.get(off_var) else 'ON'}")
        subprocess.check_call(configure, cwd=build_dir)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.check_call([cmake, "--build", ".", "--parallel", jobs], cwd=build_dir)


setup(
    ext_modules=[CMakeExtension("spark_hvd._core")],
    cmdclass={"build_ext": CMakeBuild},
)
