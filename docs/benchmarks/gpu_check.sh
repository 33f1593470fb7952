#!/usr/bin/env bash
# One device call: the GPU tests, then bench_gpu.py (ceilings, hipc decode/prefill, smol + 8B).
#
# Here (the build box), in the repo root:
#   pip wheel --no-deps -w .whl .          # hipc itself, as a wheel
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       falcon waitress gguf pyyaml tqdm prometheus-client llguidance pytest pluggy iniconfig \
#       pydantic pydantic-core annotated-types typing-extensions typing-inspection  # the server extra's
# On the GPU machine (the device tool, carrying .whl):
#   bash docs/benchmarks/gpu_check.sh [bench_gpu.py args...]
# Writes $OUT/gpu-tests.log and $OUT/gpu.md.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh
nvidia-smi -L
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/server/test_server_gpu.py \
  2>&1 | tee "$OUT/gpu-tests.log" | tail -25
python3 docs/benchmarks/bench_gpu.py --out "$OUT/gpu.md" "$@" 2>&1 | tail -30
