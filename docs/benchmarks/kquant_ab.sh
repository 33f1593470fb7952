#!/usr/bin/env bash
# The K-quant decode GEMVs (issue 12): a base commit's hipc beside this checkout's, on the
# GPU machine, in one call (about 8 minutes): the GPU tests of the quantized kernels, each
# 8B decode GEMV alone and as 32-layer chains (int8 activations, the copy ceiling measured in
# the same run), base and new alternated twice, then Llama-3-8B Q4_K_M (and Q4_0) decode from
# one GGUF compiled by each. Every code object is built here first.
#
# Here (the build box), in the repo root:
#   bash docs/benchmarks/kquant_ab.sh prebuild BASE_COMMIT
#     (writes .whl/ (this checkout's hipc wheel), .work/kq/ (the base's wheel and source)
#      and the code objects of both into .work/fatbins/)
# On the GPU machine, carrying .whl, .work/kq, .work/fatbins:
#   bash docs/benchmarks/kquant_ab.sh [gemv|e2e|all]
# Writes $OUT/{tests.log,gemv-*.md,e2e-*.md} and prints a short table last.
set -uo pipefail
SHAPES=${SHAPES:-l8_down,l8_down_q4k,l8_down_q6k,l8_gate_up,l8_gate_up_q4k,l8_qkv,l8_qkv_q4k,l8_qk_q4k,l8_v_q6k,l8_o,l8_o_q4k}
# the new side also times other K-quant geometries (bench_gpu_gemv.py's KQUANT_GEOMETRIES)
VARIANTS=${VARIANTS:-default,k16r2s2k64,k16r2s3k64,k8r2s3,k8r4s2p1}
GEMV=(--activations int8 --no-attention --shapes "$SHAPES" --layers 32)
KQ=.work/kq

if [ "${1:-}" = prebuild ]; then
  set -e
  base=${2:?the commit to compare against}
  rm -rf "$KQ" && mkdir -p "$KQ/src" "$KQ/whl" .whl
  git archive "$base" | tar -x -C "$KQ/src"
  pip wheel -q --no-deps -w "$KQ/whl" "$KQ/src"
  python3 -m pip install -q --no-deps --target "$KQ/site" "$KQ"/whl/hipc_compiler-*.whl
  rm -f .whl/hipc_compiler-*.whl
  pip wheel -q --no-deps -w .whl .
  rm -rf build "$KQ/src/build"
  # each side's code objects, rendered by its own hipc (PYTHONPATH before the editable install)
  PYTHONPATH=$KQ/site python3 -c "import hipc.compiler.kernels.linear as l; print('base:', l.__file__)"
  PYTHONPATH=$KQ/site python3 "$KQ/src/docs/benchmarks/bench_gpu_gemv.py" "${GEMV[@]}" \
    --variants default --prebuild .work/fatbins
  python3 docs/benchmarks/bench_gpu_gemv.py "${GEMV[@]}" --variants "$VARIANTS" --prebuild .work/fatbins
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
  du -sh .whl "$KQ" .work/fatbins
  exit 0
fi

what=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
t0=$SECONDS
source docs/benchmarks/install_wheels.sh .whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-base "$KQ"/whl/hipc_compiler-*.whl || exit 1
NEW=/tmp/site
BASE=/tmp/site-base:/tmp/site
export HIPC_KERNEL_CACHE=$PWD/.work/fatbins
nvidia-smi -L
if [ "$what" != e2e ]; then
  # the new kernels' GPU tests first (NaN-poisoned outputs, against NumPy / the reference)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_decode_kernels.py \
    -k "gemv or prefill_gemm or embedding" > "$OUT/tests.log" 2>&1
  tail -2 "$OUT/tests.log"
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_moe_kernels.py \
    -k "q4_k or q5_k or q6_k" >> "$OUT/tests.log" 2>&1
  tail -1 "$OUT/tests.log"
  echo "tests done at $((SECONDS - t0)) s"
  for i in 1 2; do
    for side in base new; do
      if [ $side = base ]; then pp=$BASE src=$KQ/src v=default; else pp=$NEW src=. v=$VARIANTS; fi
      [ $i = 2 ] && v=default
      PYTHONPATH=$pp timeout 100 python3 "$src/docs/benchmarks/bench_gpu_gemv.py" "${GEMV[@]}" \
        --variants "$v" --cache .work/fatbins --out "$OUT/gemv-$side-$i.md" > "$OUT/gemv-$side-$i.log" 2>&1
    done
  done
  echo "gemvs done at $((SECONDS - t0)) s"
fi
if [ "$what" != gemv ]; then
  # one GGUF per model (written here with llama-quantize's types), compiled by each side
  for side in new base; do
    pp=$NEW && [ $side = base ] && pp=$BASE
    PYTHONPATH=$pp timeout 240 python3 docs/benchmarks/bench_gpu_quant.py --models l8_q4_k_m \
      --activations int8 --repeats 2 --no-generate --keep --work /tmp/hq \
      --out "$OUT/e2e-$side.md" > "$OUT/e2e-$side.log" 2>&1
  done
  echo "e2e done at $((SECONDS - t0)) s"
fi
# the short table: each GEMV's and chain's row, by side and round; the e2e rows
for f in "$OUT"/gemv-*.md "$OUT"/e2e-*.md; do
  [ -f "$f" ] || continue
  echo "== $(basename "$f")"
  grep -E "^(ceilings|copy)" "$f" | cut -c1-100
  grep -E "^\| (l8_|q4_)" "$f" | cut -d'|' -f2-4 | cut -c1-120
done
echo "call done at $((SECONDS - t0)) s"
