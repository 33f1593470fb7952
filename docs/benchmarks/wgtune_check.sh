#!/usr/bin/env bash
# One short device call for the sm_90a wgmma GEMM's variants (issue 14): bench_gpu_gemm.py at the
# Llama-3-8B layer shapes, 512 and 4096 tokens, every tile and cluster variant (checked against
# torch on poisoned outputs, a second run compared bit for bit), beside cuBLAS; then
# tests/gpu/test_prefill_gemm.py (every variant against NumPy, the K split's determinism).
# <= 90 s on an H200. The bench's rows are logged as they are measured (bench.log), so a variant
# that hangs still leaves the rows before it.
#   bash docs/benchmarks/wgtune_check.sh WHEEL_DIR      # results under $OUT/wgtune/
set -uo pipefail
OUT=${OUT:-/tmp/out}/wgtune
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh "$1"
nvidia-smi -L
timeout 38 python3 docs/benchmarks/bench_gpu_gemm.py --out "$OUT/gemm.md" 2>&1 | tee "$OUT/bench.log" | tail -2
timeout 48 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_prefill_gemm.py 2>&1 \
  | tail -30 > "$OUT/tests.log"
tail -30 "$OUT/tests.log"
grep "^|" "$OUT/bench.log"
