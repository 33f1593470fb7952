#!/usr/bin/env bash
# A mid-session call (session 6): helpers' check scripts from .work/mid/NAME (synced copies of
# their worktrees), one after another with their own time caps, one log each, while llama.cpp's
# CUDA build runs in the background. Its last step packs that build into $OUT/llamabin.part-*
# (xz, 15 MB parts): copied to .work/llamabin here, gpu_session.sh unpacks them in later calls
# instead of building (~5 minutes).
set -u
T0=$SECONDS
nvidia-smi -L
setsid nohup nice -n 10 bash .work/peers/build_llamacpp_cuda.sh "$PWD/.work/llama" >/tmp/lb.log 2>&1 </dev/null &
check() {  # NAME CAP COMMAND
  local name=$1 cap=$2; shift 2
  local left=$((${BUDGET:-480} - (SECONDS - T0)))
  [ "$left" -gt 40 ] || { echo "=== $name: skipped (no time)"; return; }
  [ "$cap" -gt "$left" ] && cap=$left
  echo "=== $name (start $((SECONDS - T0)) s, cap $cap s)"
  rm -rf /tmp/site
  (cd ".work/mid/$name" && OUT=/tmp/o/$name timeout "$cap" bash -c "$*") >"$OUT/$name.log" 2>&1
  echo "rc=$? at $((SECONDS - T0)) s" | tee -a "$OUT/$name.log"
  find /tmp/o/$name -type f 2>/dev/null | while read -r f; do echo "----- $f"; head -c 60000 "$f"; done >>"$OUT/$name.log"
  tail -25 "$OUT/$name.log"
}
check flash 125 "bash docs/benchmarks/flash_check.sh"
check moedec 115 "bash docs/benchmarks/moedec_check.sh"
check declat 120 "bash docs/benchmarks/declat_check.sh"
check batchgemv 100 "bash docs/benchmarks/batchgemv_check.sh"
echo "=== llama.cpp build at $((SECONDS - T0)) s"
for _ in $(seq 60); do [ -x /tmp/llama.cpp/build/bin/llama-batched-bench ] && break; sleep 2; done
tail -3 /tmp/lb.log
if [ -x /tmp/llama.cpp/build/bin/llama-batched-bench ]; then
  ls -la /tmp/llama.cpp/build/bin
  tar -C /tmp/llama.cpp/build -cf - bin | xz -T0 -6 | split -b 15M - "$OUT/llamabin.part-"
  ls -la "$OUT"
fi
echo "done at $((SECONDS - T0)) s"
