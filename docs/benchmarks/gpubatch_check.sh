#!/usr/bin/env bash
# One short device call for GPU batching (issue 13): the paged attention kernels against NumPy
# (decode, SIMT and flash prefill with rows of several sequences over scattered blocks), the
# BatchEngine on the GPU (every sequence of a batch as it runs alone, buckets, cancellation),
# one compiled family against the reference, the GPU server (8 concurrent requests batching),
# then step times by batch rows at the Llama-3-8B layer shapes (2 layers). <= 90 s on an H200.
#   bash docs/benchmarks/gpubatch_check.sh WHEEL_DIR      # results under $OUT/gpubatch/
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
run kernels 25 tests/gpu/test_prefill_attention.py tests/gpu/test_decode_kernels.py -k "attention"
run batch 25 tests/gpu/test_batch_gpu.py tests/gpu/test_compiled_gpu.py -k "batch or family_on_gpu and llama"
run server 18 tests/server/test_server_gpu.py -k "concurrent or matches_the_gpu_engine"
# step times by rows at the Llama-3-8B layer shapes (2 layers: the batched GEMMs' cost at small M)
timeout 28 python3 docs/benchmarks/bench_batch_step.py --gpu-shape l8 --layers 2 \
  --rows 1 2 8 32 64 --steps 20 2>&1 | tail -12 | tee "$OUT/steps.log"
for f in kernels batch server; do grep -E "FAILED|Error|error" "$OUT/$f.log" | head -8; done
