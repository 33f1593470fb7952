#!/usr/bin/env bash
# One device call for the hybrids' GPU side (issue 11): the deltanet kernels alone (serial,
# chunked prefill, the two forms agreeing; NaN-poisoned vs NumPy), bench_gpu_deltanet.py
# (decode per lane split, prefill serial vs chunked), then the hybrids end to end: recurrent
# state snapshots on the device (prefix reuse = a never-reusing engine), Qwen3.5 and
# Qwen3-Next with 64-token steps (chunked prefill) against the reference.
#
# Here (the build box), repo root, with hipc's wheel and the runtime wheels in WHL, the tiny
# hybrids in MODELS (PYTHONPATH=tests python tests/gpu/test_compiled_hybrid_gpu.py MODELS)
# and the code objects built ahead into CACHE (hybridgpu_prebuild.py CACHE/kernels
# CACHE/hipc MODELS). On the GPU machine:
#   bash docs/benchmarks/hybridgpu_check.sh WHL MODELS CACHE
# Writes $OUT/hybridgpu/{tests.log,deltanet.md}.
set -uo pipefail
OUT=${OUT:-/tmp/out}/hybridgpu
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh "$1"
export HIPC_HYBRID_MODELS=$(realpath "$2")
cache=$(realpath "$3")
# copies: a read-only carried folder would make every cache write fail
rm -rf /tmp/hybridgpu-cache && cp -r "$cache" /tmp/hybridgpu-cache
export HIPC_KERNEL_CACHE=/tmp/hybridgpu-cache/kernels HIPC_CACHE_DIR=/tmp/hybridgpu-cache/hipc
nvidia-smi -L
# separate processes: a kernel that faults leaves its CUDA context unusable for the rest
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_deltanet_gpu.py \
  2>&1 | tail -40 | tee -a "$OUT/tests.log"
timeout 90 python3 docs/benchmarks/bench_gpu_deltanet.py --out "$OUT/deltanet.md" 2>&1 | tail -20
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rf \
  tests/gpu/test_compiled_hybrid_gpu.py \
  -k "prefix_reuse or (qwen3_5_on_gpu and float32) or (qwen3_next_on_gpu and hf)" \
  2>&1 | tail -40 | tee -a "$OUT/tests.log"
