"""Where a GPU decode step's time goes: each launch of the decode list timed alone.

    python docs/benchmarks/profile_gpu_decode.py ARTIFACT [--position 512]

Runs the decode launch list once per launch with a device sync around it (so the
numbers include launch overhead, ~5-10 us each) and prints the time per kernel kind,
then the whole step via the captured graph for comparison.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from hipc.runtime.backends.gpu_common import PackedArgs
from hipc.runtime.engine import load_engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--position", type=int, default=512)
    args = ap.parse_args()
    eng = load_engine(args.artifact, target="cuda")
    b = eng.backend
    ids = np.random.default_rng(0).integers(0, eng.vocab_size, args.position).tolist()
    eng.forward(ids, 0)
    b.forward(np.array([5]), args.position, False)  # captures the graph
    d = b._driver
    per_kind: dict[str, float] = defaultdict(float)
    for _ in range(3):
        for launch in b.gpu.decode:
            packed = PackedArgs(launch.resolve(b.bases, 1, 1))
            d.synchronize()
            t = time.perf_counter()
            b._launch(launch, launch.grid_dims(1, 1), packed)
            d.synchronize()
            kind = launch.kernel.rsplit("_", 1)[-1]
            per_kind[f"{launch.kernel.split('_')[0]}:{kind}"] += (time.perf_counter() - t) / 3
    for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"{k:32s} {v * 1e3:8.3f} ms per step")
    print(f"sum of synced launches: {sum(per_kind.values()) * 1e3:.3f} ms")
    n = 50
    t = time.perf_counter()
    for i in range(n):
        b.forward(np.array([5]), args.position + 1 + i, False)
    print(f"graph replay incl. copies: {(time.perf_counter() - t) / n * 1e3:.3f} ms per step")
    d.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        d.graph_launch(b._graph_exec)
    d.synchronize()
    print(f"graph replay alone: {(time.perf_counter() - t) / n * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
