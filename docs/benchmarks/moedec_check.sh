#!/usr/bin/env bash
# moedec (issue 10): one device call of <= 150 s. The MoE kernel tests on the GPU (fused
# route with its one-wave routing, _up, _down vs NumPy, NaN-poisoned), then the 8-layer
# Qwen3-30B-A3B-shape Q4_0 decode compiled as several variants from one GGUF, each timed
# as decode tok/s and as its graph's replay, with the per-kernel profile before / after:
#   before   main's launch choices (_up at 2 blocks per SM, the router's block-wide routing)
#   after    _up at 3 blocks per SM (one round of blocks), routing by one wave
#   int8     after, with --activations int8 (llama.cpp's GEMVs take int8 activations too)
#   gemv8w   after, with the q/k/v and o GEMVs as 8-wave blocks two per SM (128-160 blocks
#            instead of 64-80 on 132 SMs; linear.py's geometry is quantk's: information only)
# (the profile of "before" is session 5's, docs/benchmarks/gpu-h200-moe.md: the same code)
# Here (the build box): bash docs/benchmarks/moedec_check.sh prebuild   (the wheels in .whl)
# On the GPU machine:   bash docs/benchmarks/moedec_check.sh            (everything on stdout)
set -uo pipefail
B=docs/benchmarks
GEMV8W='linear.quant_gemv=(lambda f: lambda ws, N, K, glu=False: QuantGemv(8, 2, 2, 264, 2, 3, 8) if ws == "q4_0" and not glu and N * K <= 1 << 24 else f(ws, N, K, glu))(quant_gemv)'
VARIANTS=(
  --variant "before:int16:moe.MOE_UP_BLOCKS_PER_SM=2;moe.MOE_ROUTE_WAVE=False"
  --variant "after:int16:"
  --variant "int8:int8:"
  --variant "gemv8w:int16:$GEMV8W"
)
if [ "${1:-}" = prebuild ]; then  # the wheels the GPU machine installs (hipc, gguf)
  set -e
  rm -rf .whl && mkdir -p .whl
  pip wheel -q --no-deps -w .whl .
  cp /work/main/.work/quantk/.whl/gguf-*.whl .whl/
  exit 0
fi
OUT=${OUT:-/tmp/out}/moedec
mkdir -p "$OUT"
source $B/install_wheels.sh .whl
nvidia-smi -L
timeout 25 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_moe_kernels.py 2>&1 | tail -6
timeout 125 python3 $B/bench_gpu_moe.py --models qwen3 --layers qwen3=8 --repeats 2 --profile \
  "${VARIANTS[@]}" --out "$OUT/variants.md" 2>&1 | tail -60
