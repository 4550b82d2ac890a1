"""`pip install .` with none of the optional system libraries: Gloo, MPI and NCCL left out.

spark_hvd is built from a copy of this checkout (so this checkout's build/ folder is neither
reused nor disturbed) with SPARK_HVD_WITHOUT_GLOO=1 SPARK_HVD_WITHOUT_MPI=1
SPARK_HVD_WITHOUT_NCCL=1 and installed into a folder of its own; every check runs in a fresh
process with that folder first on PYTHONPATH (and a working directory outside the checkout,
which would shadow it). That build uses this venv's build tools (--no-build-isolation), the
CI-time stand-in for a fresh venv; ``test_isolated_wheel_builds_with_the_build_requirements``
builds once the way a user's ``pip wheel .`` does, with pip's build isolation fetching CMake,
ninja and pybind11.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WITHOUT_OPTIONAL = {"SPARK_HVD_WITHOUT_GLOO": "1", "SPARK_HVD_WITHOUT_MPI": "1",
                    "SPARK_HVD_WITHOUT_NCCL": "1"}
BUILD_TIMEOUT_S = 400  # about a minute on 2 idle cores
RUN_TIMEOUT_S = 120


def builds(test):
    """Marks a test that builds spark_hvd, or uses the build (its first user pays for it):
    slow, build, and a timeout above the suite's default for a loaded machine."""
    for mark in (pytest.mark.slow, pytest.mark.build, pytest.mark.timeout(BUILD_TIMEOUT_S + 200)):
        test = mark(test)
    return test


def copy_source(dest: Path) -> Path:
    """What a clone of this checkout holds (tracked files, and new ones git does not ignore),
    copied to dest."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = ROOT / name
        if src.is_file():  # listed but deleted in the work tree: not in a clone either
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def run(args, cwd: Path, env_extra=None, pythonpath=None, timeout=RUN_TIMEOUT_S):
    """Runs args to completion; fails the test with the output's tail unless it exits 0."""
    env = dict(os.environ, **(env_extra or {}))
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pythonpath), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (f"{args[:4]} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding spark_hvd built without Gloo, MPI and NCCL (pip install --target)."""
    tmp = tmp_path_factory.mktemp("without_optional")
    src = copy_source(tmp / "src")
    target = tmp / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(src)], cwd=tmp,
        env_extra=WITHOUT_OPTIONAL, timeout=BUILD_TIMEOUT_S)
    return target


def run_python(code: str, site: Path, env_extra=None, timeout=RUN_TIMEOUT_S):
    """Runs code with the built copy first on the path; returns the completed process."""
    return run([sys.executable, "-c", textwrap.dedent(code)], cwd=site.parent,
               env_extra=env_extra, pythonpath=site, timeout=timeout)


def test_build_requirements_bring_cmake_ninja_and_pybind11():
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    names = {r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in requires}
    assert {"cmake", "ninja", "pybind11"} <= names, requires


@builds
def test_backends_left_out_say_so_and_the_default_one_works(site):
    out = run_python("""
        import json, numpy as np, spark_hvd as hvd
        print(json.dumps({"file": hvd.__file__, "gloo": hvd.gloo_built(),
                          "mpi": hvd.mpi_built(), "nccl": hvd.nccl_built()}))
        hvd.init()
        print(json.dumps(hvd.allreduce(np.arange(4.0), name="x").tolist()))
        hvd.shutdown()
    """, site).stdout.splitlines()
    facts = json.loads(out[0])
    assert facts["file"].startswith(str(site)), facts
    assert facts["gloo"] is False and facts["mpi"] is False and facts["nccl"] is False, facts
    assert json.loads(out[1]) == [0.0, 1.0, 2.0, 3.0]

    asks = {"gloo": {"SPARK_HVD_CPU_OPERATIONS": "gloo"},
            "gloo (older name)": {"SPARK_HVD_GLOO_DATA_PLANE": "gloo"},
            "mpi": {"SPARK_HVD_CONTROLLER": "mpi"}}
    for what, env in asks.items():
        err = run_python("""
            import spark_hvd as hvd
            try:
                hvd.init()
            except hvd.InvalidArgumentError as e:
                print("InvalidArgumentError:", e)
        """, site, env_extra=env).stdout
        assert err.startswith("InvalidArgumentError:"), (what, err)
        if what.startswith("gloo"):
            assert "built without Gloo" in err and "gloo_built() is False" in err, err
            assert "libgloo-dev" in err and "reinstall" in err, err
        else:
            assert "built without MPI" in err and "libopenmpi-dev" in err, err


