#!/usr/bin/env bash
# One device call (<= 150 s on an H200) for the FA2-style flash prefill attention (issue 14):
#   1. tests/gpu/test_prefill_attention.py: the flash kernel as compiled (attention_flash_mma),
#      its 8-warp and 32-rows-a-warp forms, the generic (AMD-structured) form and the SIMT one against softmax in
#      float64, outputs NaN-poisoned, the KV pool NaN where no sequence wrote, odd T, windows,
#      GQA, clip, partial rotary, steps mixing sequences;
#   2. whole tiny bf16 models (tests/gpu/test_compiled_gpu.py): the flash kernel writing o's input in
#      bf16 gives logits bit for bit equal to o's own _xb pass; the default policy against the
#      reference (llama, and mistral's sliding window);
#   3. bench_gpu_flash.py: the forms side by side at the Llama-3-8B and SmolLM2 shapes, 512 and
#      4,096 tokens from 0, and the second step of a 4,096-token prefill (2,048 rows at 2,048..);
#   4. bench_gpu_prefill.py --models l8 --layers 2 --tokens 512,4096 (hipc alone).
# Here (the build box), in the repo root:
#   bash docs/benchmarks/flash_check.sh prebuild   (.whl: hipc; .work/fatbins: code objects;
#   .work/hipc-cache: the kernels of the artifacts compiled in 3 and 4, docs/benchmarks/flash_prebuild.py)
# On the GPU machine: bash docs/benchmarks/flash_check.sh   (everything on stdout; PREFILL=0 skips 4)
set -uo pipefail
FORMS=mma,mma:w8,mma:r2,generic
BENCH=(docs/benchmarks/bench_gpu_flash.py --forms "$FORMS" --cache .work/fatbins --repeats 5)

if [ "${1:-}" = prebuild ]; then
  set -e
  mkdir -p .whl .work/fatbins
  rm -f .whl/hipc_compiler-*.whl
  pip wheel -q --no-deps -w .whl .
  python3 "${BENCH[@]}" --models l8,smol --tokens 512,4096 --prebuild sm_90
  python3 "${BENCH[@]}" --models l8 --start 2048 --tokens 2048 --prebuild sm_90
  PYTHONPATH=tests:tests/gpu python3 - <<'EOF'
from pathlib import Path

import test_prefill_attention as t
from gpu_kernels import compiled, kernels_source

specs = [(k.fn, k.template, k.ctx, k.shared) for k in t.kernel_specs("sm_90").values()]
compiled(kernels_source(specs, "sm_90", "split"), "sm_90", Path(".work/fatbins"))
EOF
  PYTHONPATH=tests:tests/gpu python3 docs/benchmarks/flash_prebuild.py .work/hipc-cache --l8
  ls .whl .work/fatbins .work/hipc-cache
  exit 0
fi

source docs/benchmarks/install_wheels.sh .whl
export HIPC_KERNEL_CACHE=$PWD/.work/fatbins HIPC_CACHE_DIR=$PWD/.work/hipc-cache
nvidia-smi -L
echo "== tests/gpu/test_prefill_attention.py"
timeout 45 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_prefill_attention.py 2>&1 \
  | grep -v "PASSED" | tail -25
echo "== tests/gpu/test_compiled_gpu.py: o's input from the flash kernel in bf16; the default policy"
timeout 30 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_compiled_gpu.py \
  -k "attention_bf16_handoff or (bf16_prefill_policy and (llama or mistral))" 2>&1 | tail -6
echo "== bench_gpu_flash.py (forms: $FORMS)"
timeout 20 python3 "${BENCH[@]}" --models l8,smol --tokens 512,4096 --out /tmp/flash1.md 2>&1 | grep -v "^|"
timeout 12 python3 "${BENCH[@]}" --models l8 --start 2048 --tokens 2048 --out /tmp/flash2.md 2>&1 | grep -v "^|"
cat /tmp/flash1.md; tail -n +3 /tmp/flash2.md
[ "${PREFILL:-1}" = 1 ] || exit 0
echo "== bench_gpu_prefill.py (2 layers, hipc alone)"
timeout 60 python3 docs/benchmarks/bench_gpu_prefill.py --models l8 --layers 2 --tokens 512,4096 \
  --no-torch --repeats 3 --out /tmp/prefill.md 2>&1 | tail -4
cat /tmp/prefill.md
