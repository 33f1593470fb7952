#!/usr/bin/env bash
# One device call for the GPU MoE kernels: their GPU tests, then bench_gpu_moe.py.
#
# Here (the build box), in the repo root, into a folder WHL the device tool carries:
#   pip wheel --no-deps -w WHL .      # hipc itself, as a wheel
#   plus the runtime wheels gpu_check.sh's header lists (falcon, waitress, gguf, ...)
# On the GPU machine:
#   bash docs/benchmarks/gpu_moe_check.sh WHL [bench_gpu_moe.py args...]
# Writes $OUT/moe-tests.log and $OUT/moe.md.
set -uo pipefail
OUT=${OUT:-/tmp/out}
WHL=$1
shift
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh "$WHL"
nvidia-smi -L
# three processes (a kernel that faults leaves its CUDA context unusable for the rest),
# each bounded by $TEST_SECONDS (default 90); $E2E_SELECT: a -k expression for the
# end-to-end tests (default: all)
for t in "tests/gpu/test_moe_kernels.py decode" "tests/gpu/test_moe_kernels.py prefill" \
  "tests/gpu/test_compiled_moe_gpu.py ${E2E_SELECT:-moe}"; do
  timeout "${TEST_SECONDS:-90}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf \
    "${t%% *}" -k "${t#* }" 2>&1 | tail -25 | tee -a "$OUT/moe-tests.log"
done
python3 docs/benchmarks/bench_gpu_moe.py --out "$OUT/moe.md" "$@" 2>&1 | tail -60