STAGED_CODE = """
    import ctypes, json, os, numpy as np, spark_hvd as hvd
    from spark_hvd import _core, _ops
    from spark_hvd._types import OpType, numpy_code
    rt = ctypes.CDLL(os.environ["SPARK_HVD_CUDA_LIBRARY"])
    facts = {"nccl": hvd.nccl_built(), "cuda": hvd.cuda_built(),
             "why": _core.nccl_unavailable_reason()}
    hvd.init()
    x = np.arange(6, dtype=np.float32)
    dev = ctypes.c_void_p()
    assert rt.cudaSetDevice(0) == 0 and rt.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(24)) == 0
    n = ctypes.c_size_t(x.nbytes)
    assert rt.cudaMemcpyAsync(dev, ctypes.c_void_p(x.ctypes.data), n, 1, None) == 0  # to GPU
    h = _ops.submit(OpType.ALLREDUCE, "g", numpy_code(x.dtype), x.shape, dev.value, dev.value,
                    dev, lambda r: None, reduce_op=hvd.Sum, device=0)
    hvd.synchronize(h)
    out = np.zeros_like(x)
    assert rt.cudaMemcpyAsync(ctypes.c_void_p(out.ctypes.data), dev, n, 2, None) == 0  # back
    assert rt.cudaStreamSynchronize(None) == 0
    facts["sum"] = out.tolist()
    hvd.shutdown()
    print(json.dumps(facts))
"""


@builds
def test_gpu_tensors_are_staged_in_a_build_without_nccl(site):
    """The staged GPU backend and cuda_built() do not need the NCCL backend: in this build
    (without it) a GPU allreduce runs staged through host memory, here on the fake CUDA
    runtime of tests/fakes."""
    from fakes.build import cached_fakes, fake_env

    env = fake_env(cached_fakes())
    facts = json.loads(run_python(STAGED_CODE, site, env_extra=env).stdout.splitlines()[-1])
    assert facts["nccl"] is False and facts["cuda"] is True, facts
    assert "built without its NCCL backend" in facts["why"], facts
    assert facts["sum"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], facts


RANK_CODE = """
    import json, numpy as np, spark_hvd as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert hvd.__file__.startswith({site!r}), hvd.__file__
    out = {{
        "sum": hvd.allreduce(np.arange(5.0) * (r + 1), op=hvd.Sum, name="s").tolist(),
        "avg": hvd.allreduce(np.full(3, float(r)), name="a").tolist(),
        "gather": hvd.allgather(np.full((r + 1, 2), r, dtype=np.int32), name="g").tolist(),
        "bcast": hvd.broadcast(np.arange(3) + 10 * r, root_rank=n - 1, name="b").tolist(),
        "object": hvd.allgather_object({{"rank": r}}),
    }}
    hvd.shutdown()
    print("RESULT", json.dumps(out))
"""


