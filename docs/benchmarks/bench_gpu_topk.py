"""The device pick after a step: the row top-k kernel and the several-block ones, alone.

    python docs/benchmarks/bench_gpu_topk.py [--vocab 128256,49152] [--rows 1,64]

Each kernel is launched back to back on one row buffer (logits in L2 after the first, as
after a step's LM head), a few hundred launches captured as a graph and timed per launch: the one-block row
top-k (templates/hip/topk.hip.j2, `hipc_topk`) at k = 1 and 40, the pick kernel
(`hipc_topk_pick`, k = 1 on several blocks a row, codegen's greedy_geometry) greedy and drawing
at temperature 0.8, and the split one at k = 40 (`hipc_topk_split`, the same blocks), with a copy
of the row back to the host (what a step without a device pick copies) for scale. Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from hipc.base.launch_plan import TOPK_MAX  # noqa: E402
from hipc.compiler.codegen.hip import (  # noqa: E402
    GREEDY_BLOCK,
    TOPK_BLOCK,
    TOPK_KERNEL,
    greedy_geometry,
)
from hipc.compiler.targets import GpuTarget  # noqa: E402

from gpu_kernels import DeviceKernels  # noqa: E402

LAUNCHES = 300


def per_launch_us(d, launch) -> float:
    """GPU us a launch: LAUNCHES of them captured as one graph, replayed (a launch from
    Python alone costs ~10 us of host time, more than these kernels)."""
    d.synchronize()
    d.begin_capture()
    for _ in range(LAUNCHES):
        launch()
    graph = d.end_capture()
    ge = d.instantiate(graph)
    try:
        d.graph_launch(ge)
        d.synchronize()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            d.graph_launch(ge)
            d.synchronize()
            best = min(best, (time.perf_counter() - t) / LAUNCHES * 1e6)
        return best
    finally:
        d.destroy_graph(graph, ge)


def time_rows(k: DeviceKernels, vocab: int, rows: int, blocks: int) -> tuple[float, ...]:
    """us a launch: hipc_topk at k = 1 and 40, the pick kernel greedy and drawing, the split
    kernel at k = 40, the rows copied back."""
    d = k.d
    x = np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32)
    px = k.upload(x)
    out = k.upload(np.zeros((rows, 2 * TOPK_MAX + 2), np.float32))
    parts = k.upload(np.zeros((rows, blocks, 2 * TOPK_MAX + 2), np.float32))
    counters = k.upload(np.zeros(rows, np.uint32))
    greedy_draws = k.upload(np.zeros((rows, 2), np.float32))
    draws = np.stack([np.full(rows, 1 / 0.8), np.random.default_rng(1).random(rows)], 1)
    temperature_draws = k.upload(draws.astype(np.float32))
    host = d.host_malloc(4 * rows * vocab)  # pinned, as the runtime's logits

    def topk(kk):
        k.launch(TOPK_KERNEL, [rows], TOPK_BLOCK,
                 [("u64", px), ("i32", vocab), ("i32", kk), ("u64", out),
                  ("u64", out + 4 * rows * kk), ("u64", out + 8 * rows * kk)])  # fmt: skip

    def pick(draw):
        k.launch(f"{TOPK_KERNEL}_pick", [blocks, rows], GREEDY_BLOCK,
                 [("u64", px), ("i32", vocab), ("u64", out), ("u64", out + 4 * rows),
                  ("u64", out + 8 * rows), ("u64", parts), ("u64", counters),
                  ("u64", draw)])  # fmt: skip

    def split(kk):
        k.launch(f"{TOPK_KERNEL}_split", [blocks, rows], GREEDY_BLOCK,
                 [("u64", px), ("i32", vocab), ("i32", kk), ("u64", out),
                  ("u64", out + 4 * rows * kk), ("u64", out + 8 * rows * kk), ("u64", parts),
                  ("u64", counters)])  # fmt: skip

    try:
        return (
            per_launch_us(d, lambda: topk(1)),
            per_launch_us(d, lambda: topk(40)),
            per_launch_us(d, lambda: pick(greedy_draws)),
            per_launch_us(d, lambda: pick(temperature_draws)),
            per_launch_us(d, lambda: split(40)),
            per_launch_us(d, lambda: d.d2h(host, px, 4 * rows * vocab)),
        )
    finally:
        d.host_free(host)
        k.free()


def build_for(per_thread: int):
    def build(arch):
        ctx = {"max_k": TOPK_MAX, "wave": GpuTarget(arch).wave,
               "greedy_block": GREEDY_BLOCK, "greedy_per_thread": per_thread}  # fmt: skip
        return [(TOPK_KERNEL, "topk", ctx, 0)]

    return build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", default="128256,49152")
    ap.add_argument("--rows", default="1,64")
    args = ap.parse_args()
    print("| vocab | rows | hipc_topk k=1 | hipc_topk k=40 | hipc_topk_pick greedy (blocks) | "
          "pick at temperature 0.8 | hipc_topk_split k=40 | row copy |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for vocab in (int(v) for v in args.vocab.split(",")):
        blocks, per_thread = greedy_geometry(vocab)
        k = DeviceKernels(build_for(per_thread))  # the template places the per-thread count
        for rows in (int(r) for r in args.rows.split(",")):
            t1, t40, tg, tt, ts, tc = time_rows(k, vocab, rows, blocks)
            print(f"| {vocab:,} | {rows} | {t1:.1f} | {t40:.1f} | {tg:.1f} ({blocks}) | {tt:.1f} "
                  f"| {ts:.1f} | {tc:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
