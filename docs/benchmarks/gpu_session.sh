#!/usr/bin/env bash
# One GPU session in two back-to-back device calls (a call runs at most 10 minutes; the
# machine stays warm 30 s between them, and a setsid process outlives its call):
#
#   bash docs/benchmarks/gpu_session.sh tests   # starts the llama.cpp build (setsid, in the
#                                               # background), then every GPU test
#   bash docs/benchmarks/gpu_session.sh bench   # the benchmarks, each beside its peer
#
# Here (the build box), in the repo root, before the first call:
#   pip wheel --no-deps -w .whl .                     # hipc itself (plus the runtime wheels
#                                                     # gpu_check.sh's header lists)
#   cp ../shared/peers/* .work/peers/                 # mkgguf.py, build_llamacpp_cuda.sh
#   ../shared/peers/build_llamacpp_source.sh .work/llama
#   python docs/benchmarks/bench_gpu_quant.py --prep-smol .work/gpuq-meta
# and carry .whl .work/peers .work/llama .work/gpuq-meta.
# .work/llamabin/llamabin.part-* (an xz'd tar of a build's bin/, split into 15 MB parts) replaces the build.
# TESTS (default: every tests/gpu file and the GPU server test) picks the test files.
# PHASES (default "prefill quant deltanet moe"; also moeprof, olmoe, hybrid, batching) picks the benchmarks; PEERS=0 skips
# llama.cpp; PROFILE=l8_q4_0,... adds bench_gpu_quant's per-kernel decode profiles, QUANT_MODELS picks its models,
# HYBRID_PROFILE=1 bench_gpu_hybrid's per-kernel prefill profiles.
# Writes $OUT/gpu-tests.log (+ -full.log), $OUT/deltanet.md, $OUT/moe.md (+ moe-olmoe.md), $OUT/prefill.md, $OUT/quant.md,
# $OUT/batching.md (PHASES=batching), $OUT/hybrid.md, $OUT/bench.log.
# PHASE_SECONDS bounds each phase (default 540); the benchmarks run in the order of
# what they are needed for (MoE, prefill, quantized decode), each in what time is left.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LLAMA=/tmp/llama.cpp/build/bin
# the second call finds the first one's install
[ -d /tmp/site ] || source docs/benchmarks/install_wheels.sh .whl
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1

# a build packed by an earlier call of the same machine type: seconds instead of 6 minutes
if [ "${PEERS:-1}" = 1 ] && [ ! -x $LLAMA/llama-bench ] && ls .work/llamabin/llamabin.part-* >/dev/null 2>&1; then
  mkdir -p /tmp/llama.cpp/build
  cat .work/llamabin/llamabin.part-* | xz -d | tar -C /tmp/llama.cpp/build -xf - && echo "llama.cpp: prebuilt binaries unpacked"
fi

end=$((SECONDS + ${PHASE_SECONDS:-540}))
left() { echo $((end - SECONDS)); }

case "${1:?tests or bench}" in
tests)
  nvidia-smi -L
  # nice: the GPU tests compile their kernels on the same 16 cores
  if [ "${PEERS:-1}" = 1 ] && [ ! -x $LLAMA/llama-bench ]; then
    setsid nohup nice -n 10 bash .work/peers/build_llamacpp_cuda.sh \
      "$PWD/.work/llama" >/tmp/llamacpp-outer.log 2>&1 </dev/null &
  fi
  # one process per file (a kernel that faults leaves its CUDA context unusable), five at a
  # time: the tests mostly wait on nvcc, and the GPU has room for all of them
  [ -d .work/hybrid-models ] && export HIPC_HYBRID_MODELS=$PWD/.work/hybrid-models
  t=$(left)
  ls ${TESTS:-tests/gpu/test_*.py tests/server/test_server_gpu.py} | xargs -P 5 -I{} sh -c \
    "timeout $((t - 20)) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE {} > /tmp/\$(basename {}).log 2>&1"
  for f in /tmp/test_*.py.log; do
    tail -12 "$f" | sed "s|^|$(basename "$f" .log): |"
  done | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|error|FAILED|ERROR"
  cat /tmp/test_*.py.log > "$OUT/gpu-tests-full.log"
  echo "llama.cpp build: $(tail -1 /tmp/llamacpp-outer.log 2>/dev/null)"
  ;;
