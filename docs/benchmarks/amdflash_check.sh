#!/usr/bin/env bash
# One short device call (issue 14, AMD flash attention): attention_flash.hip.j2 now reads every
# accumulator position through the prelude's fragment interface (one template for mma.sync, WMMA
# and MFMA). On the H200: the NVIDIA form against NumPy (tests/gpu/test_prefill_attention.py,
# NaN-poisoned, every case), then its time per layer (bench_gpu_flash.py: the generic template
# beside NVIDIA's own mma form, which replaced --templates DIR and the cp.async form). <= 90 s.
#   bash docs/benchmarks/amdflash_check.sh WHEEL_DIR      # results under $OUT/amdflash/
set -uo pipefail
OUT=${OUT:-/tmp/out}/amdflash
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh "$1"
nvidia-smi -L
timeout 45 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_prefill_attention.py 2>&1 \
  | tail -30 > "$OUT/tests.log"
tail -30 "$OUT/tests.log"
timeout 35 python3 docs/benchmarks/bench_gpu_flash.py --forms generic,mma --out "$OUT/flash.md" 2>&1 \
  | tail -12