@builds
def test_two_rank_job_runs_collectives_on_the_tcp_backend(site):
    n = 2
    proc = run([sys.executable, "-m", "spark_hvd.runner", "-np", str(n), sys.executable, "-c",
                textwrap.dedent(RANK_CODE.format(site=str(site)))],
               cwd=site.parent, pythonpath=site)
    results = {}
    for line in proc.stdout.splitlines():
        prefix, _, rest = line.partition(" ")
        if rest.startswith("RESULT "):
            results[int(prefix.strip("[]"))] = json.loads(rest[len("RESULT "):])
    assert sorted(results) == list(range(n)), proc.stdout + proc.stderr
    scale = sum(range(1, n + 1))
    gathered = [[q, q] for q in range(n) for _ in range(q + 1)]
    for r, out in results.items():
        assert out["sum"] == [i * scale for i in range(5)], (r, out)
        assert out["avg"] == [sum(range(n)) / n] * 3, (r, out)
        assert out["gather"] == gathered, (r, out)
        assert out["bcast"] == [10 * (n - 1) + i for i in range(3)], (r, out)
        assert out["object"] == [{"rank": q} for q in range(n)], (r, out)


FIT_CODE = """
    import json, os, sys
    import numpy as np, torch
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import SparkSession

    store_dir = sys.argv[1]
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[2]").appName("spark_hvd-tests-built-copy")
             .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.default.parallelism", "2")
             .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
             .getOrCreate())

    import spark_hvd
    from spark_hvd.estimators import LocalStore, TorchEstimator

    def where(_):
        import spark_hvd
        yield spark_hvd.__file__, spark_hvd.gloo_built(), spark_hvd.mpi_built()
    executors = spark.sparkContext.parallelize(range(2), 2).mapPartitions(where).collect()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4))
    y = (x @ np.array([1.0, -2.0, 0.5, 1.5]) > 0).astype(int)
    df = spark.createDataFrame([(Vectors.dense(a.tolist()), int(b)) for a, b in zip(x, y)],
                               ["features", "label"]).repartition(2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    est = TorchEstimator(num_proc=2, store=LocalStore(store_dir), model=net,
                         optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
                         loss=torch.nn.functional.cross_entropy, feature_cols=["features"],
                         label_cols=["label"], batch_size=32, epochs=2, random_seed=1)
    model = est.fit(df)
    print("RESULT", json.dumps({"driver": spark_hvd.__file__, "executors": executors,
                                "history": model.getHistory()}))
    spark.stop()
"""


@builds
def test_torch_estimator_fit_on_local_spark(site):
    proc = run([sys.executable, "-c", textwrap.dedent(FIT_CODE), str(site.parent / "store")],
               cwd=site.parent, pythonpath=site, timeout=240)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    out = json.loads(line[-1][len("RESULT "):])
    assert out["driver"].startswith(str(site)), out
    assert len(out["executors"]) == 2, out
    for path, gloo, mpi in out["executors"]:
        assert path.startswith(str(site)) and not gloo and not mpi, out
    loss = out["history"]["loss"]
    assert len(loss) == 2 and loss[1] < loss[0], out


@builds
def test_isolated_wheel_builds_with_the_build_requirements(tmp_path):
    """``pip wheel .`` as a user runs it (build isolation: CMake, ninja and pybind11 come
    from the registry as pyproject.toml's build requirements), with the optional backends
    this machine has; the build runs the build environment's cmake and ninja."""
    src = copy_source(tmp_path / "src")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "dist"),
         str(src)], cwd=tmp_path, timeout=BUILD_TIMEOUT_S)
    wheels = list((tmp_path / "dist").glob("spark_hvd-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert any(n.startswith("spark_hvd/_core") and n.endswith(".so") for n in names), names
    assert "spark_hvd/estimators/__init__.py" in names and "spark_hvd/settings.def" in names

    cache = {}
    for cache_file in (src / "build").glob("*/CMakeCache.txt"):
        for entry in cache_file.read_text().splitlines():
            key, sep, value = entry.partition("=")
            if sep and not entry.startswith(("#", "//")):
                cache[key.split(":")[0]] = value
    # Not the machine's own cmake or ninja (which this process's PATH would find).
    machine_bins = {Path(d).resolve() for d in os.environ.get("PATH", "").split(os.pathsep) if d}
    for tool in ("CMAKE_COMMAND", "CMAKE_MAKE_PROGRAM"):
        assert tool in cache, sorted(cache)
        assert Path(cache[tool]).resolve().parent not in machine_bins, (tool, cache[tool])
