#!/usr/bin/env bash
# One short device call (issue 14, AMD flash attention): attention_flash.hip.j2 now reads every
# accumulator position through the prelude's fragment interface (one template for mma.sync, WMMA
# and MFMA). On the H200: the NVIDIA form against NumPy (tests/gpu/test_prefill_attention.py,
# NaN-poisoned, every case, the cp.async form too), then its time per layer beside the template
# before the change (bench_gpu_flash.py; gpucheck/old/templates = `git archive e112f84 templates`,
# carried untracked). <= 90 s.
#   bash docs/benchmarks/amdflash_check.sh WHEEL_DIR      # results under $OUT/amdflash/
set -uo pipefail
OUT=${OUT:-/tmp/out}/amdflash
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh "$1"
nvidia-smi -L
timeout 45 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_prefill_attention.py 2>&1 \
  | tail -30 > "$OUT/tests.log"
tail -30 "$OUT/tests.log"
old=gpucheck/old/templates
[ -d "$old" ] || old=""
timeout 35 python3 docs/benchmarks/bench_gpu_flash.py ${old:+--templates "$old"} --out "$OUT/flash.md" 2>&1 \
  | tail -12
