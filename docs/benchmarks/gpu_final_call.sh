#!/usr/bin/env bash
# A closing device call (session 6's final one): prefill (8B + SmolLM2 beside eager and llama.cpp),
# then the MoE decode beside llama.cpp, with the GPU tests of the session's kernels in the
# background while the MoE model is written and compiled (the GPU idles then); one log per part
# under $OUT. On the GPU machine, carrying .whl .work/peers .work/llamabin .work/hybrid-models:
#   TESTS="tests/gpu/test_a.py ..." BUDGET=505 bash docs/benchmarks/gpu_final_call.sh
# FIRST (default prefill) and SECOND (default moe) pick the two parts' PHASES of gpu_session.sh;
# the tests run beside SECOND.
set -u
T0=$SECONDS
BUDGET=${BUDGET:-520}
left() { echo $((BUDGET - (SECONDS - T0))); }
nvidia-smi -L
FIRST=${FIRST:-prefill} SECOND=${SECOND:-moe}
PHASES=$FIRST PHASE_SECONDS=$(($(left) - ${SECOND_SECONDS:-150})) bash docs/benchmarks/gpu_session.sh bench >"$OUT/first.log" 2>&1
echo "$FIRST done at $((SECONDS - T0)) s"; tail -14 "$OUT/first.log"
rm -rf /tmp/hipc-quant /tmp/hipc-prefill
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
t=$(( $(left) > 150 ? 120 : $(left) - 30 ))
(export HIPC_HYBRID_MODELS=$PWD/.work/hybrid-models; printf "%s\n" ${TESTS:?} | xargs -P 8 -I{} sh -c \
  "timeout $t python3 -m pytest -q -p no:cacheprovider -m gpu -rfE {} > /tmp/\$(basename {}).log 2>&1"
 for f in /tmp/test_*.log; do tail -8 "$f" | sed "s|^|$(basename "$f" .log): |"; done >"$OUT/gpu-tests.log") &
tests=$!
[ "$(left)" -gt 120 ] && PHASES=$SECOND PHASE_SECONDS=$(($(left) - 5)) bash docs/benchmarks/gpu_session.sh bench >"$OUT/second.log" 2>&1
echo "$SECOND done at $((SECONDS - T0)) s"; tail -16 "$OUT/second.log"
wait $tests
grep -E "passed|failed|error" "$OUT/gpu-tests.log"
echo "done at $((SECONDS - T0)) s"
