"""CPU decode of one small llama-shaped model per weight type: which types decode at what rate.

    python docs/benchmarks/bench_cpu_kquant_types.py [--types q3_k,q4_k,q6_k] [--threads 1,2]

Each type gets a random GGUF (tests/gguf_writer.write_numpy_gguf: every matrix in that type,
hidden 2048, ffn 5632, 2 layers; blocks by hipc.compiler.quantize), compiled for the CPU at
the defaults; decode is the engine's `forward()` per token
(32 tokens, the best of 3 runs), and a 64-token prefill (the best of 3), each thread count in a
process of its own. GB/s counts the
file's bytes once per token (the model fits in a large L3: a compute rate, not a memory one).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))


def decode(artifact: str, threads: int, tokens: int) -> tuple[float, float]:
    """Decode tok/s and 64-token prefill tok/s, each the best of 3."""
    import numpy as np

    from hipc.runtime.engine import load_engine

    e = load_engine(artifact, target="cpu", threads=threads)
    best = prefill = 0.0
    for _ in range(3):
        e.reset()
        t = time.perf_counter()
        e.forward(list(range(1, 65)), 0)
        prefill = max(prefill, 64 / (time.perf_counter() - t))
        e.reset()
        tok, t = 1, time.perf_counter()
        for i in range(tokens):
            tok = int(np.argmax(e.forward([tok], i)))
        best = max(best, tokens / (time.perf_counter() - t))
    return best, prefill


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="q3_k,q4_k,q6_k")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--decode", nargs=2, metavar=("ARTIFACT", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.decode:
        print(*decode(args.decode[0], int(args.decode[1]), args.tokens))
        return
    from hipc.compiler.options import CompileOptions
    from hipc.compiler.pipeline import compile_model

    import gguf_writer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for wt in args.types.split(","):
            path = gguf_writer.write_numpy_gguf(
                Path(tmp) / f"{wt}.gguf", hidden=2048, ffn=5632, types=lambda n, wt=wt: wt
            )
            out = Path(tmp) / f"{wt}.hipc"
            compile_model(path, out, CompileOptions(max_context=128), verbose=False)
            mb = path.stat().st_size / 1e6
            for th in args.threads.split(","):
                cmd = [
                    sys.executable,
                    __file__,
                    "--decode",
                    str(out),
                    th,
                    "--tokens",
                    str(args.tokens),
                ]
                out_ = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                rate, prefill = (float(v) for v in out_.split())
                rows.append((wt, th, rate, rate * mb / 1e3, prefill, mb))
    print("| type | threads | decode tok/s | GB/s | prefill 64 tok/s | file MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for wt, th, rate, gbs, prefill, mb in rows:
        print(f"| {wt} | {th} | {rate:.1f} | {gbs:.1f} | {prefill:.0f} | {mb:.0f} |")


if __name__ == "__main__":
    main()
