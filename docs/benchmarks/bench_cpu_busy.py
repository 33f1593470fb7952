"""CPU decode speed when other processes compete for the cores.

Run:
    python docs/benchmarks/bench_cpu_busy.py ARTIFACT [--competitors 0,2] [--repeats 3]
        [--decode-tokens 48] [--threads N] [--spins 5000,20000]

For each number of competitors (busy `yes > /dev/null` processes started for the run),
each wait setting below decodes --decode-tokens greedy tokens after a 16-token prompt in
a fresh process (libgomp reads its settings once, when it loads), rounds interleaved;
the table has the median decode tokens/s and the range.

  runtime default   no OMP_* / GOMP_* variable: what hipc chooses (runtime/backends/cpu.py)
  libgomp default   GOMP_SPINCOUNT=300000, libgomp's own spin when OMP_WAIT_POLICY is unset
  passive           OMP_WAIT_POLICY=passive: sleep at once at every barrier
  1 thread          OMP_NUM_THREADS=1: no barriers to wait at
  spin N            GOMP_SPINCOUNT=N (--spins)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

SETTINGS = {
    "runtime default": {},
    "libgomp default": {"GOMP_SPINCOUNT": "300000"},
    "passive": {"OMP_WAIT_POLICY": "passive"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}

LOOP = """
import sys, time
import numpy as np
from hipc.runtime.engine import load_engine
engine = load_engine(sys.argv[1])
n = int(sys.argv[2])
pos, tok = 16, int(np.argmax(engine.forward(list(range(100, 116)), 0)))
for _ in range(4):
    tok = int(np.argmax(engine.forward([tok], pos))); pos += 1
t0 = time.perf_counter()
for _ in range(n):
    tok = int(np.argmax(engine.forward([tok], pos))); pos += 1
print(n / (time.perf_counter() - t0))
"""


def decode_tps(artifact: str, n: int, env: dict) -> float:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", LOOP, artifact, str(n)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--competitors", default="0,2", help="comma-separated counts of busy processes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS (default: unset)")
    ap.add_argument("--spins", default="", help="comma-separated GOMP_SPINCOUNT settings to add")
    args = ap.parse_args()
    settings = dict(SETTINGS)
    for spin in filter(None, args.spins.split(",")):
        settings[f"spin {spin}"] = {"GOMP_SPINCOUNT": spin}
    base = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    print(f"cores: {len(os.sched_getaffinity(0))}, load average before: {os.getloadavg()}")
    print("| competitors | setting | decode tok/s (median) | range |")
    print("|---|---|---|---|")
    for count in (int(c) for c in args.competitors.split(",")):
        busy = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(count)]
        try:
            runs: dict[str, list[float]] = {name: [] for name in settings}
            for _ in range(args.repeats):
                for name, env in settings.items():
                    runs[name].append(
                        decode_tps(args.artifact, args.decode_tokens, {**base, **env})
                    )
        finally:
            for p in busy:
                p.kill()
                p.wait()
        for name, values in runs.items():
            print(
                f"| {count} | {name} | {statistics.median(values):.1f} | "
                f"{min(values):.1f}-{max(values):.1f} |"
            )
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
