"""Builds spark_hvd: setuptools drives CMake for the native core (csrc/)."""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # A stable build folder keeps CMake incremental across (editable) reinstalls.
        tag = f"py{sys.version_info.major}{sys.version_info.minor}"
        build_dir = ROOT / "build" / f"cmake-{tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = os.environ.get("SPARK_HVD_BUILD_TYPE", "Release")
        configure = [
            "cmake", str(ROOT),
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        ]
        if os.environ.get("SPARK_HVD_WITHOUT_MPI"):
            configure.append("-DSPARK_HVD_WITH_MPI=OFF")
        subprocess.check_call(configure, cwd=build_dir)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir)


setup(
    ext_modules=[CMakeExtension("spark_hvd._core")],
    cmdclass={"build_ext": CMakeBuild},
)
