#!/usr/bin/env bash
# One short device call (<= 90 s on an H200) for the fused MoE routing (norm + router GEMV +
# top-k in one decode kernel) and the quantized experts' prefill on the matrix instructions:
# the Q4_0-GGUF end-to-end test on the GPU (decode and prefill vs the reference executor),
# then the 8-layer Qwen3-30B-A3B-shape Q4_0 bench with the per-kernel decode profile, then
# the attention linears' GEMV geometries at this shape (code objects built here:
# bench_gpu_gemv.py --prebuild FATBINS --shapes q3moe_qkv,q3moe_o).
#   bash docs/benchmarks/moefast_check.sh WHEEL_DIR [FATBINS]   # results under $OUT/moefast/
set -uo pipefail
OUT=${OUT:-/tmp/out}/moefast
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh "$1"
timeout 25 python3 -m pytest -q -p no:cacheprovider -m gpu -rf -x \
  tests/gpu/test_compiled_moe_gpu.py -k "Q4_0" 2>&1 | tail -15 | tee "$OUT/tests.log"
timeout 55 python3 docs/benchmarks/bench_gpu_moe.py --models qwen3 --layers qwen3=8 --repeats 2 \
  --profile --out "$OUT/moe.md" 2>&1 | tail -70 | tee "$OUT/bench.log"
[ -n "${2:-}" ] && timeout 8 python3 docs/benchmarks/bench_gpu_gemv.py --cache "$2" \
  --shapes q3moe_qkv,q3moe_o --no-attention --out "$OUT/gemv.md" 2>&1 | tail -8
