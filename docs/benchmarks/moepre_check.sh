#!/usr/bin/env bash
# One device call (<= 150 s on an H200) for the MoE and hybrid prefill (issues 10, 11):
#   1. tests/gpu/test_moe_kernels.py (prefill: the grouped GEMMs at every tile height, skewed
#      routes, empty experts) and the chunked cases of tests/gpu/test_deltanet_gpu.py, NaN-poisoned
#      against NumPy;
#   2. bench_gpu_moe_prefill.py: the MoE prefill chain alone per kernel at the Qwen3-30B-A3B
#      and Qwen3.5-35B-A3B shapes, 512 and 4096 tokens, each tile height (64 = before);
#   3. bench_gpu_deltanet.py --chunked-only: the chunked delta rule's forms (scan_mma among them);
#   4. end to end, the two shapes cut to a few layers (Qwen3-30B-A3B 2, Qwen3.5-35B-A3B 4: 3
#      DeltaNet + 1 full attention), compiled with 4096-token prefill steps: each launch's time
#      in a 512- and a 4096-token prefill step (profile_gpu_decode.py --prefill).
# Here (the build box), in the repo root:
#   bash docs/benchmarks/moepre_check.sh prebuild   (.whl: hipc + gguf; .work/fatbins and
#                                                   .work/hipc-cache: code objects)
# On the GPU machine: bash docs/benchmarks/moepre_check.sh   (everything on stdout)
set -uo pipefail
SHAPES=(q3:qwen3-30b-a3b:2:write_moe_gguf q35:qwen3.5-35b-a3b:4:write_hybrid_gguf)
COMPILE=(--target sm_90 -q --max-context 4224 --prefill-chunk 4096)

if [ "${1:-}" = prebuild ]; then
  set -e
  mkdir -p .whl .work/fatbins /tmp/moepre
  rm -f .whl/hipc_compiler-*.whl
  pip wheel -q --no-deps -w .whl .
  cp /work/main/.whl/gguf-*.whl .whl/
  python3 docs/benchmarks/bench_gpu_moe_prefill.py --prebuild sm_90 --cache .work/fatbins
  PYTHONPATH=tests:tests/gpu:docs/benchmarks python3 - <<'EOF'
from pathlib import Path

import bench_gpu_deltanet
import test_moe_kernels
from deltanet_cases import device_specs

from gpu_kernels import compiled, kernels_source

cache = Path(".work/fatbins")
for specs in (test_moe_kernels.device_specs("sm_90", {}), device_specs("sm_90")[0],
              bench_gpu_deltanet.kernels("sm_90")[2]):
    compiled(kernels_source(specs, "sm_90"), "sm_90", cache)
EOF
  export HIPC_CACHE_DIR=$PWD/.work/hipc-cache
  for s in "${SHAPES[@]}"; do
    IFS=: read -r name preset layers writer <<< "$s"
    [ -f /tmp/moepre/$name.gguf ] || python3 docs/benchmarks/$writer.py --preset $preset \
      --type q4_0 --layers $layers /tmp/moepre/$name.gguf
    python3 -m hipc.cli.main compile /tmp/moepre/$name.gguf "${COMPILE[@]}" -o /tmp/moepre/$name.hipc
  done
  rm -rf .work/hipc-cache/artifacts  # the weights: only the code objects travel
  du -sh .whl .work/fatbins .work/hipc-cache
  exit 0
fi

source docs/benchmarks/install_wheels.sh .whl
export HIPC_KERNEL_CACHE=$PWD/.work/fatbins
# a copy: a read-only carried folder would make every cache write fail
rm -rf /tmp/moepre-cache && cp -r .work/hipc-cache /tmp/moepre-cache
export HIPC_CACHE_DIR=/tmp/moepre-cache
nvidia-smi -L
W=/tmp/moepre && mkdir -p $W
# the GGUFs written while the tests run (CPU only)
(for s in "${SHAPES[@]}"; do
  IFS=: read -r name preset layers writer <<< "$s"
  python3 docs/benchmarks/$writer.py --preset $preset --type q4_0 --layers $layers $W/$name.gguf
done) > $W/write.log 2>&1 &
writer_pid=$!
echo "== tests (MoE prefill, chunked deltanet)"
timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_moe_kernels.py \
  -k "prefill" 2>&1 | tail -8
timeout 30 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_deltanet_gpu.py \
  -k "chunked" 2>&1 | tail -5
echo "== bench_gpu_moe_prefill.py"
timeout 30 python3 docs/benchmarks/bench_gpu_moe_prefill.py --out $W/moe_prefill.md > /dev/null
echo "== bench_gpu_deltanet.py --chunked-only"
timeout 25 python3 docs/benchmarks/bench_gpu_deltanet.py --chunked-only --out $W/deltanet.md \
  > /dev/null
wait $writer_pid
cat $W/write.log
for s in "${SHAPES[@]}"; do
  IFS=: read -r name preset layers writer <<< "$s"
  echo "== $preset, $layers layers, Q4_0: compile (4096-token steps), profile 512 / 4096"
  /usr/bin/time -f "compile %e s" timeout 60 python3 -m hipc.cli.main compile $W/$name.gguf \
    "${COMPILE[@]}" -o $W/$name.hipc 2>&1 | tail -3
  for T in 512 4096; do
    echo "-- $preset prefill $T"
    timeout 30 python3 docs/benchmarks/profile_gpu_decode.py $W/$name.hipc --prefill $T 2>&1 \
      | tail -40
  done
  rm -rf $W/$name.hipc $W/$name.gguf
done
echo "== tables"
cat $W/deltanet.md $W/moe_prefill.md
