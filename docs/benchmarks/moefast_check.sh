#!/usr/bin/env bash
# One short device call (<= 90 s on an H200) for the fused MoE routing (norm + router GEMV +
# top-k in one decode kernel) and the quantized experts' prefill on the matrix instructions:
# the MoE kernels against NumPy on the GPU (tests/gpu/test_moe_kernels.py: the fused route,
# _up, _down with poisoned buffers; the grouped prefill, quantized experts on mma), then the
# 8-layer Qwen3-30B-A3B-shape Q4_0 bench with the per-kernel decode profile.
#   bash docs/benchmarks/moefast_check.sh WHEEL_DIR      # results under $OUT/moefast/
set -uo pipefail
OUT=${OUT:-/tmp/out}/moefast
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh "$1"
timeout 33 python3 -m pytest -q -p no:cacheprovider -m gpu -rf \
  tests/gpu/test_moe_kernels.py 2>&1 | tail -15 | tee "$OUT/tests.log"
timeout 55 python3 docs/benchmarks/bench_gpu_moe.py --models qwen3 --layers qwen3=8 --repeats 2 \
  --profile --out "$OUT/moe.md" 2>&1 | tail -70 | tee "$OUT/bench.log"
