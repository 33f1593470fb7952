#!/usr/bin/env bash
# One short device call for GPU batching (issue 13). PART=tests (default): the paged attention
# kernels against NumPy (decode, SIMT and flash prefill with rows of several sequences over
# scattered blocks), the BatchEngine on the GPU (every sequence of a batch as it runs alone,
# buckets, cancellation, prefix hits), one compiled family against the reference, the GPU server
# (8 concurrent requests batching), then step times by batch rows at the Llama-3-8B layer
# shapes (2 layers). PART=bench: the server tests, step times with 8 layers (the per-layer cost
# by rows: subtract the 2-layer run), and bench_gpu_batching.py on 2 layers (the script the
# final call runs on all 32). Each part <= 90 s on an H200.
#   PART=tests|bench bash docs/benchmarks/gpubatch_check.sh WHEEL_DIR   # results under $OUT/gpubatch/
set -uo pipefail
OUT=${OUT:-/tmp/out}/gpubatch
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh "$1"
t0=$(date +%s)
run() {  # name, seconds, pytest args...
  local name=$1 secs=$2
  shift 2
  timeout "$secs" python3 -m pytest -q -p no:cacheprovider -m gpu -rf "$@" >"$OUT/$name.log" 2>&1
  echo "$name: rc=$? $(tail -1 "$OUT/$name.log") ($(($(date +%s) - t0)) s)"
}
steps() {  # layers, seconds, rows...
  local layers=$1 secs=$2
  shift 2
  timeout "$secs" python3 docs/benchmarks/bench_batch_step.py --gpu-shape l8 --layers "$layers" \
    --rows "$@" --steps 20 2>&1 | tail -8 | tee "$OUT/steps-$layers.log"
}
case "${PART:-tests}" in
tests)
  run kernels 25 tests/gpu/test_prefill_attention.py tests/gpu/test_decode_kernels.py -k "attention"
  run batch 25 tests/gpu/test_batch_gpu.py tests/gpu/test_compiled_gpu.py -k "batch or family_on_gpu and llama"
  run server 18 tests/server/test_server_gpu.py -k "concurrent or matches_the_gpu_engine"
  steps 2 28 1 2 8 32 64
  for f in kernels batch server; do grep -E "FAILED|Error|error" "$OUT/$f.log" | head -8; done
  ;;
bench)
  run server 22 tests/server/test_server_gpu.py
  steps 8 30 1 8 32 64
  timeout 40 python3 docs/benchmarks/bench_gpu_batching.py --shape l8 --layers 2 --clients 1 8 32 64 \
    --gen 64 --out "$OUT/batching-2.md" 2>&1 | tail -14
  grep -E "FAILED|Error|error" "$OUT/server.log" | head -8
  ;;
esac
