#!/usr/bin/env bash
# One device call for issue 10's gaps (helper moegaps): OLMoE's clip_qkv in the GPU attention
# kernels (decode and prefill kernels alone vs NumPy, NaN-poisoned), then compiled OLMoE with
# clip_qkv end to end against the reference (<= 2e-3, greedy 32 equal).
#   bash docs/benchmarks/moegaps_check.sh WHL      (WHL: hipc's wheel + the runtime wheels)
# Everything goes to $OUT/moegaps/moegaps.log; a summary table is printed last.
set -uo pipefail
OUT=${OUT:-/tmp/out}
LOG="$OUT/moegaps/moegaps.log"
mkdir -p "$OUT/moegaps"
source docs/benchmarks/install_wheels.sh "$1"
nvidia-smi -L | tee -a "$LOG"
rows=()
# one process each: a kernel that faults leaves its CUDA context unusable for the rest
# CAP: seconds per test process (3 of them)
for t in "tests/gpu/test_decode_kernels.py clip" "tests/gpu/test_prefill_attention.py clip" \
  "tests/gpu/test_compiled_moe_gpu.py clip"; do
  start=$(date +%s)
  res=$(timeout "${CAP:-30}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE "${t%% *}" -k "${t#* }" 2>&1 | tee -a "$LOG" | tail -1)
  rows+=("| ${t} | ${res} | $(($(date +%s) - start)) s |")
done
{
  echo "| tests (-k) | result | wall |"
  echo "|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee -a "$LOG"
