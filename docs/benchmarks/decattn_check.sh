#!/usr/bin/env bash
# One device call (<= 120 s on an H200: 20 + 25 + 70 s caps): the batch-1 decode attention
# forms, checked and timed.
# 1. tests/gpu/test_decode_kernels.py -k attention: every form ("head", "gqa", "tile" and some
#    tile geometries) on every case, NaN-poisoned outputs against NumPy, paged KV;
# 2. bench_decode_attention.py: the kernels alone at 0/128/512/2048 positions, Llama-3-8B and
#    SmolLM2 heads, each checked against NumPy, then timed launched as decode launches them
#    (pdl) and alone;
# 3. bench_decode_latency.py: Llama-3-8B Q4_0 cut to 4 layers compiled with each form (FORMS):
#    engine-loop tok/s, graph replay and the per-kernel profile at 128/512/2048 positions.
# Tables last.
#
# Here (the build box), in the repo root:
#   bash docs/benchmarks/decattn_check.sh prebuild
#     (.work/decattn-whl: the hipc wheel and gguf's; .work/decattn-fatbins: the tests' and
#     bench_decode_attention's code objects; .work/decattn-cache: the 4-layer 8B artifacts'
#     code objects, so that the device only writes their weights; both packed into
#     .work/decattn-prebuilt.tar.xz, which is what the device needs of them)
# On the GPU machine, carrying .work/decattn (this tree) and, where present, the lead's .whl
# (../../.whl from here: the runtime wheels; gguf's are carried here too):
#   bash docs/benchmarks/decattn_check.sh   # $OUT/decattn/{tests,kernels,bench}.log, *.md
set -uo pipefail
export HIPC_CACHE_DIR=$PWD/.work/decattn-cache HIPC_KERNEL_CACHE=$PWD/.work/decattn-fatbins
FORMS=${FORMS:-tile,head,gqa}  # the new form first: a cut run still compares it
MODELS=${MODELS:-l8_q4_0}  # bench_decode_latency's (smol_q4_1 needs META)
META=${META:-../gpuq-meta}  # bench_gpu_quant.py --prep-smol's folder (main's .work/gpuq-meta)
KFORMS=${KFORMS:-}  # bench_decode_attention's forms (default: its FORMS)
WORK=/tmp/hipc-decattn  # the 4-layer GGUF and its artifacts (written on the device: ~1.7 GB)

if [ "${1:-}" = prebuild ]; then
  set -e
  mkdir -p .work/decattn-whl
  rm -f .work/decattn-whl/*.whl
  pip wheel -q --no-deps -w .work/decattn-whl .
  for w in gguf pyyaml tqdm; do cp /work/main/.whl/"$w"-*.whl .work/decattn-whl/; done
  python - <<'EOF'
import sys
from pathlib import Path

sys.path[:0] = ["tests", "tests/gpu"]
import test_decode_kernels as t  # noqa: E402
from gpu_kernels import compiled, kernels_source  # noqa: E402

specs = [(k.fn, k.template, k.ctx, k.shared) for k in t.decode_attention_specs("sm_90").values()]
compiled(kernels_source(specs, "sm_90", "split"), "sm_90", Path(".work/decattn-fatbins"))
EOF
  python docs/benchmarks/bench_decode_attention.py --prebuild .work/decattn-fatbins
  rm -rf "$WORK"/*.hipc  # compiled again from the templates as they are (cache hits if unchanged)
  python docs/benchmarks/bench_decode_latency.py --models "$MODELS" --forms "$FORMS" \
    --work "$WORK" --meta "$META" --prebuild
  # carried packed (cubins compress ~3x): the call's tree stays under 12 MB
  tar -cJf .work/decattn-prebuilt.tar.xz -C .work decattn-fatbins decattn-cache
  du -sh .work/decattn-*
  exit 0
fi

OUT=${OUT:-/tmp/out}/decattn
mkdir -p "$OUT"
[ -d .work/decattn-fatbins ] || tar -xJf .work/decattn-prebuilt.tar.xz -C .work
W=/tmp/decattn-whl
rm -rf "$W" && mkdir -p "$W"
[ -d ../../.whl ] && cp ../../.whl/*.whl "$W"/
rm -f "$W"/hipc_compiler-*.whl
cp .work/decattn-whl/*.whl "$W"/
source docs/benchmarks/install_wheels.sh "$W"
# the artifacts' code objects hit HIPC_CACHE_DIR only where nvcc's identity is the build box's
# (/usr/local/bin/nvcc, cuda 13.0.88): a wrapper there where the path is free (as moedec does)
real=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
if [ ! -e /usr/local/bin/nvcc ] && [ -n "$real" ]; then
  printf '#!/bin/sh\nexec %s "$@"\n' "$real" > /usr/local/bin/nvcc && chmod +x /usr/local/bin/nvcc
fi
export PATH=/usr/local/bin:$PATH  # (run 1 missed: another nvcc came first on PATH there)
command -v nvcc
nvcc --version | tail -1
nvidia-smi -L
timeout 20 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_decode_kernels.py \
  -k attention 2>&1 | tail -15 | tee "$OUT/tests.log"
# (each writes its rows as they finish: a cut run keeps them)
timeout 25 python3 docs/benchmarks/bench_decode_attention.py --out "$OUT/kernels.md" ${KFORMS:+--forms "$KFORMS"} \
  > "$OUT/kernels.log" 2>&1
echo "kernels rc=$?"
timeout ${LATENCY_S:-70} python3 docs/benchmarks/bench_decode_latency.py --models "$MODELS" \
  --forms "$FORMS" --meta "$META" --positions 128,512,2048 --work "$WORK" --out "$OUT/latency.md" \
  > "$OUT/bench.log" 2>&1
echo "latency rc=$?"
grep -E "^(compiled|wrote|Traceback)|Error" "$OUT/bench.log" | head -20
grep -h " @" "$OUT/bench.log" | cut -c1-400
echo
cat "$OUT/kernels.md" 2>/dev/null || grep "^|" "$OUT/kernels.log" || tail -20 "$OUT/kernels.log"
echo
grep "^|" "$OUT/latency.md" 2>/dev/null || grep " | " "$OUT/bench.log" || tail -20 "$OUT/bench.log"
