#!/usr/bin/env bash
# One device call for issue 10's gaps (helper moegaps): OLMoE's clip_qkv in the GPU attention
# kernels (decode and prefill kernels alone vs NumPy, NaN-poisoned), then compiled OLMoE with
# clip_qkv end to end against the reference (<= 2e-3, greedy 32 equal).
#   bash docs/benchmarks/moegaps_check.sh WHL      (WHL: hipc's wheel + the runtime wheels)
# One pytest process capped at $CAP seconds (default 55); everything goes to
# $OUT/moegaps/moegaps.log, a table of the selected tests' outcomes printed last.
set -uo pipefail
OUT=${OUT:-/tmp/out}
LOG="$OUT/moegaps/moegaps.log"
mkdir -p "$OUT/moegaps"
source docs/benchmarks/install_wheels.sh "$1"
nvidia-smi -L | tee -a "$LOG"
start=$(date +%s)
timeout "${CAP:-55}" python3 -m pytest -q -p no:cacheprovider -m gpu -rA --durations=5 \
  tests/gpu/test_decode_kernels.py tests/gpu/test_prefill_attention.py \
  tests/gpu/test_compiled_moe_gpu.py -k clip >"$OUT/moegaps/pytest.txt" 2>&1
rc=$?
cat "$OUT/moegaps/pytest.txt" >>"$LOG"
{
  echo "| test | outcome |"
  echo "|---|---|"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/moegaps/pytest.txt" |
    awk '{o=$1; $1=""; print "|" $0 " | " o " |"}'
  echo "pytest rc=$rc, wall $(($(date +%s) - start)) s: $(tail -1 "$OUT/moegaps/pytest.txt")"
} | tee -a "$LOG"
rm -f "$OUT/moegaps/pytest.txt"
