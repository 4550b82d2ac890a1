"""The NCCL backend against the real CUDA runtime and NCCL, as the nvidia-* wheels ship
them (no GPU needed). The fakes of this folder implement csrc/backends/cuda/api.h, so
they cannot tell whether api.h itself matches the libraries; this file can:

* api.h's declarations and constants against the real headers of CUDA 12 and CUDA 13
  (real_abi_check.cc, compiled only), and a proof that the check catches a mismatch;
* the loader on the real libraries: found in the wheels' own folders by the default
  search, every symbol bound (a missing one is an error naming it);
* real NCCL driven by the backend on a machine with no GPU: every rank's first GPU op
  fails at once with NCCL's own "unhandled cuda error" as InternalError (a CUDA problem
  on the rank, not a lost peer), and the job then shuts down cleanly.

`make test` installs the wheels under .venv/nvidia-libs (SHVD_NVIDIA_LIBS overrides);
without them these tests fail, naming the command that installs them.
"""

import json
import os
import subprocess

import pytest

from _ranks import PYTHON, script_job
from fakes.build import CSRC, CXX, ROOT, cached_fakes, fake_env

pytestmark = pytest.mark.nccl

LIBS = os.environ.get("SHVD_NVIDIA_LIBS", os.path.join(ROOT, ".venv", "nvidia-libs"))
CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_abi_check.cc")
API_H = os.path.join(CSRC, "backends", "cuda", "api.h")
DEADLINE_S = 10.0

# Per CUDA major version: where the wheels put the runtime's headers (crt/ and nv/ come
# from the nvcc/crt and cccl wheels) and the libraries. NCCL's header is the same for both.
LAYOUTS = {
    "cu12": {"include": ["nvidia/cuda_runtime/include", "nvidia/cuda_nvcc/include",
                         "nvidia/cuda_cccl/include"],
             "cudart": "nvidia/cuda_runtime/lib/libcudart.so.12"},
    "cu13": {"include": ["nvidia/cu13/include"],
             "cudart": "nvidia/cu13/lib/libcudart.so.13"},
}
NCCL_INCLUDE = os.path.join(LIBS, "cu13", "nvidia", "nccl", "include")
LIBNCCL = os.path.join(LIBS, "cu13", "nvidia", "nccl", "lib", "libnccl.so.2")


@pytest.fixture(scope="module")
def libs() -> str:
    need = [LIBNCCL, NCCL_INCLUDE] + [os.path.join(LIBS, v, LAYOUTS[v]["cudart"])
                                     for v in LAYOUTS]
    missing = [p for p in need if not os.path.exists(p)]
    if missing:
        pytest.fail(f"the nvidia-* wheels are not installed under {LIBS} (missing "
                    f"{missing[0]}): run `make test`, which installs them, or set "
                    "SHVD_NVIDIA_LIBS to a folder laid out the same way")
    return LIBS


