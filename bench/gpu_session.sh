#!/bin/bash
# One GPU session's checks (issue 28), run once from the repository root on the device machine:
#   bash bench/gpu_session.sh                 # every stage, in this order
#   bash bench/gpu_session.sh gpu_tests bench_gpu   # only these
# Stages: setup (wheels from .whl/, see /work/shared/gpu/README.md), gpu_tests (pytest -m gpu),
# bench_gpu (python -m bench.gpu), kernels (python -m bench.kernels), e2e (the constrained-
# decoding and server end-to-end tests). Each runs under its own `timeout` (seconds below,
# overridable as T_<stage>=N; the defaults sum to under the 10 minutes one device command
# may take) and writes $OUT/logs/<stage>.log; $OUT/summary.txt gets one line per stage.
# A stage that fails or hangs is killed and the next one runs.
set -u
export OUT=${OUT:-$PWD/gpu_out} PY=${PY:-python3} PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUT/logs"

stage_setup() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  $PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  else
    echo "no .whl/ here: tests needing its packages will fail (bash ../shared/gpu/prepare.sh)"
  fi
}
# pytest_ TIMEOUT_ARGS ARGS...: pytest-timeout comes from .whl/ (its flags only where it is);
# a test module whose imports are missing fails alone.
pytest_() { $PY -m pytest -q -p no:cacheprovider --continue-on-collection-errors \
  $($PY -c 'import pytest_timeout' 2>/dev/null && echo "--timeout $1") "${@:2}"; }
stage_gpu_tests() { pytest_ 120 -m gpu tests; }
stage_bench_gpu() { $PY -m bench.gpu --out-dir "$OUT" ${BENCH_GPU_ARGS:-}; }
stage_kernels() { $PY -m bench.kernels; }
stage_e2e() {
  pytest_ 60 tests/server/test_e2e.py tests/server/test_tools_e2e.py \
    tests/server/test_tools_named_e2e.py; local rc=$?
  # Last: its constrained-decoding test hung on CUDA once; the thread method dumps the stacks.
  pytest_ "60 --timeout-method thread" tests/engine/test_grammar.py || rc=1
  return $rc
}

export -f pytest_ stage_setup stage_gpu_tests stage_bench_gpu stage_kernels stage_e2e
declare -A LIMIT=([setup]=45 [gpu_tests]=150 [bench_gpu]=240 [kernels]=40 [e2e]=90)
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(setup gpu_tests bench_gpu kernels e2e)
for s in "${STAGES[@]}"; do
  [ -n "${LIMIT[$s]:-}" ] || { echo "unknown stage $s" | tee -a "$OUT/summary.txt"; continue; }
  var="T_$s"; limit=${!var:-${LIMIT[$s]}}
  start=$(date +%s)
  # -k: a test that ignores SIGTERM (a hung CUDA call) is killed 10 s later.
  timeout -k 10 "$limit" bash -c "stage_$s" >"$OUT/logs/$s.log" 2>&1
  rc=$?
  note=""; [ $rc -eq 124 ] || [ $rc -eq 137 ] && note=" (timed out after ${limit}s)"
  echo "$s rc=$rc $(( $(date +%s) - start ))s$note" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/logs/$s.log"
done
