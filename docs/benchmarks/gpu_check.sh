#!/usr/bin/env bash
# One device call: the GPU tests, then bench_gpu.py (ceilings, hipc decode/prefill, smol + 8B).
#
# Here (the build box), in the repo root:
#   pip wheel --no-deps -w .whl .          # hipc itself, as a wheel
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       falcon waitress gguf pyyaml tqdm prometheus-client llguidance pytest pluggy iniconfig
# On the GPU machine (the device tool, carrying .whl):
#   bash docs/benchmarks/gpu_check.sh [bench_gpu.py args...]
# Writes $OUT/gpu-tests.log and $OUT/gpu.md.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# pytest only where the image lacks it: a second copy would shadow the image's plugins
skip=""
python3 -c "import pytest" 2>/dev/null && skip="pytest pluggy iniconfig"
wheels=()
for w in .whl/*.whl; do
  name=$(basename "$w" | cut -d- -f1)
  case " $skip " in *" $name "*) continue ;; esac
  wheels+=("$w")
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "${wheels[@]}" || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/server/test_server_gpu.py \
  2>&1 | tee "$OUT/gpu-tests.log" | tail -25
python3 docs/benchmarks/bench_gpu.py --out "$OUT/gpu.md" "$@" 2>&1 | tail -30