def _syntax_check(version: str, part: str, api_dir: str = CSRC) -> subprocess.CompletedProcess:
    includes = [os.path.join(LIBS, version, d) for d in LAYOUTS[version]["include"]]
    argv = [CXX, "-std=c++17", "-fsyntax-only", f"-DSHVD_CHECK_{part}", "-I", api_dir]
    for d in [*includes, NCCL_INCLUDE]:
        argv += ["-I", d]
    return subprocess.run([*argv, CHECK], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("part", ["CUDA", "NCCL"])
@pytest.mark.parametrize("version", sorted(LAYOUTS))
def test_api_h_matches_the_real_headers(libs, version, part):
    res = _syntax_check(version, part)
    assert res.returncode == 0, res.stderr[-4000:]


def test_the_header_check_catches_a_mismatch(libs, tmp_path):
    """A copy of api.h with one wrong constant and one wrong parameter type must fail the
    check, naming both (so the passing checks above mean something)."""
    text = open(API_H).read()
    wrong = text.replace("ncclBfloat16 = 9;", "ncclBfloat16 = 10;").replace(
        "const void* src, size_t bytes,", "const void* src, int bytes,")
    assert wrong.count("ncclBfloat16 = 10;") == 1 and "int bytes," in wrong
    target = tmp_path / "backends" / "cuda"
    target.mkdir(parents=True)
    (target / "api.h").write_text(wrong)
    cuda = _syntax_check("cu13", "CUDA", str(tmp_path))
    assert cuda.returncode != 0
    assert "cudaMemcpyAsync in api.h differs from the real header" in cuda.stderr, cuda.stderr
    nccl = _syntax_check("cu13", "NCCL", str(tmp_path))
    assert nccl.returncode != 0
    assert "ncclBfloat16 in api.h has another value" in nccl.stderr, nccl.stderr


PROBE = r'''
import json, spark_hvd as hvd
from spark_hvd import _core
print("RESULT " + json.dumps({"cuda_built": hvd.cuda_built(), "nccl_built": hvd.nccl_built(),
                              "why": _core.nccl_unavailable_reason()}))
'''


def _probe(env_extra: dict, pythonpath: str = "") -> tuple:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_HVD_CUDA_LIBRARY", "SPARK_HVD_NCCL_LIBRARY")}
    env.update(env_extra, SPARK_HVD_LOG_LEVEL="debug",
               PYTHONPATH=os.pathsep.join(p for p in (pythonpath, ROOT) if p))
    res = subprocess.run([PYTHON, "-c", PROBE], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), res.stderr


@pytest.mark.parametrize("version", sorted(LAYOUTS))
def test_the_default_search_loads_the_wheels_cuda_runtime(libs, version):
    """With the wheels importable (as a GPU build of PyTorch installs them) and no override,
    the core loads their libcudart and binds every symbol it uses; with no GPU here, it then
    reports that the runtime sees none."""
    root = os.path.join(libs, version)
    found, log = _probe({}, pythonpath=root)
    assert found["cuda_built"] is False and found["nccl_built"] is False
    assert found["why"] == "CUDA runtime: the CUDA runtime loaded but sees no GPU", (found, log)
    wheel_dir = os.path.join(root, os.path.dirname(LAYOUTS[version]["cudart"]))
    assert f"loaded {wheel_dir}/" in log, log
    # Without the wheels on the path, that folder is not searched (the machine's own
    # runtime, if it has one, is found on the system's search path instead).
    _, log = _probe({})
    assert wheel_dir not in log, log


def test_the_override_names_the_real_runtime(libs):
    cudart = os.path.join(libs, "cu12", LAYOUTS["cu12"]["cudart"])
    found, log = _probe({"SPARK_HVD_CUDA_LIBRARY": cudart})
    assert found["why"] == "CUDA runtime: the CUDA runtime loaded but sees no GPU", (found, log)
    assert f"loaded {cudart}" in log
    # A library that is not the CUDA runtime: the first symbol it lacks is named.
    wrong, _ = _probe({"SPARK_HVD_CUDA_LIBRARY": LIBNCCL})
    assert wrong["why"] == "CUDA runtime: missing symbol cudaGetDeviceCount", wrong


REAL_NCCL_SCRIPT = r'''
import json, os, sys, time
multiproc = os.environ["SHVD_TESTS_MULTIPROC"]
sys.path[:0] = [multiproc, os.path.dirname(multiproc)]
import numpy as np
import spark_hvd as hvd
import cases_nccl as g

out = sys.argv[1]
res = {"nccl_built": hvd.nccl_built()}
hvd.init()
me = hvd.rank()
started = time.time()
try:
    hvd.synchronize(g.allreduce_async(np.ones(1024, np.float32), "first"))
    res["error"] = None
except Exception as e:
    res.update(error=type(e).__name__, message=str(e),
               horovod_internal=isinstance(e, hvd.HorovodInternalError))
res["seconds"] = time.time() - started
hvd.shutdown()
res["shut_down"] = True
with open(os.path.join(out, f"result{me}"), "w") as f:
    json.dump(res, f)
'''


def test_real_nccl_without_a_gpu_fails_every_rank_at_once(libs, tmp_path):
    """Real libnccl, bound by the loader (the fake CUDA runtime tells the backend there is
    a GPU; NCCL's own CUDA finds no driver): ncclGetUniqueId works, ncclCommInitRank fails,
    and each rank's op raises InternalError with NCCL's message within seconds."""
    multiproc = os.path.join(ROOT, "tests", "multiproc")
    env = dict(fake_env(cached_fakes(), devices=2), SPARK_HVD_NCCL_LIBRARY=LIBNCCL,
               SHVD_TESTS_MULTIPROC=multiproc)
    with script_job(2, REAL_NCCL_SCRIPT, tmp_path, env, DEADLINE_S + 30) as (codes, logs):
        assert list(codes) == [0, 0], (codes, logs)
    for r in range(2):
        res = json.loads((tmp_path / f"result{r}").read_text())
        print(f"rank {r}: {res}")
        assert res["nccl_built"] is True, res
        assert res["error"] == "InternalError" and res["horovod_internal"], (res, logs)
        assert "ncclCommInitRank" in res["message"], res
        assert "unhandled cuda error" in res["message"], res
        assert f"rank {r}" in res["message"], res
        assert res["seconds"] < DEADLINE_S, res
        assert res["shut_down"], res
