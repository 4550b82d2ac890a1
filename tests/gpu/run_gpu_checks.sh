#!/usr/bin/env bash
# The GPU checks, in one run of at most 8 minutes on a machine with one NVIDIA GPU (an H200
# in mind), build included. CI has no GPU: it runs the GPU backends' op matrix, the fake
# libraries' own tests and the Spark estimator through tests/fakes; this script checks what
# only a real GPU, torch and NCCL show (docs/gpus.md lists both).
#
#   PYTHON=python3 OUT=/some/dir tests/gpu/run_gpu_checks.sh
#
# Needs a Python with a CUDA build of torch, numpy, pybind11, cmake and a C++ compiler;
# nothing is downloaded. Prints one line per check (PASS, FAIL, or SKIP for what it did not
# check: never PASS) and TIME per part; with OUT set, each part's full log and a summary
# (summary.txt, the same lines) go there. Exit status: 0 when nothing failed (or no GPU is
# present: every part SKIP), 1 when a check or a part failed or timed out, a check of a
# part never reported (FAIL ... did not report), or when
# nvidia-smi sees a GPU that torch cannot use (a CPU build of torch, a driver mismatch).
#
# Parts (limits add up to 7.5 minutes):
# 1. build (180 s): the extension, in place.
# 2. one rank on NCCL (150 s), NCCL_DEBUG=WARN: gpu_checks.py, every check (values of
#    every op on f16/bf16/f32/f64/int, prescale 2.0 alone through ncclRedOpCreatePreMulSum,
#    integer Average, 200 allgathers and the free memory back at its baseline, an op done
#    while a 0.2 s matmul chain queued after its submit still runs, inputs dropped and
#    their memory reallocated while in flight, the global set and a process set in flight
#    together, producer streams, the loaded libcudart and libnccl being torch's, the step
#    time against plain torch beside its goal of 1.03x); any "NCCL WARN" line fails it.
# 3. two ranks sharing the GPU (90 s), staged through host memory over tcp (NCCL refuses
#    two ranks on one GPU): the same checks, the averaged gradients of a
#    DistributedOptimizer. With one GPU, NCCL runs with one rank only; multi-rank NCCL is
#    checked against tests/fakes in CI.
# 4. a stalled producer (45 s): an op whose input's stream hangs, with SPARK_HVD_TIMEOUT_S=3,
#    ends in CollectiveTimeoutError and a clean shutdown.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DIR=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/shvd_gpu_checks.XXXXXX")}
mkdir -p "$DIR"
SUMMARY="$DIR/summary.txt"
: > "$SUMMARY"
status=0
LINE='^(\[[0-9]+\] )?'  # a check line, with spark-hvdrun's "[rank] " prefix or not

say() { echo "$*" | tee -a "$SUMMARY"; }

# The checks gpu_checks.py defines (@check("name")): the stalled producer runs alone in
# its part, every other check in each of the two other parts.
ALL_CHECKS=$(grep -oE '@check\("[a-z_0-9]+"\)' tests/gpu/gpu_checks.py | sed -E 's/@check\("(.*)"\)/\1/')
STALL_CHECK=stalled_producer_times_out_and_shuts_down
MAIN_CHECKS=$(echo "$ALL_CHECKS" | grep -vx "$STALL_CHECK")

