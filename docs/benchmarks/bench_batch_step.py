"""Engine step time by rows: the cpu backend's BatchEngine decoding R sequences at once.

    python docs/benchmarks/bench_batch_step.py --artifact smol.hipc --threads 2 --rows 1 2 4 8

For each R: R sequences with distinct 16-token prompts are admitted and prefilled, then
--steps decode steps are timed (greedy, each sequence fed its argmax). Prints per step the
median wall ms and the process CPU ms (on a shared machine the CPU time is the steadier
figure: other engineers' work stretches wall time, not this process's CPU time), and the
aggregate tokens/s that the median wall time gives.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from hipc.runtime.batch import BatchEngine
from hipc.runtime.engine import load_engine


def measure(engine, rows: int, steps: int, vocab: int) -> dict:
    be = BatchEngine(engine, max_batch=rows)
    rng = np.random.default_rng(rows)
    seqs = []
    for _ in range(rows):
        prompt = rng.integers(100, min(vocab, 20000), 16).tolist()
        seq = be.admit(prompt, 16 + steps + 4)
        if seq is None:
            raise SystemExit(f"--rows {rows}: the KV pool cannot hold {rows} sequences")
        seqs.append(seq)
    logits: dict = {}
    while len(logits) < rows:  # prefill
        logits.update(be.step())
    wall, cpu = [], []
    for _ in range(steps):
        for s in seqs:
            be.feed(s, int(np.argmax(logits[s])))
        w0, c0 = time.perf_counter(), time.process_time()
        logits = be.step()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
        assert be.last_batch == rows
    for s in seqs:
        be.release(s)
    ms = 1e3 * statistics.median(wall)
    return {
        "rows": rows,
        "wall_ms": round(ms, 2),
        "cpu_ms": round(1e3 * statistics.median(cpu), 2),
        "tok_s": round(rows / ms * 1e3, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows_max = max(args.rows)
    engine = load_engine(
        args.artifact,
        target="cpu",
        threads=args.threads,
        max_context=256,
        kv_pool_tokens=256 * rows_max,
    )
    results = [measure(engine, r, args.steps, engine.vocab_size) for r in args.rows]
    if args.json:
        print(json.dumps(results))
        return
    print("rows  wall ms/step  cpu ms/step  tok/s")
    for r in results:
        print(f"{r['rows']:>4}  {r['wall_ms']:>12}  {r['cpu_ms']:>11}  {r['tok_s']:>5}")


if __name__ == "__main__":
    main()