bench)
  # the peers come last in each benchmark, so the llama.cpp build may still be running here
  # PEERS=0: hipc (and PyTorch eager) alone, for a development call without the 6-minute build
  peer() { [ "${PEERS:-1}" = 1 ] && echo "$@"; }
  waitllama() {
    [ "${PEERS:-1}" = 1 ] || return 0
    for _ in $(seq 240); do [ -x $LLAMA/llama-quantize ] && break; sleep 2; done
    ls $LLAMA/llama-bench $LLAMA/llama-quantize || tail -20 /tmp/llamacpp-build.log
  }
  run() {  # NAME ARGS...: one benchmark in the time left, its table kept even when cut short
    local name=$1
    shift
    [ "$(left)" -gt 60 ] || { echo "$name: skipped, no time left" | tee -a "$OUT/bench.log"; return; }
    timeout "$(left)" python3 "$@" 2>&1 | tee -a "$OUT/bench.log" | tail -25
  }
  for phase in ${PHASES:-prefill quant deltanet moe}; do
    case $phase in
    prefill)
      run prefill docs/benchmarks/bench_gpu_prefill.py --models l8,smol --tokens 512,4096 --repeats 3 \
        $(peer --llamacpp-bin $LLAMA --peers .work/peers) --out "$OUT/prefill.md"
      # the random F16 8B GGUF is the one llama-quantize starts from in the quant phase
      mkdir -p /tmp/hipc-quant
      mv /tmp/hipc-prefill/l8-f16.gguf /tmp/hipc-quant/llama3-8b-f16.gguf 2>/dev/null
      rm -rf /tmp/hipc-prefill ;;
    quant)
      waitllama
      run quant docs/benchmarks/bench_gpu_quant.py --meta .work/gpuq-meta --models "${QUANT_MODELS:-l8_q4_0,l8_q4_k_m,smol_q4_1}" \
        --activations int8 --repeats 3 $(peer --llamacpp-bin $LLAMA --peers .work/peers) \
        --profile "${PROFILE:-}" --out "$OUT/quant.md" ;;
    deltanet)
      run deltanet docs/benchmarks/bench_gpu_deltanet.py --out "$OUT/deltanet.md" ;;
    batching)  # issue 13: 1/8/32/64 clients through hipc serve, beside llama-batched-bench
      waitllama
      run batching docs/benchmarks/bench_gpu_batching.py --shape l8 --clients 1 8 32 64 \
        $(peer --llamacpp-bin $LLAMA --peers .work/peers) --out "$OUT/batching.md"
      rm -rf /tmp/hipc-bench ;;
    moeprof)  # 8 layers, per-kernel decode profile, hipc alone
      run moeprof docs/benchmarks/bench_gpu_moe.py --models qwen3 --layers qwen3=8 --repeats 1 \
        --profile --out "$OUT/moe-profile.md"
      rm -rf /tmp/hipc-moe-bench ;;
    moe)  # MOE_ACTIVATIONS=int16,int8: a hipc row each (int8: as the quant phase, and llama.cpp);
      # MOE_MODELS=qwen3_q4km,qwen3: the Q4_K_M file too
      waitllama
      run moe docs/benchmarks/bench_gpu_moe.py --models "${MOE_MODELS:-qwen3}" --repeats 2 \
        --activations "${MOE_ACTIVATIONS:-int16}" $(peer --llamacpp-bin $LLAMA) --out "$OUT/moe.md"
      rm -rf /tmp/hipc-moe-bench ;;
    olmoe)  # OLMoE-1B-7B shape, bf16 (~4 min: a 14 GB folder for hipc, then a 14 GB F16 GGUF)
      waitllama
      run olmoe docs/benchmarks/bench_gpu_moe.py --models olmoe --repeats 2 \
        $(peer --llamacpp-bin $LLAMA) --out "$OUT/moe-olmoe.md"
      rm -rf /tmp/hipc-moe-bench ;;
    hybrid)  # Qwen3.5-35B-A3B shape, Q4_0 (~20 GB written, compiled, then read by llama-bench);
      # HYBRID_TYPE=q4_k_m: llama-quantize's Q4_K_M types
      waitllama
      run hybrid docs/benchmarks/bench_gpu_hybrid.py --type "${HYBRID_TYPE:-q4_0}" --repeats 2 ${HYBRID_PROFILE:+--profile} \
        $(peer --llamacpp-bin $LLAMA) --out "$OUT/hybrid.md"
      rm -rf /tmp/hipc-hybrid-bench ;;
    esac
  done
  ;;
esac
