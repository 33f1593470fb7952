#!/usr/bin/env bash
# moedec (issue 10): one device call of about 200 s (cut anywhere, what ran is printed). The MoE kernel tests on the GPU (fused
# route, _up, _down vs NumPy, NaN-poisoned), then the 8-layer Qwen3-30B-A3B-shape Q4_0
# decode compiled as several variants from one GGUF, each timed as decode tok/s and as its
# graph's replay, with the per-kernel profile of "after":
#   before     main's launch choices (_up at 2 blocks per SM)
#   after      the defaults: _up at 3 blocks per SM (its k x F / 16 blocks in one round)
#   wave       after + MOE_ROUTE_WAVE (the last block routes with one wave, no barriers)
#   local      after + MOE_ROUTE_LOCAL (no route hand-off: _up and _down each route, one wave)
#   int8       after, with --activations int8 (llama.cpp's GEMVs take int8 activations too)
#   gemv8w     after, with the q/k/v and o GEMVs as 8-wave blocks two per SM (128-160 blocks
#              instead of 64-80 on 132 SMs; linear.py's geometry is quantk's: information only)
# (the profile of "before" is session 5's, docs/benchmarks/gpu-h200-moe.md: the same code)
# Here (the build box): bash docs/benchmarks/moedec_check.sh prebuild   (.whl, .work/cache)
# On the GPU machine:   bash docs/benchmarks/moedec_check.sh            (everything on stdout)
set -uo pipefail
B=docs/benchmarks
GEMV8W='linear.quant_gemv=(lambda f: lambda ws, N, K, glu=False: QuantGemv(8, 2, 2, 264, 2, 3, 8) if ws == "q4_0" and not glu and N * K <= 1 << 24 else f(ws, N, K, glu))(quant_gemv)'
VARIANTS=(
  --variant "before:int16:moe.MOE_UP_BLOCKS_PER_SM=2"
  --variant "after:int16:"
  --variant "local:int16:moe.MOE_ROUTE_LOCAL=True"
  --variant "wave:int16:moe.MOE_ROUTE_WAVE=True"
  --variant "int8:int8:"
  --variant "gemv8w:int16:$GEMV8W"
)
if [ "${1:-}" = prebuild ]; then
  # the wheels the GPU machine installs (hipc, gguf), and every variant's code object in the
  # kernel cache carried in .work/cache (compiled from one layer: the same kernels as eight,
  # the LM head at the full vocabulary). They hit there only where nvcc's identity is this
  # box's (/usr/local/bin/nvcc, the same build); elsewhere the variants compile there.
  set -e
  rm -rf .whl .work/cache && mkdir -p .whl .work/cache
  pip wheel -q --no-deps -w .whl .
  cp /work/main/.work/quantk/.whl/gguf-*.whl .whl/
  HIPC_CACHE_DIR=$PWD/.work/cache python3 $B/moedec_prebuild.py "${VARIANTS[@]}"
  exit 0
fi
OUT=${OUT:-/tmp/out}/moedec
mkdir -p "$OUT"
source $B/install_wheels.sh .whl
export HIPC_CACHE_DIR=$PWD/.work/cache
real=$(command -v nvcc)
if [ ! -e /usr/local/bin/nvcc ] && [ -n "$real" ]; then  # the build box's nvcc path: cache hits
  printf '#!/bin/sh\nexec %s "$@"\n' "$real" > /usr/local/bin/nvcc && chmod +x /usr/local/bin/nvcc
fi
nvidia-smi -L
nvcc --version | tail -1
# output streamed (a run cut short by the call's cap keeps what it printed)
timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_moe_kernels.py \
  tests/gpu/test_compiled_moe_gpu.py -k "decode or quantized" 2>&1
timeout 150 python3 $B/bench_gpu_moe.py --models qwen3 --layers qwen3=8 --repeats 2 --profile \
  "${VARIANTS[@]}" --out "$OUT/variants.md" 2>&1
