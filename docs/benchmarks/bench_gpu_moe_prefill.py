"""The MoE prefill chain alone at real shapes: each kernel's time per step, per tile height.

    python docs/benchmarks/bench_gpu_moe_prefill.py [--shapes qwen3,qwen35] [--tokens 512,4096]
        [--rows 64,32,16] [--out FILE.md] [--prebuild sm_90 --cache DIR]

Shapes (Q4_0 experts, a float32 router with its RMSNorm fused in, hidden 2048, 8 of E
experts): qwen3 = Qwen3-30B-A3B (128 experts of 768), qwen35 = Qwen3.5-35B-A3B (256 of 512).
For each shape, tile height (rows per grouped-GEMM tile, compiler/kernels/moe.py's
tile_rows: the compiled choice is marked), x's precision (bf16 hi + lo, or bf16 once: the
default --prefill-precision) and step size T: _route, _group, _gate_up, _down
and _combine as compiler/kernels/moe.py launches them, each timed alone (host wall time
over back-to-back launches, synchronised once: an upper bound by a few us of launch
overhead), with the useful TFLOP/s of the two GEMMs (T x k rows, 3 matmuls of H x F).
Random weights (finite scales), random x: the router spreads the rows about evenly, as
a model's does on average. Code objects come from HIPC_KERNEL_CACHE / --cache when built
ahead (--prebuild ARCH, on a machine with no GPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from hipc.compiler.kernels.moe import (  # noqa: E402
    ROUTING,
    MoEParams,
    gpu_kernels,
    tile_rows,
)
from hipc.compiler.passes.repack import split_quant_blocks  # noqa: E402
from hipc.compiler.targets import GpuTarget  # noqa: E402

SHAPES = {"qwen3": (128, 768), "qwen35": (256, 512)}  # experts, expert width
H, K = 2048, 8


def params(shape: str) -> MoEParams:
    E, F = SHAPES[shape]
    return MoEParams("q4_0", E, K, H, F, True, False, True, "float32", 1e-6)


def kernel_sets(arch: str, shapes, rows_list, precisions, t_max: int):
    """{(shape, rows, precision): MoEGpu} and the specs to build (the prefill and mma
    templates only)."""
    sets, specs = {}, [(ROUTING.fn, ROUTING.template, ROUTING.ctx, None)]
    for shape in shapes:
        for rows in rows_list:
            for prec in precisions:
                m = gpu_kernels(f"b_{shape}_{rows}_{prec}", params(shape), GpuTarget(arch), ["b"],
                                t_max, rows=rows, split=prec == "split")  # fmt: skip
                sets[shape, rows, prec] = m
                specs += [(k.fn, k.template, k.ctx, None) for k in (m.prefill, m.mma) if k]
    return sets, specs


def q4_0_experts(rng, rows: int, cols: int) -> np.ndarray:
    """[rows, cols / 32 * 18] Q4_0 bytes, split as the artifact stores them: random quants,
    f16 scales of 2^-7."""
    blocks = rng.integers(0, 256, (rows * (cols // 32), 18), dtype=np.uint8)
    blocks[:, 0], blocks[:, 1] = 0x00, 0x20
    return split_quant_blocks(blocks.reshape(rows, -1), "q4_0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3,qwen35")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--rows", default="64,32,16")
    ap.add_argument("--precisions", default="split,bf16", help="x as bf16 hi + lo, or once")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out")
    ap.add_argument("--prebuild", metavar="ARCH", help="build the code objects only")
    ap.add_argument("--cache", type=Path, help="code objects by source hash")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    precisions = args.precisions.split(",")
    t_max = max(tokens)
    from gpu_kernels import DeviceKernels, compiled, kernels_source

    if args.prebuild:
        _, specs = kernel_sets(args.prebuild, shapes, rows_list, precisions, t_max)
        compiled(kernels_source(specs, args.prebuild), args.prebuild, args.cache)
        return
    sets = {}

    def build(arch):
        s, specs = kernel_sets(arch, shapes, rows_list, precisions, t_max)
        sets.update(s)
        return specs

    dev = DeviceKernels(build, cache=args.cache)
    rng = np.random.default_rng(0)
    x = dev.upload(rng.standard_normal((t_max, H)).astype(np.float32))
    norm_w = dev.upload(np.ones(H, np.float32))
    pairs = t_max * K
    u64 = lambda *ps: [("u64", p) for p in ps]  # noqa: E731
    lines = [
        f"# MoE prefill kernels, Q4_0 experts ({dev.arch}), us per step",
        "",
        "| shape | T | rows per tile | x | tiles | route | group | gate_up | down | combine | "
        "total | GEMM TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in shapes:
        E, F = SHAPES[shape]
        router = dev.upload((rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32))
        gate, up = (dev.upload(q4_0_experts(rng, E * F, H)) for _ in range(2))
        down = dev.upload(q4_0_experts(rng, E * H, F))
        xn, lg = (
            dev.upload(np.zeros((t_max, H), np.float32)),
            dev.upload(np.zeros((t_max, E), np.float32)),
        )
        cnt = dev.upload(np.zeros(1, np.uint32))
        ids, w, src, pos = (dev.upload(np.zeros(pairs, np.int32)) for _ in range(4))
        act = dev.upload(np.zeros(pairs * F, np.float32))
        out = dev.upload(np.zeros(pairs * H, np.float32))
        y = dev.upload(np.zeros((t_max, H), np.float32))
        for (sh, rows, prec), m in sets.items():
            if sh != shape:
                continue
            tiles = dev.upload(np.zeros(3 * m.max_tiles + 1, np.int32))
            pre, gu, dn = m.prefill.fn, m.gate_up, m.down
            tt = m.prefill.ctx["route_tokens"]
            for T in tokens:
                # (kernel, grid, threads, arguments, shared bytes), as moe.py launches them
                steps = {
                    "route": (f"{pre}_route", [-(-T // tt)], 256,
                              [("i32", T), *u64(x, norm_w, router, xn, lg, cnt, ids, w)], 0),
                    "group": (f"{pre}_group", [1], 1024,
                              [*u64(ids), ("i32", T), *u64(src, pos, tiles)], 0),
                    "gate_up": (gu.kernel, [gu.blocks_x, m.max_tiles], gu.threads,
                                u64(xn, src, tiles, gate, up, act), gu.shared),
                    "down": (dn.kernel, [dn.blocks_x, m.max_tiles], dn.threads,
                             u64(act, tiles, down, out), dn.shared),
                    "combine": (f"{pre}_combine", [T], 256, u64(out, pos, w, y, y), 0),
                }  # fmt: skip
                times = {}
                for name, launch in steps.items():  # in order: each leaves what the next reads
                    dev.launch(*launch)
                    dev.d.synchronize()
                    t = time.perf_counter()
                    for _ in range(args.reps):
                        dev.launch(*launch)
                    dev.d.synchronize()
                    times[name] = (time.perf_counter() - t) / args.reps * 1e6
                n_tiles = int(dev.read(tiles, 3 * m.max_tiles + 1, np.int32)[-1])
                flops = 2 * T * K * 3 * H * F
                gemm = times["gate_up"] + times["down"]
                mark = " (compiled)" if rows == tile_rows(T, params(shape), dev.arch) else ""
                lines.append(
                    f"| {shape} | {T} | {rows}{mark} | {prec} | {n_tiles} | "
                    + " | ".join(f"{times[k]:.1f}" for k in steps)
                    + f" | {sum(times.values()):.1f} | {flops / gemm / 1e6:.1f} |"
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    dev.close()


if __name__ == "__main__":
    main()
