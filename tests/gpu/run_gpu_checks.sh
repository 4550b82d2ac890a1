#!/usr/bin/env bash
# GPU checks on a machine with one NVIDIA GPU and nothing downloadable: builds the
# extension in place, then runs tests/gpu/gpu_checks.py on one rank (NCCL) and prints
# one line per check: every op x dtype on CUDA tensors, fusion and scale factors, grouped
# ops and a process set, the op waiting for the stream that produced its input (a side
# stream, and torch's default stream, handle 0) behind ~0.1 s of matmuls, compression,
# SyncBatchNorm, optimizer state, Adasum (host staged), DistributedOptimizer gradients
# against the average of each rank's local gradients, a Lightning fit with HorovodStrategy
# (when lightning imports) and the single-GPU step overhead against plain torch. Needs a
# Python with torch (a CUDA build), numpy, pybind11, cmake and a C++ compiler; set PYTHON
# to choose it. Under 10 minutes. Dry-run (no GPU:
# every GPU part says SKIP) in a venv with only those packages, 2026-12-02.
#
# Then: the same checks on one rank with NCCL kept from loading (staged through host
# memory, as on a machine with the CUDA runtime but no NCCL) and as two ranks sharing the
# GPU (staged too: NCCL refuses two ranks on one device), an elastic job on the GPU that
# loses a worker, and TorchEstimator(use_gpu=True) on local-cluster Spark (skipped
# without pyspark and java).
#
# With one GPU, NCCL runs with one rank only: the 2-rank runs are staged through host
# memory over tcp (SPARK_HVD_GPU_OPERATIONS=tcp), so multi-rank NCCL is not exercised on
# such a machine (tests/fakes checks the NCCL backend's logic against fake libraries).
# The 2-rank runs need the GPU in the Default compute mode (logged below as INFO).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
echo "== build"
if ! "$PY" setup.py build_ext --inplace > /tmp/shvd_gpu_build.log 2>&1; then
  echo "FAIL build (see /tmp/shvd_gpu_build.log)"; tail -20 /tmp/shvd_gpu_build.log; exit 1
fi
echo "PASS build"
if command -v nvidia-smi > /dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 \
    | sed 's/^/INFO gpu /'
  nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>&1 \
    | sed 's/^/INFO gpu compute_mode /'
else
  echo "INFO gpu nvidia-smi not found (no name, driver or compute mode to log)"
fi
ONE_GPU_NOTE="with one GPU, NCCL runs with one rank only; the 2-rank runs are staged \
through host memory over tcp, so multi-rank NCCL is not exercised by this machine"
echo "INFO $ONE_GPU_NOTE"
echo "== checks, 1 rank"
PYTHONPATH=. timeout 300 "$PY" tests/gpu/gpu_checks.py
status=$?
echo "== checks, 1 rank, NCCL kept from loading (staged through host memory)"
SPARK_HVD_NCCL_LIBRARY=/nonexistent/libnccl.so.2 SHVD_GPU_EXPECT_NCCL=0 PYTHONPATH=. \
  timeout 300 "$PY" tests/gpu/gpu_checks.py || status=1
echo "== checks, 2 ranks sharing the GPU (staged)"
SPARK_HVD_GPU_OPERATIONS=tcp PYTHONPATH=. timeout 300 "$PY" -m spark_hvd.runner -np 2 \
  "$PY" tests/gpu/gpu_checks.py || status=1
echo "== elastic job on the GPU, one worker lost"
SPARK_HVD_GPU_OPERATIONS=tcp PYTHONPATH=. timeout 120 "$PY" -m spark_hvd.runner -np 2 \
  --min-np 1 --blacklist-cooldown-range 300 300 "$PY" tests/gpu/elastic_gpu.py 2>&1 \
  | grep -E "PASS|FAIL|SKIP|elastic: epoch" || status=1
echo "== TorchEstimator(use_gpu=True) on local-cluster Spark"
PYTHONPATH=. timeout 300 "$PY" tests/gpu/estimator_gpu.py 2>&1 | grep -E "^(PASS|FAIL|SKIP)" \
  || status=1
echo "== fake-library tests of the NCCL backend (the same as CI)"
PYTHONPATH=. timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/fakes \
  tests/multiproc/test_mp_nccl.py --ignore=tests/fakes/test_real_nvidia_libraries.py 2>&1 | tail -3
echo "== summary"
echo "INFO exit status $status (1: a FAIL in the checks or a run that printed nothing)"
echo "NOTE $ONE_GPU_NOTE"
exit $status
