"""GPU batch-step time by rows: the prefill GEMMs (before) against the weights-once GEMV (after),
and the logits copy against the device-side top-k.

    python docs/benchmarks/bench_batch_gemv.py --layers 2 --rows 1 2 4 8 16 32 64 [--profile 8 32]

bench_gpu.py's random bf16 Llama-3-8B shape cut to --layers layers, compiled twice for sm_90:
"gemm" with HIPC_BATCH_GEMV_ROWS=0 and HIPC_BATCH_ATTN_GROUP=0 (every batch step on the
prefill GEMMs, its attention one head per block: as before) and "gemv" with the defaults
(batch steps of up to BATCH_GEMV_ROWS rows on linear_gemvm, the attention a KV head's query
heads per block). For each
R in --rows, R sequences at positions 128.. (a 128-token prompt's decode: the KV contents do
not change the work) step together on GpuBackend directly (no BatchEngine): `step` (the
logits of every row copied back, as the server gets them today) and, on "gemv", `step_top`
with k = 1 (greedy: R x 1 values back). Prints the median ms per step over --steps steps and
each against the 1-row step; --profile R: the last variant's R-row batch graph's kernels timed
one by one (CUDA events captured between them), with each GEMV's weight bytes per second.
--variants gemv32x: the batch GEMV up to 32 rows with x loaded a batch ahead (xpipe); gemv8:
session 7's defaults (linear_gemvm up to 8 rows, no shared-x kernel).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from hipc.runtime.engine import load_engine

CONTEXT = 1024
START = 128
# compile-time settings per variant (GpuProgramBuilder's environment knobs)
VARIANTS = {
    "gemm": {"HIPC_BATCH_GEMV_ROWS": "0", "HIPC_BATCH_ATTN_GROUP": "0"},  # before
    "gemv": {},  # the defaults
    "gemv32x": {"HIPC_BATCH_GEMV_ROWS": "32", "HIPC_BATCH_GEMV_XPIPE": "1"},  # being measured
    # session 7's defaults: linear_gemvm (no shared-x kernel) up to 8 rows, the GEMMs above
    "gemv8": {"HIPC_BATCH_GEMV_ROWS": "8", "HIPC_BATCH_GEMV_TUNED": "0"},
}


def artifact(layers: int, work: Path, variant: str) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_gpu

    s = list(bench_gpu.SHAPES["l8"])
    s[3] = layers
    bench_gpu.SHAPES["l8"] = tuple(s)
    folder, out = work / f"l8-{layers}", work / f"l8-{layers}-{variant}.hipc"
    if not (folder / "config.json").exists():
        t = time.perf_counter()
        bench_gpu.write_model("l8", folder)
        print(f"# wrote the {layers}-layer model in {time.perf_counter() - t:.1f} s", flush=True)
    if not out.exists():
        env = dict(os.environ)
        for var in ("HIPC_BATCH_GEMV_ROWS", "HIPC_BATCH_ATTN_GROUP", "HIPC_BATCH_GEMV_XPIPE",
                    "HIPC_BATCH_GEMV_TUNED"):  # fmt: skip
            env.pop(var, None)
        env.update(VARIANTS[variant])
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "hipc.cli.main", "compile", str(folder), "--target", "sm_90"]
        subprocess.run([*cmd, "-o", str(out), "-q", "--max-context", str(CONTEXT)], check=True,
                       env=env)  # fmt: skip
        print(f"# compiled {variant} in {time.perf_counter() - t:.1f} s", flush=True)
    return out


def inputs(b, R: int, step: int):
    per = b.kv_table
    tables = (np.arange(R * per, dtype=np.int32).reshape(R, per)) % b.kv_blocks
    ids = (np.arange(R) * 7919 + step) % b.vocab
    pos = np.full(R, START + step, np.int32)
    return ids, pos, np.arange(R, dtype=np.int32), tables, np.arange(R)


def time_steps(b, R: int, steps: int, top: int) -> float:
    for i in range(3):  # graph capture and warm-up
        args = inputs(b, R, i)
        b.step_top(*args, top) if top else b.step(*args)
    wall = []
    for i in range(steps):
        args = inputs(b, R, 3 + i)
        t = time.perf_counter()
        b.step_top(*args, top) if top else b.step(*args)
        wall.append(time.perf_counter() - t)
    return 1e3 * statistics.median(wall)


def profile(b, R: int) -> list[str]:
    from cuda.bindings import driver as cu

    b.step(*inputs(b, R, 0))  # the step's inputs and tables on the device
    B = next(x for x in b.buckets if x >= R)
    launches = b.gpu.batch(B) if R > 1 else b.gpu.decode
    d = b._driver
    events = [cu.cuEventCreate(0)[1] for _ in range(len(launches) + 1)]
    packed = [b._pack(x, B, B) for x in launches]
    external = cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL
    d.synchronize()
    d.begin_capture()
    cu.cuEventRecordWithFlags(events[0], d._stream, external)
    for k, x in enumerate(launches):
        b._launch(x, x.grid_dims(B, B), packed[k])
        cu.cuEventRecordWithFlags(events[k + 1], d._stream, external)
    timed = d.instantiate(d.end_capture())
    per: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    reps = 5
    for _ in range(reps):
        d.graph_launch(timed)
        d.synchronize()
        for k, x in enumerate(launches):
            per[x.kernel] += cu.cuEventElapsedTime(events[k], events[k + 1])[1] / reps
            count[x.kernel] += 1
    lines = [f"profile, {R} rows (bucket {B}), kernels back to back:"]
    for name, ms in sorted(per.items(), key=lambda kv: -kv[1]):
        n = count[name] // reps
        bw = ""
        parts = name.split("_")
        shape = next((p for p in parts if "x" in p and p.replace("x", "").isdigit()), None)
        if (
            shape
            and ("gemvm" in name or "_wg" in name or "gemv" in name)
            and not name.endswith("_xb")
        ):
            N, K = (int(v) for v in shape.split("x"))
            bw = f"  {2 * N * K * n / (ms / 1e3) / 1e12:5.2f} TB/s of weights"
        lines.append(f"  {name[:64]:64s} x{n:<3d} {ms * 1e3:9.1f} us{bw}")
    lines.append(f"  sum {sum(per.values()):.3f} ms, {len(launches)} launches")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", type=int, nargs="*", default=[])
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-bench"))
    ap.add_argument("--variants", nargs="+", default=["gemm", "gemv"], choices=list(VARIANTS))
    args = ap.parse_args()
    pool = max(args.rows) * CONTEXT
    table: dict[str, dict[int, float]] = {}
    notes: list[str] = []
    for variant in args.variants:
        eng = load_engine(artifact(args.layers, args.work, variant), target="cuda",
                          kv_pool_tokens=pool)  # fmt: skip
        b = eng.backend
        cols = [(f"{variant} logits", 0)] + ([(f"{variant} top-1", 1)] if variant == "gemv" else [])
        for col, top in cols:
            table[col] = {}
            for R in args.rows:  # printed as they come: a run cut short still shows them
                table[col][R] = time_steps(b, R, args.steps, top)
                print(f"# {col}: {R} rows {table[col][R]:.3f} ms", flush=True)
        if variant == args.variants[-1]:
            for R in args.profile:
                notes += profile(b, R)
        eng.close()
    for line in notes:
        print(line)
    print(f"\nLlama-3-8B shape bf16, {args.layers} layers, sm_90, positions {START}.., "
          f"median of {args.steps} steps (ms per step; x: against the same column's 1 row)")  # fmt: skip
    cols = list(table)
    print("| rows | " + " | ".join(cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for R in args.rows:
        cells = [f"{table[c][R]:.3f} ({table[c][R] / table[c][args.rows[0]]:.2f}x)" for c in cols]
        print(f"| {R} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
