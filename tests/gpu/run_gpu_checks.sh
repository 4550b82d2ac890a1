#!/usr/bin/env bash
# GPU checks on a machine with one NVIDIA GPU and nothing downloadable: builds the
# extension in place, then runs tests/gpu/gpu_checks.py on one rank (NCCL) and prints
# one line per check. Needs a Python with torch (a CUDA build), numpy, pybind11, cmake
# and a C++ compiler; set PYTHON to choose it. Under 10 minutes.
#
# Not covered yet (the NCCL issue's remaining parts): two ranks sharing one GPU through
# host staging, and TorchEstimator(use_gpu=True) on local-cluster Spark.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
echo "== build"
if ! "$PY" setup.py build_ext --inplace > /tmp/shvd_gpu_build.log 2>&1; then
  echo "FAIL build (see /tmp/shvd_gpu_build.log)"; tail -20 /tmp/shvd_gpu_build.log; exit 1
fi
echo "PASS build"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
  | sed 's/^/INFO gpu /'
echo "== checks, 1 rank"
PYTHONPATH=. timeout 300 "$PY" tests/gpu/gpu_checks.py
status=$?
echo "== fake-library tests of the NCCL backend (the same as CI)"
PYTHONPATH=. timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/fakes \
  tests/multiproc/test_mp_nccl.py 2>&1 | tail -3
exit $status
