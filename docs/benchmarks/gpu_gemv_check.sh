#!/usr/bin/env bash
# One device call (about 90 s): the quantized decode GEMVs at the Llama-3-8B shapes (int8
# activations), the kernel this branch started from ("base": its template in
# .work/base/) beside the current one and its candidate geometries, each alone and as
# 32-layer chains of a layer's four GEMVs; the copy and read ceilings; then the GEMV tests of
# tests/gpu (NaN-poisoned, against NumPy). Every code object is built here first.
#
# Here (the build box), in the repo root:
#   bash docs/benchmarks/gpu_gemv_check.sh prebuild BASE_COMMIT
#     (writes .whl/ (hipc, gguf), .work/base/linear_gemv_q.hip.j2 and .work/fatbins/)
# On the GPU machine, carrying .whl and .work:
#   bash docs/benchmarks/gpu_gemv_check.sh
# Writes $OUT/gemv/{tests.log,bench.log,gemv.md}.
set -uo pipefail
SHAPES=${SHAPES:-l8_qkv,l8_o,l8_gate_up,l8_down,l8_qkv_q4k,l8_qk_q4k,l8_v_q6k,l8_o_q4k,l8_gate_up_q4k,l8_down_q4k,l8_down_q6k}
VARIANTS=${VARIANTS:-default,base,lp,w8s3m2,w8s3m2lp,r1u4s3,k8r2s3k64m2,k16r2s3k64,k16r2s2k64,pick:lpdown,pick:m2lpdown}
BENCH=(docs/benchmarks/bench_gpu_gemv.py --baseline .work/base/linear_gemv_q.hip.j2
  --activations int8 --no-attention --shapes "$SHAPES" --variants "$VARIANTS")

prebuild_tests() {
  python3 - <<'EOF'
import sys
from pathlib import Path

sys.path[:0] = ["tests", "tests/gpu"]
import test_decode_kernels as t  # noqa: E402
from gpu_kernels import compiled, kernels_source  # noqa: E402

for layout in ("split", "gguf"):  # the gemvs fixture's two code objects
    specs = [(k.fn, k.template, k.ctx, k.shared) for k in t.gemv_specs("sm_90", layout).values()]
    compiled(kernels_source(specs, "sm_90", layout), "sm_90", Path(".work/fatbins"))
EOF
}

if [ "${1:-}" = prebuild ]; then
  set -e
  base=${2:?the commit whose GEMV template is the baseline}
  mkdir -p .work/base .whl
  git show "$base:templates/hip/linear_gemv_q.hip.j2" > .work/base/linear_gemv_q.hip.j2
  rm -f .whl/hipc_compiler-*.whl
  pip wheel -q --no-deps -w .whl .
  python3 "${BENCH[@]}" --prebuild .work/fatbins
  prebuild_tests
  exit 0
fi

OUT=${OUT:-/tmp/out}/gemv
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh .whl
export HIPC_KERNEL_CACHE=$PWD/.work/fatbins
nvidia-smi -L
# the GEMV tests first (a kernel that hangs there is cut off before the timing)
timeout 45 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_decode_kernels.py \
  -k gemv 2>&1 | tee "$OUT/tests.log" | tail -8
# numerics of the matrices up to 30M weights here (the rest: tests/gpu's K 14336 cases); each
# line is in bench.log as it is measured, the whole table in gemv.md at the end
timeout 110 python3 "${BENCH[@]}" --cache .work/fatbins --layers 32 --check-max 30000000 \
  --out "$OUT/gemv.md" 2>&1 | tee "$OUT/bench.log" | tail -40
