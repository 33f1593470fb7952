#!/usr/bin/env bash
# The 8B decode beside llama.cpp, main against compile-time variants, on the GPU machine in one
# call (4-5 minutes with one variant on an H200): bench_gpu_variants.py for the Q4_0 file at
# CONTEXT positions (tg128 from an empty cache and after CONTEXT tokens), VARIANTS
# (space-separated NAME=VAR=VALUE builds: decode attention forms, GEMV geometries) alternated
# with main, llama-bench on the same file; then Q4_K_M main (and KM_VARIANTS) beside llama-bench;
# MODELS (default "l8_q4_0 l8_q4_k_m") names the files in order, any of bench_gpu_quant.py's
# L8_MODELS (the others main only, e.g. MODELS="l8_q5_k_m l8_q6_k"); ROUNDS (default 2) of each;
# each build traced at TRACE_AT positions (default 32 and CONTEXT; "" for none). The issue 12
# table's numbers (tg128) come from main's rows.
#
# Here (the build box), in the repo root:
#   rm -f .whl/hipc_compiler-*.whl && pip wheel -q --no-deps -w .whl .   # (+ gpu_check.sh's
#                                                                         # runtime wheels)
# llama.cpp: .work/llamabin/llamabin.part-* (an xz'd tar of a build's bin/: gpu_session.sh packs
# one) or PEERS=0 for hipc alone. On the GPU machine, carrying .whl .work/llamabin:
#   [CONTEXT=2048] [VARIANTS="h1=HIPC_DECODE_FORM=tile:h1 p2=HIPC_QUANT_GEMV_TABLE=q:glu=..."] \
#     bash docs/benchmarks/decode_variants_check.sh
# Writes $OUT/{l8_q4_0,l8_q4_k_m}.{md,log} and $OUT/trace.txt; prints the tables last.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CONTEXT=${CONTEXT:-512}
VARIANTS=${VARIANTS:-h1=HIPC_DECODE_FORM=tile:h1}
KM_VARIANTS=${KM_VARIANTS:-}
MODELS=${MODELS:-l8_q4_0 l8_q4_k_m}
TRACE_AT=${TRACE_AT-32 $CONTEXT}
LLAMA=/tmp/llama.cpp/build/bin
[ -d /tmp/site ] || source docs/benchmarks/install_wheels.sh .whl
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi -L
if [ "${PEERS:-1}" = 1 ] && [ ! -x $LLAMA/llama-bench ]; then
  mkdir -p /tmp/llama.cpp/build
  cat .work/llamabin/llamabin.part-* | xz -d | tar -C /tmp/llama.cpp/build -xf -
fi
peer=()
[ "${PEERS:-1}" = 1 ] && peer=(--llamacpp-bin $LLAMA)
variants=(--variant "main=")
for v in $VARIANTS; do variants+=(--variant "$v"); done
run() {  # MODEL ARGS...
  local model=$1
  shift
  python3 docs/benchmarks/bench_gpu_variants.py --model "$model" --work /tmp/hq --rounds "${ROUNDS:-2}" \
    --repeats 1 --context "$CONTEXT" "$@" "${peer[@]}" --out "$OUT/$model.md" > "$OUT/$model.log" 2>&1
  for art in /tmp/hq/"$model"-*.hipc; do  # every build, at each of TRACE_AT
    for pos in $TRACE_AT; do
      echo "== $(basename "$art") at $pos positions" >> "$OUT/trace.txt"
      timeout 60 python3 docs/benchmarks/trace_gpu_decode.py "$art" --position "$pos" \
        >> "$OUT/trace.txt" 2>&1
    done
  done
  rm -rf /tmp/hq/"$model"*
}
km=(--variant "main=")
for v in $KM_VARIANTS; do km+=(--variant "$v"); done
for model in $MODELS; do
  case $model in
    l8_q4_0) run "$model" "${variants[@]}" ;;
    l8_q4_k_m) run "$model" "${km[@]}" ;;
    *) run "$model" --variant "main=" ;;
  esac
done
for model in $MODELS; do tail -n +1 "$OUT/$model.md"; done
