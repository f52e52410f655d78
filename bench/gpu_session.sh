#!/bin/bash
# One GPU session's checks (issues 28 and 42), run once from the repository root on the device
# machine, under 9 minutes in all:
#   bash bench/gpu_session.sh                       # every stage, in this order
#   bash bench/gpu_session.sh gpu_tests overlap     # only these
# Stages: setup (wheels from .whl/, see /work/shared/gpu/README.md); gpu_tests (pytest -m gpu:
# kernels, graphs, fused forward, fp8 calibration, tier streams, overlap == sync tokens, the
# NCCL timer); fp8 (the 8-bit KV tests and an fp8 engine on CUDA); tp (TP 2 == TP 1, or the
# clear refusal on one GPU); grammar (the constrained-decoding test that hung once: thread
# timeout dumps the stacks); e2e (the server end-to-end tests); overlap (bench.gpu one shape
# with and without --disable-overlap-schedule; bench.overhead on CUDA and with the simulated
# device); bench_gpu (the issue-28 table); kernels (python -m bench.kernels). Each runs under
# its own `timeout` (seconds below, overridable as T_<stage>=N) and writes
# $OUT/logs/<stage>.log; $OUT/summary.txt gets one line per stage. A stage that fails or hangs
# is killed and the next one runs.
set -u
export OUT=${OUT:-$PWD/gpu_out} PY=${PY:-python3} PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUT/logs"

stage_setup() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  $PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), torch.cuda.device_count())'
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
stage_gpu_tests() { pytest_ 90 -m gpu tests --deselect tests/engine/test_grammar.py; }
stage_fp8() {
  pytest_ 60 tests/attention/test_fp8_kv.py tests/engine/test_kv_cache_dtype.py \
    tests/engine/test_kv_calibration_fused.py tests/cache/tiers/test_fp8_tiers.py
}
stage_tp() { pytest_ 90 -m gpu tests/engine/test_tp_devices.py tests/engine/test_tp_completion.py -rs; }
stage_grammar() { pytest_ "60 --timeout-method thread" tests/engine/test_grammar.py; }
stage_e2e() {
  pytest_ 60 tests/server/test_e2e.py tests/server/test_tools_e2e.py \
    tests/server/test_tools_named_e2e.py tests/engine/test_overlap.py
}
stage_overlap() {
  $PY -m bench.gpu --models smollm2-135m --batches 1,64 --profile-batches 64 --no-hf \
    --no-overlap --out-dir "$OUT/overlap" || return 1
  $PY -m bench.overhead --device cuda --batches 1,64,256 --rounds 1
  $PY -m bench.overhead --simulated-device-ms 5 --rounds 1
}
stage_bench_gpu() { $PY -m bench.gpu --out-dir "$OUT" ${BENCH_GPU_ARGS:-}; }
stage_kernels() { $PY -m bench.kernels; }

export -f pytest_ stage_setup stage_gpu_tests stage_fp8 stage_tp stage_grammar stage_e2e \
  stage_overlap stage_bench_gpu stage_kernels
# Seconds per stage: 520 in all (each + 10 s grace only when killed), under the 9 minutes one session's script may take.
declare -A LIMIT=([setup]=30 [gpu_tests]=120 [fp8]=30 [tp]=30 [grammar]=45 [e2e]=60
                  [overlap]=70 [bench_gpu]=100 [kernels]=35)
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(setup gpu_tests fp8 tp grammar e2e overlap bench_gpu kernels)
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
