#!/usr/bin/env bash
# One device call (<= 150 s on an H200): batch-1 decode time that is not weight streaming.
# The decode attention kernels against NumPy on the GPU (tests/gpu/test_decode_kernels.py
# -k attention: both forms, NaN-poisoned outputs, paged KV), then bench_decode_latency.py:
# Llama-3-8B Q4_0 cut to 4 layers and SmolLM2 Q4_1 (bf16 with --models), each compiled with the
# per-query-head decode attention ("head", before) and the grouped one ("gqa", after):
# engine-loop tok/s at 512 and 2048, graph replay, per-kernel profile, the generation
# loop's host gap per token. Table last.
#
# Here (the build box), in the repo root:
#   bash docs/benchmarks/declat_check.sh prebuild
#     (.whl/: hipc and the runtime wheels; .work/gpuq-meta; .work/declat-cache: the
#     artifacts' code objects; .work/declat-fatbins: the tests')
# On the GPU machine, carrying .whl and .work:
#   bash docs/benchmarks/declat_check.sh        # $OUT/declat/{tests.log,bench.log,latency.md}
set -uo pipefail
export HIPC_CACHE_DIR=$PWD/.work/declat-cache HIPC_KERNEL_CACHE=$PWD/.work/declat-fatbins

if [ "${1:-}" = prebuild ]; then
  set -e
  mkdir -p .whl .work
  rm -f .whl/hipc_compiler-*.whl
  pip wheel -q --no-deps -w .whl .
  [ -d .work/gpuq-meta ] || python docs/benchmarks/bench_gpu_quant.py --prep-smol .work/gpuq-meta
  python - <<'EOF'
import sys
from pathlib import Path

sys.path[:0] = ["tests", "tests/gpu"]
import test_decode_kernels as t  # noqa: E402
from gpu_kernels import compiled, kernels_source  # noqa: E402

specs = [(k.fn, k.template, k.ctx, k.shared) for k in t.decode_attention_specs("sm_90").values()]
compiled(kernels_source(specs, "sm_90", "split"), "sm_90", Path(".work/declat-fatbins"))
EOF
  python docs/benchmarks/bench_decode_latency.py --meta .work/gpuq-meta --prebuild
  exit 0
fi

OUT=${OUT:-/tmp/out}/declat
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh .whl
nvidia-smi -L
timeout 30 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_decode_kernels.py \
  -k attention 2>&1 | tail -15 | tee "$OUT/tests.log"
timeout 110 python3 docs/benchmarks/bench_decode_latency.py --meta .work/gpuq-meta \
  --out "$OUT/latency.md" 2>&1 | tail -60 | tee "$OUT/bench.log"