# part NAME LIMIT_S EXPECTED CMD...: runs CMD with its output in $DIR/NAME.log; prints its
# check lines and its time; fails the run on a FAIL line, a non-zero exit, a timeout (TERM,
# then KILL 10 s later; 10 s before it, gpu_checks.py dumps its threads' stacks into the
# log), no check line at all, or a check of EXPECTED (names, one a line) that printed no
# PASS, FAIL or SKIP line (the part crashed or hung before it): nothing passes unseen.
part() {
  local name=$1 limit=$2 expected=$3
  shift 3
  local log="$DIR/$name.log" start=$SECONDS rc c
  say "== $name (limit ${limit} s)"
  SHVD_GPU_DUMP_AFTER_S=$((limit - 10)) timeout -k 10 "$limit" "$@" > "$log" 2>&1
  rc=$?
  grep -E "$LINE(PASS|FAIL|SKIP|INFO) " "$log" | tee -a "$SUMMARY"
  for c in $expected; do
    grep -qE "$LINE(PASS|FAIL|SKIP) $c( |\$)" "$log" || say "FAIL $c did not report in $name (the part ended before it: see $log)"
  done
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "FAIL $name timed out after $limit s (see $log)"
  elif [ "$rc" -ne 0 ] || grep -qE "${LINE}FAIL " "$log"; then
    grep -qE "${LINE}FAIL " "$log" || { say "FAIL $name exited $rc (see $log)"; tail -15 "$log"; }
  elif ! grep -qE "$LINE(PASS|SKIP) " "$log"; then
    rc=1
    say "FAIL $name printed no check (see $log)"
  fi
  [ "$rc" -eq 0 ] && ! grep -qE "FAIL " <(grep -vF "INFO" "$SUMMARY") || status=1
  say "TIME $name $((SECONDS - start)) s"
}

skip_all() {
  for p in build nccl_1_rank staged_2_ranks stalled_producer; do say "SKIP $p $1"; done
}

# -- is there a GPU, and can torch use it? ------------------------------------------------
gpus=0
if command -v nvidia-smi > /dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU ")
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader \
    2>&1 | sed 's/^/INFO gpu /' | tee -a "$SUMMARY"
fi
torch_sees=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0, torch.__version__, torch.version.cuda)" 2>&1 | tail -1)
say "INFO torch $torch_sees (CUDA devices, version, CUDA)"
if [ "$gpus" -eq 0 ]; then
  skip_all "no GPU here (nvidia-smi lists none)"
  say "INFO results in $DIR"
  exit 0
fi
if [ "${torch_sees%% *}" = "0" ] || ! [ "${torch_sees%% *}" -eq "${torch_sees%% *}" ] 2>/dev/null; then
  say "FAIL torch_sees_the_gpu nvidia-smi lists $gpus GPU(s) but torch cannot use one (torch $torch_sees: a CPU build of torch, or a driver older than its CUDA)"
  skip_all "torch cannot use the GPU"
  say "INFO results in $DIR"
  exit 1
fi

# -- the parts ------------------------------------------------------------------------------
part build 180 build bash -c "'$PY' setup.py build_ext --inplace && echo 'PASS build spark_hvd._core'"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
if [ $status -eq 0 ]; then
  part nccl_1_rank 150 "$MAIN_CHECKS" env NCCL_DEBUG=WARN "$PY" tests/gpu/gpu_checks.py
  if grep -q "NCCL WARN" "$DIR/nccl_1_rank.log"; then
    say "FAIL nccl_debug_warn NCCL warned (NCCL_DEBUG=WARN):"
    grep "NCCL WARN" "$DIR/nccl_1_rank.log" | head -5 | tee -a "$SUMMARY"
    status=1
  elif grep -q "^PASS libraries" "$DIR/nccl_1_rank.log"; then
    say "PASS nccl_debug_warn no NCCL WARN line with NCCL_DEBUG=WARN"
  else
    say "SKIP nccl_debug_warn NCCL did not run (see the checks above)"
  fi
  part staged_2_ranks 90 "$MAIN_CHECKS" env SPARK_HVD_GPU_OPERATIONS=tcp "$PY" -m spark_hvd.runner -np 2 \
    "$PY" tests/gpu/gpu_checks.py
  part stalled_producer 45 "$STALL_CHECK" env SPARK_HVD_TIMEOUT_S=3 "$PY" tests/gpu/gpu_checks.py --stall
else
  for p in nccl_1_rank staged_2_ranks stalled_producer; do say "SKIP $p the build failed"; done
fi
say "== summary: $(grep -cE "${LINE}PASS " "$SUMMARY") PASS, $(grep -cE "${LINE}FAIL " "$SUMMARY") FAIL, $(grep -cE "${LINE}SKIP " "$SUMMARY") SKIP in $SECONDS s; exit $status"
say "INFO results in $DIR"
exit $status
