#!/usr/bin/env bash
# One short device call for the sm_90a wgmma GEMM's variants (issue 14), <= 90 s on an H200:
#   1. bench_gpu_gemm.py at the Llama-3-8B layer shapes, 512, 2048 (the default prefill chunk:
#      a 4,096-token prompt is two such steps) and 4096 tokens: every tile and
#      cluster variant (checked against torch on poisoned outputs, a second run compared bit for
#      bit), the _xb pass alone, cuBLAS beside them;
#   2. tests/gpu/test_prefill_gemm.py: every variant against NumPy on odd shapes, the K split's
#      determinism;
#   3. a whole tiny bf16 model against the reference (the GLU -> down bf16 hand-off, the
#      batched residual epilogue, inside a real plan).
# The code objects for 1 and 2 are built ahead on the build box (.kcache, keyed by source hash;
# a miss is built here). The bench's rows are logged as they are measured (bench.log), so a
# variant that hangs still leaves the rows before it.
#   bash docs/benchmarks/wgtune_check.sh WHEEL_DIR      # results under $OUT/wgtune/
set -uo pipefail
OUT=${OUT:-/tmp/out}/wgtune
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh "$1"
export HIPC_KERNEL_CACHE=$PWD/.kcache
nvidia-smi -L
timeout 35 python3 docs/benchmarks/bench_gpu_gemm.py --tokens 512,2048,4096 --cache .kcache \
  --out "$OUT/gemm.md" \
  > "$OUT/bench.log" 2>&1
timeout 25 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_prefill_gemm.py \
  > "$OUT/tests.log" 2>&1
timeout 28 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_compiled_gpu.py \
  -k "test_bf16_prefill_policy_on_gpu and llama" > "$OUT/e2e.log" 2>&1
tail -12 "$OUT/tests.log" "$OUT/e2e.log"
grep -v "^|" "$OUT/bench.log" | tail -5
grep "^|" "$OUT/bench.log"
