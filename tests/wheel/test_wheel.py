"""The wheel `make wheel` builds, installed into a fresh virtual environment where no compiler
is on PATH: a 2-rank allreduce on tcp and on gloo (the wheel carries Gloo), nccl_built() and
mpi_built() False (no NCCL here, MPI left out of the wheel), and a TorchEstimator fit and
transform on a local Spark, all from the wheel's spark_hvd.

The fresh venv has only the wheel; the packages it runs with (numpy, torch, pyspark...) come
from this venv's site-packages through a .pth file, whose own .pth files (this checkout's
editable install among them) Python does not process, and the processes run with neither
PYTHONPATH nor this checkout as their working directory.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPILERS = ("cc", "gcc", "c++", "g++", "cpp", "clang", "clang++", "ld", "cmake", "ninja",
             "make", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++")

CHECK_RANK = textwrap.dedent("""
    import os, sys
    import numpy as np
    import spark_hvd as hvd
    hvd.init()
    assert hvd.size() == 2, hvd.size()
    total = hvd.allreduce(np.arange(5, dtype=np.float32) * (hvd.rank() + 1), op=hvd.Sum)
    assert total.tolist() == [0.0, 3.0, 6.0, 9.0, 12.0], total
    print("allreduce ok", os.environ.get("SPARK_HVD_CPU_OPERATIONS", "tcp"),
          "from", os.path.dirname(hvd.__file__))
    print("built gloo", hvd.gloo_built(), "mpi", hvd.mpi_built(), "nccl", hvd.nccl_built(),
          "cuda", hvd.cuda_built())
    hvd.shutdown()
""")

FIT = textwrap.dedent("""
    import os, shutil, sys
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import numpy as np, torch
    from pyspark.sql import SparkSession
    import spark_hvd
    from spark_hvd.spark.torch import TorchEstimator
    from spark_hvd.spark.common.store import LocalStore
    print("COMPILERS", [c for c in sys.argv[1:] if shutil.which(c)])
    print("SPARK_HVD", spark_hvd.__file__)
    spark = (SparkSession.builder.master("local[2]").appName("spark_hvd wheel")
             .config("spark.ui.enabled", "false")
             .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
             .getOrCreate())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    rows = [(v.tolist(), int(v.sum() > 0)) for v in x]
    df = spark.createDataFrame(rows, "features array<float>, label long")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    est = TorchEstimator(num_proc=2, store=LocalStore(os.path.abspath("store")), model=model,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         loss=torch.nn.functional.cross_entropy, feature_cols=["features"],
                         label_cols=["label"], batch_size=16, epochs=1, verbose=0)
    fitted = est.fit(df)
    print("TRANSFORMED", fitted.transform(df).count())
    spark.stop()
""")


def _wheel() -> Path:
    """`make wheel`'s wheel (built now if it is missing or older than the sources)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make to build the wheel with")
    proc = subprocess.run([make, "-s", "wheel"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, f"make wheel failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    wheels = sorted((ROOT / "dist").glob("spark_hvd-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _no_compiler_path(tmp: Path, venv_bin: Path) -> str:
    """PATH: the fresh venv's bin, then every program of the system's bin folders except
    compilers and build tools (links in a folder of our own)."""
    tools = tmp / "bin"
    tools.mkdir()
    for folder in ("/usr/local/bin", "/usr/bin", "/bin"):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if name in COMPILERS or "gcc" in name or "g++" in name or "clang" in name \
                    or (tools / name).exists():
                continue
            (tools / name).symlink_to(os.path.join(folder, name))
    return os.pathsep.join([str(venv_bin), str(tools)])


@pytest.mark.build
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_wheel_installs_without_a_compiler_and_trains(tmp_path):
    wheel = _wheel()
    assert "-manylinux_" in wheel.name and f"-cp{sys.version_info[0]}{sys.version_info[1]}-" \
        in wheel.name, wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("spark_hvd/_core") and n.endswith(".so") for n in names)
    assert any(n.startswith("spark_hvd.libs/libgloo") for n in names), names
    assert not [n for n in names if "libmpi" in n]
    assert "spark_hvd/estimators/torch_estimator.py" in names
    # what spark_hvd.tensorflow compiles its kernels from, on first use
    for source in ("tensorflow/kernels/kernels.cc", "tensorflow/kernels/ops.h",
                   "include/spark_hvd/c_api.h"):
        assert f"spark_hvd/{source}" in names, source

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=600)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    # This venv's packages (and the ones it sees through its own .pth lines) for the deps.
    deps = [sysconfig.get_paths()["purelib"]] + [p for p in sys.path if p.endswith(
        "site-packages") and p != sysconfig.get_paths()["purelib"]]
    Path(site.stdout.strip(), "zz_deps.pth").write_text("\n".join(deps) + "\n")

    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH") and
           not k.startswith(("SPARK_HVD_", "PYSPARK_", "HOROVOD_"))}
    env["PATH"] = _no_compiler_path(tmp_path, venv / "bin")
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    work = tmp_path / "work"
    work.mkdir()
    (work / "check_rank.py").write_text(CHECK_RANK)
    outputs = []
    for backend in ("tcp", "gloo"):
        proc = subprocess.run(["spark-hvdrun", "-np", "2", "python", "check_rank.py"],
                              env=dict(env, SPARK_HVD_CPU_OPERATIONS=backend), cwd=work,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outputs.append(proc.stdout)
    out = "".join(outputs)
    installed = str(venv)
    for backend in ("tcp", "gloo"):
        for rank in (0, 1):
            line = [ln for ln in out.splitlines() if ln.startswith(f"[{rank}] allreduce ok "
                                                                   f"{backend} from ")]
            assert line and line[0].split(" from ")[1].startswith(installed), out
    built = {ln.split("] ", 1)[1] for ln in out.splitlines() if "] built " in ln}
    if any(Path(p, "nvidia").is_dir() for p in deps):  # a CUDA build of torch brings NCCL
        assert all(b.startswith("built gloo True mpi False ") for b in built), built
    else:
        assert built == {"built gloo True mpi False nccl False cuda False"}, built

    (work / "fit.py").write_text(FIT)
    proc = subprocess.run([str(python), "fit.py", *COMPILERS], env=env, cwd=work,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "COMPILERS []" in lines, proc.stdout
    assert [ln for ln in lines if ln.startswith("SPARK_HVD ")][0].split()[1].startswith(installed)
    assert "TRANSFORMED 64" in lines, proc.stdout[-3000:]
