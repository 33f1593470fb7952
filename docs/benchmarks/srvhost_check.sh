#!/usr/bin/env bash
# One short device call for the server's host work per token (issue 13), <= 120 s on an H200:
# 1. bench_gpu_batching.py on the Llama-3-8B shape cut to 2 layers (a step of 0.6-4.8 ms: where the
#    host, not the GPU, bounded 8 clients in session 5): 1/8/32/64 streamed clients through
#    `hipc serve`, aggregate decode tok/s, inter-token p50/p95, rows per step (first run of the
#    script on a GPU; it fails loudly on any short or broken stream).
# 2. bench_server_host.py on this machine's CPU (the host that serves the H200): host us per
#    row-token with a stub backend, 128k logits per row and device-picked token ids.
#   bash docs/benchmarks/srvhost_check.sh WHEEL_DIR      # results under $OUT/srvhost/
set -uo pipefail
OUT=${OUT:-/tmp/out}/srvhost
mkdir -p "$OUT"
source docs/benchmarks/install_wheels.sh "$1"
t0=$(date +%s)
timeout 85 python3 docs/benchmarks/bench_gpu_batching.py --shape l8 --layers 2 --clients 1 8 32 64 \
  --gen 128 --work /tmp/hipc-srvhost --out "$OUT/batching-2.md" >"$OUT/batching.log" 2>&1
echo "bench_gpu_batching: rc=$? ($(($(date +%s) - t0)) s)"
for mode in logits ids; do
  timeout 12 python3 docs/benchmarks/bench_server_host.py --tokenizer /tmp/hipc-srvhost/l8-2 \
    --streams 8 32 64 --tokens 64 --mode "$mode" >"$OUT/host-$mode.log" 2>&1
  echo "bench_server_host --mode $mode: rc=$? ($(($(date +%s) - t0)) s)"
done
tail -n 12 "$OUT/batching.log"
tail -n 5 "$OUT/host-logits.log" "$OUT/host-ids.log"
