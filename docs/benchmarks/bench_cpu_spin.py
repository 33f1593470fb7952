"""CPU decode rate against libgomp's barrier spin (GOMP_SPINCOUNT), each setting in processes
of its own, rounds alternating (the spin is read once, when libgomp loads).

    python docs/benchmarks/bench_cpu_spin.py ARTIFACT [--threads 2] [--spins 1000,5000,20000]
        [--rounds 4] [--tokens 60]

The runtime sets GOMP_SPINCOUNT=1000 unless the user chose a wait policy
(runtime/backends/cpu.py, for busy machines: cpu-busy.md); this measures what that costs on an
idle one. Each process decodes `tokens` greedy steps from position 0 twice and reports the
better; printed: per setting the median and every round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def decode(artifact: str, threads: int, tokens: int) -> float:
    import numpy as np

    from hipc.runtime.engine import load_engine

    engine = load_engine(artifact, threads=threads)
    engine.forward([1], 0)
    best = 0.0
    for _ in range(2):
        engine.reset()
        tok, t0 = 1, time.perf_counter()
        for pos in range(tokens):
            tok = int(np.argmax(engine.forward([tok], pos)))
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spins", default="1000,5000,20000,100000")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(decode(args.artifact, args.threads, args.tokens))
        return
    rates: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for spin in args.spins.split(","):
            env = dict(os.environ, GOMP_SPINCOUNT=spin)
            cmd = [sys.executable, __file__, args.artifact, "--one", "--threads",
                   str(args.threads), "--tokens", str(args.tokens)]  # fmt: skip
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            rates.setdefault(spin, []).append(float(out.stdout))
    print(f"| GOMP_SPINCOUNT | decode tok/s, median | rounds ({args.threads} threads) |")
    print("|---:|---:|---|")
    for spin, v in rates.items():
        print(f"| {spin} | {statistics.median(v):.1f} | {', '.join(f'{x:.0f}' for x in v)} |")


if __name__ == "__main__":
    main()
