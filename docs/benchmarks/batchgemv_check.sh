#!/usr/bin/env bash
# One device call (<= 150 s on an H200) for batched GPU decode (issue 13):
#   1. tests/gpu/test_batch_kernels.py: the weights-once batch GEMV (linear_gemvm, every size
#      class of rows, odd rows/outputs/K, every epilogue) and the row top-k (128k vocabulary,
#      ties, masked rows) against NumPy, NaN-poisoned;
#   2. tests/gpu/test_batch_gpu.py: every sequence of a batch as it runs alone (bf16 policy:
#      the batch GEMV; split policy: the GEMMs), buckets, cancellation, prefix hits;
#   3. bench_batch_kernels.py: the batch GEMV alone at the 8B linear shapes, TB/s by rows and
#      geometry (warps, chunks in flight) beside the copy rate;
#   4. bench_batch_gemv.py: 2-layer Llama-3-8B shape step times at 1..64 rows, the prefill
#      GEMMs and one-head attention (before) against the batch GEMV up to 8 rows and the grouped
#      attention (after) and the GEMV up to 32 rows with x a batch ahead (gemv32x), logits
#      copied back against step_top k=1, gemv32x's batch graph profiled at 8 and 32 rows.
#      Table last.
# Here (the build box), in the repo root:
#   bash docs/benchmarks/batchgemv_check.sh prebuild   (.whl: hipc; .work/fatbins: test code objects)
# On the GPU machine: bash docs/benchmarks/batchgemv_check.sh   (everything on stdout)
set -uo pipefail
if [ "${1:-}" = prebuild ]; then
  set -e
  mkdir -p .whl .work/fatbins
  rm -f .whl/hipc_compiler-*.whl
  pip wheel -q --no-deps -w .whl .
  PYTHONPATH=tests:tests/gpu python3 - <<'EOF'
from pathlib import Path

import test_batch_kernels as t
from gpu_kernels import compiled, kernels_source
from hipc.compiler.codegen.hip import TOPK_KERNEL
from hipc.compiler.kernels.linear import batch_gemv
from hipc.compiler.targets import GpuTarget

target = GpuTarget("sm_90")
specs = [(TOPK_KERNEL, "topk", {"max_k": t.TOPK_MAX, "wave": 32}, 0)]
for i, (name, case) in enumerate(t.CASES.items()):
    k = batch_gemv(f"b{i}", t._params(case), target, [name], case[1])
    specs.append((k.fn, k.template, k.ctx, 0))
compiled(kernels_source(specs, "sm_90"), "sm_90", Path(".work/fatbins"))
EOF
  python3 docs/benchmarks/bench_batch_kernels.py --prebuild sm_90 --cache .work/fatbins
  ls .whl .work/fatbins
  exit 0
fi

source docs/benchmarks/install_wheels.sh .whl
export HIPC_KERNEL_CACHE=$PWD/.work/fatbins
t0=$(date +%s)
nvidia-smi -L
run() {  # name, seconds, pytest args...
  local name=$1 secs=$2
  shift 2
  echo "== $name: $*"
  timeout "$secs" python3 -m pytest -q -p no:cacheprovider -m gpu -rfs "$@" 2>&1 | tail -25
  echo "($(($(date +%s) - t0)) s)"
}
run kernels 20 tests/gpu/test_batch_kernels.py
run batch 30 tests/gpu/test_batch_gpu.py
echo "== bench_batch_kernels.py (the batch GEMV alone, by rows and geometry)"
timeout 25 python3 docs/benchmarks/bench_batch_kernels.py --cache .work/fatbins 2>&1 | grep -v "^#"
echo "($(($(date +%s) - t0)) s)"
echo "== bench_batch_gemv.py"
timeout 80 python3 docs/benchmarks/bench_batch_gemv.py --layers 2 --rows 1 2 4 8 16 32 64 \
  --steps 15 --variants gemm gemv gemv32x --profile 8 32 2>&1
echo "($(($(date +%s) - t0)) s)"
