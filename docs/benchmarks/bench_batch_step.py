"""Engine step time by rows: a BatchEngine decoding R sequences at once (cpu or GPU).

    python docs/benchmarks/bench_batch_step.py --artifact smol.hipc --threads 2 --rows 1 2 4 8
    python docs/benchmarks/bench_batch_step.py --gpu-shape smol [--layers 4] --rows 1 8 32 64

--gpu-shape NAME writes bench_gpu.py's random bf16 model of that shape (--layers of them)
into --work, compiles it for --gpu-target and runs it on the cuda backend; there the
one-sequence decode loop (`forward()` per token: the batch-1 path before batching) is
timed too, as the "forward" row.

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
import subprocess
import sys
import time
from pathlib import Path

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
        logits.update({s: row.copy() for s, row in be.step().items()})  # rows of one step
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


def forward_loop(engine, steps: int) -> dict:
    """One sequence decoding through engine.forward (no BatchEngine)."""
    ids = list(range(100, 116))
    tok = int(np.argmax(engine.forward(ids, 0)))
    wall = []
    for i in range(steps):
        w0 = time.perf_counter()
        tok = int(np.argmax(engine.forward([tok], 16 + i)))
        wall.append(time.perf_counter() - w0)
    ms = 1e3 * statistics.median(wall)
    return {"rows": "forward", "wall_ms": round(ms, 3), "cpu_ms": "", "tok_s": round(1e3 / ms, 1)}


def gpu_artifact(shape: str, layers: int | None, target: str, work: Path) -> Path:
    """bench_gpu.py's random model of `shape` compiled for `target` (reused when present)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_gpu

    if layers:
        s = list(bench_gpu.SHAPES[shape])
        s[3] = layers
        bench_gpu.SHAPES[shape] = tuple(s)
    name = f"{shape}-{layers or 'all'}"
    folder, artifact = work / name, work / f"{name}-{target}.hipc"
    if not artifact.exists():
        bench_gpu.write_model(shape, folder)
        cmd = [sys.executable, "-m", "hipc.cli.main", "compile", str(folder), "--target", target]
        subprocess.run([*cmd, "-o", str(artifact), "-q", "--max-context", "1024"], check=True)
    return artifact


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact")
    ap.add_argument("--gpu-shape", choices=["smol", "l8"])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--gpu-target", default="sm_90")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-bench"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if bool(args.artifact) == bool(args.gpu_shape):
        ap.error("give --artifact or --gpu-shape")
    rows_max = max(args.rows)
    if args.gpu_shape:
        artifact = gpu_artifact(args.gpu_shape, args.layers, args.gpu_target, args.work)
        engine = load_engine(artifact, target="cuda", kv_pool_tokens=256 * rows_max)
    else:
        engine = load_engine(
            args.artifact,
            target="cpu",
            threads=args.threads,
            max_context=256,
            kv_pool_tokens=256 * rows_max,
        )
    results = [forward_loop(engine, args.steps)] if args.gpu_shape else []
    results += [measure(engine, r, args.steps, engine.vocab_size) for r in args.rows]
    if args.json:
        print(json.dumps(results))
        return
    print("rows  wall ms/step  cpu ms/step  tok/s")
    for r in results:
        print(f"{r['rows']:>4}  {r['wall_ms']:>12}  {r['cpu_ms']:>11}  {r['tok_s']:>5}")


if __name__ == "__main__":
    main()
