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
skip=""
python3 -c "import pytest" 2>/dev/null && skip="pytest pluggy iniconfig"
wheels=()
for w in "$WHL"/*.whl; do
  name=$(basename "$w" | cut -d- -f1)
  case " $skip " in *" $name "*) continue ;; esac
  wheels+=("$w")
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "${wheels[@]}" || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
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
