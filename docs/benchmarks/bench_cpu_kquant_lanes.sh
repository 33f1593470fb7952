#!/usr/bin/env bash
# The CPU's K-quant row lanes (templates/cpu/linear_lanes_k.h) against the file's blocks
# (linear_vnni_k.h, HIPC_CPU_LANES=0) and llama.cpp, on the files llama-quantize makes with its
# default tensor types from one random 2-layer Llama of 2048-wide rows (ffn 5632: the shape
# where the file-block kernels read 0.6-0.8x llama.cpp's decode, session 27).
#
#   LLAMA=/path/to/llama.cpp/build/bin [TYPES="Q4_K_M Q5_K_M Q6_K Q3_K_M"] [THREADS="1 2"] \
#     bash docs/benchmarks/bench_cpu_kquant_lanes.sh [OUT.md]
#
# Each (type, threads) runs bench_cpu_moe.py twice with the same llama-bench beside it: the
# lanes artifact, then the file-blocks one (decode 64 tokens and one 64-token prefill, 3
# rounds). Needs AVX512-VNNI (else both artifacts are the file blocks). Tables go to OUT.md
# (default /tmp/kquant-lanes.md), the commands with them.
set -euo pipefail
LLAMA=${LLAMA:?set LLAMA to the directory of llama-bench and llama-quantize}
TYPES=${TYPES:-Q4_K_M Q5_K_M Q6_K Q3_K_M}
THREADS=${THREADS:-1 2}
OUT=${1:-/tmp/kquant-lanes.md}
WORK=${WORK:-/tmp/kquant-lanes}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$WORK"
if [ ! -f "$WORK/f32.gguf" ]; then
  PYTHONPATH="$HERE/../../tests" python -c "
import gguf_writer
from pathlib import Path
gguf_writer.write_numpy_gguf(Path('$WORK/f32.gguf'), 'F32', hidden=2048, ffn=5632)"
fi
: > "$OUT"
for t in $TYPES; do
  f="$WORK/$t.gguf"
  [ -f "$f" ] || "$LLAMA/llama-quantize" "$WORK/f32.gguf" "$f" "$t" > "$WORK/$t.quantize.log" 2>&1
  python -m hipc.cli.main compile "$f" --target cpu -o "$WORK/$t-lanes.hipc" -q --max-context 512
  HIPC_CPU_LANES=0 python -m hipc.cli.main compile "$f" --target cpu -o "$WORK/$t-file.hipc" -q \
    --max-context 512
  for n in $THREADS; do
    for layout in lanes file; do
      echo "#### $t, $layout, $n thread(s)" >> "$OUT"
      python "$HERE/bench_cpu_moe.py" --llama-bench "$LLAMA/llama-bench" --gguf "$f" \
        --artifact "$WORK/$t-$layout.hipc" --threads "$n" --tokens 64 --rounds 3 \
        --prefill-tokens 64 --out "$OUT" > /dev/null
    done
  done
done
grep -E "^#### |hipc / llama|^Prefill" "$OUT"
