#!/usr/bin/env bash
# The device pick's GPU check and the 8B decode through generate's loops, on the GPU machine in
# one call (~6-8 minutes on an H200 with the default MODELS): tests/gpu's top-k / pick / split
# kernels (greedy and drawn at a temperature, 128k vocabulary) and the runtime's picks on a
# compiled model (test_batch_gpu.py: steps ahead, step_top, the greedy and the sampled
# generation) in the background; bench_gpu_topk.py (the kernels alone); then for each of
# MODELS (default "l8_q4_0"; bench_gpu_quant's L8_MODELS, e.g. "l8_q4_0 l8_q4_k_m")
# bench_gpu_variants.py (tg128 as llama-bench runs it, and 128 tokens through hipc generate's
# pipelined loop, greedy and at temperature 0.8: the issue 12 table's decode columns) and
# bench_decode_host.py (a step's host share, the pipelined loops per step).
#
# Here (the build box), in the repo root:
#   rm -f .whl/hipc_compiler-*.whl && pip wheel -q --no-deps -w .whl .   # (+ gpu_check.sh's
#                                                                         # runtime wheels)
# On the GPU machine (carry .whl): [MODELS="l8_q4_0 l8_q4_k_m"] bash docs/benchmarks/pick_check.sh
# Writes $OUT/{kernels,batch}-tests.log, $OUT/topk.md, $OUT/MODEL.{md,log}, $OUT/host-MODEL.md;
# prints them last.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d /tmp/site ] || source docs/benchmarks/install_wheels.sh .whl
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
MODELS=${MODELS:-l8_q4_0}
nvidia-smi -L
(
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_batch_kernels.py \
    -k "top_k or pick or split" > "$OUT/kernels-tests.log" 2>&1
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_batch_gpu.py \
    -k "sampled or greedy_generation or step_top or ahead" > "$OUT/batch-tests.log" 2>&1
) &
timeout 120 python3 docs/benchmarks/bench_gpu_topk.py > "$OUT/topk.md" 2>&1
for model in $MODELS; do
  timeout 300 python3 docs/benchmarks/bench_gpu_variants.py --model "$model" --work /tmp/hq \
    --rounds 1 --repeats 1 --context 512 --variant "main=" --out "$OUT/$model.md" > "$OUT/$model.log" 2>&1
  timeout 90 python3 docs/benchmarks/bench_decode_host.py "/tmp/hq/$model-main.hipc" --steps 200 \
    > "$OUT/host-$model.md" 2>&1
  rm -f "/tmp/hq/$model.gguf"
done
wait
tail -n 3 "$OUT/kernels-tests.log" "$OUT/batch-tests.log"
cat "$OUT/topk.md"
for model in $MODELS; do
  tail -3 "$OUT/$model.log"
  head -8 "$OUT/$model.md"
  cat "$OUT/host-$model.md"
done
