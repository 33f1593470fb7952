#!/usr/bin/env bash
# The hybrids' GPU benchmarks in one device call (issue 11's speed table): bench_gpu_deltanet.py
# (the deltanet kernels alone) and bench_gpu_hybrid.py (Qwen3.5-35B-A3B shape, Q4_0, hipc beside
# llama-bench on the same file). Where branch hybridgpu is merged, gpu_session.sh's `hybrid` and
# `deltanet` phases run the same; this script is for a tree carried on its own:
#   bash docs/benchmarks/hybridgpu_bench.sh WHL LLAMA_BIN_DIR [bench_gpu_hybrid.py args...]
# WHL: hipc's wheel and the runtime wheels (installed into /tmp/site, replacing what is there);
# LLAMA_BIN_DIR: llama.cpp's CUDA build (llama-bench), e.g. /tmp/llama.cpp/build/bin.
# Writes $OUT/hybridgpu/{deltanet.md,hybrid.md}.
set -uo pipefail
OUT=${OUT:-/tmp/out}/hybridgpu
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh "$1"
LLAMA=$2
shift 2
nvidia-smi -L
ls "$LLAMA/llama-bench" || echo "no llama-bench in $LLAMA: hipc alone"
timeout 90 python3 docs/benchmarks/bench_gpu_deltanet.py --out "$OUT/deltanet.md" 2>&1 | tail -12
timeout 480 python3 docs/benchmarks/bench_gpu_hybrid.py --repeats 2 --llamacpp-bin "$LLAMA" \
  --out "$OUT/hybrid.md" "$@" 2>&1 | tail -25
rm -rf /tmp/hipc-hybrid-bench
