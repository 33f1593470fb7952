#!/usr/bin/env bash
# One device call (<= 120 s on an H200) for the batch step's bf16 linears (issue 13, small-M):
#   1. tests/gpu/test_batch_kernels.py: the batch GEMV (base, linear_gemvm) and its shared-x /
#      split-K variant (linear_gemvs) against NumPy in float64, NaN-poisoned outputs, the split
#      variant launched twice (its counters reset), and the row top-k;
#   2. bench_smallm.py: each 8B linear (qkv, o, gate/up, down) at 8/16/32/64 rows for base and
#      each variant, us per launch and TB/s against the copy rate measured in the same run, then
#      a 32-layer chain of a layer's four linears as one graph (base, each variant, the per-shape
#      best). Table last; results under $OUT/smallm/ (table.md, results.json, the logs).
# Here (the build box), in the repo root:
#   bash docs/benchmarks/smallm_check.sh prebuild   (.whl: hipc; .work/smallm-fatbins: code objects)
# On the GPU machine: bash docs/benchmarks/smallm_check.sh
#   bash docs/benchmarks/smallm_check.sh step   (second call, after the defaults were chosen from the
#   first: tests/gpu/test_batch_gpu.py (through the engine), then bench_batch_gemv.py's 2-layer 8B step at
#   1-64 rows, session 7's batch GEMV defaults (gemv8) against the new ones (gemv), profiled)
set -uo pipefail
FATBINS=.work/smallm-fatbins
if [ "${1:-}" = prebuild ]; then
  set -e
  rm -rf .whl "$FATBINS"
  mkdir -p .whl "$FATBINS"
  pip wheel -q --no-deps -w .whl .
  PYTHONPATH=tests:tests/gpu python3 - <<'EOF'
from pathlib import Path

import test_batch_kernels as t
from gpu_kernels import compiled, kernels_source

compiled(kernels_source(t.kernel_specs("sm_90", {}), "sm_90"), "sm_90", Path(".work/smallm-fatbins"))
EOF
  python3 docs/benchmarks/bench_smallm.py --prebuild sm_90 --cache "$FATBINS"
  du -sh .whl "$FATBINS"
  exit 0
fi

OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/smallm"
source docs/benchmarks/install_wheels.sh .whl
export HIPC_KERNEL_CACHE=$PWD/$FATBINS
t0=$(date +%s)
nvidia-smi -L
if [ "${1:-}" = step ]; then
  for f in test_batch_gpu; do  # (test_batch_kernels: the first mode)
    echo "== tests/gpu/$f.py"
    timeout 45 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs tests/gpu/$f.py 2>&1 \
      | tail -15 | tee "$OUT/smallm/$f.log"
    echo "($(($(date +%s) - t0)) s)"
  done
  echo "== bench_batch_gemv.py"
  timeout $((118 - ($(date +%s) - t0))) python3 docs/benchmarks/bench_batch_gemv.py --layers 2 \
    --rows 1 8 16 32 64 --steps 15 --variants gemv8 gemv --profile 32 64 2>&1 | tee "$OUT/smallm/step.log"
  echo "($(($(date +%s) - t0)) s)"
  exit 0
fi
echo "== tests/gpu/test_batch_kernels.py"
timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs tests/gpu/test_batch_kernels.py 2>&1 \
  | tail -25 | tee "$OUT/smallm/tests.log"
echo "($(($(date +%s) - t0)) s)"
echo "== bench_smallm.py"
timeout $((115 - ($(date +%s) - t0))) python3 docs/benchmarks/bench_smallm.py --cache "$FATBINS" \
  --out "$OUT/smallm" 2>&1 | tee "$OUT/smallm/bench.log" | grep -v "^#"
echo "($(($(date +%s) - t0)) s)"
