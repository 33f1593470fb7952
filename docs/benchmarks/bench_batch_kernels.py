"""The batch GEMV (linear_gemvm) alone at the Llama-3-8B linear shapes: weight bytes per second
by rows and geometry, beside the device's copy rate.

    python docs/benchmarks/bench_batch_kernels.py [--cache .work/fatbins] [--prebuild sm_90]

For each shape (qkv with its norm, o with the residual, gate/up GLU with its norm, down with the
residual, the LM head with the norm), each size class of rows (n tiles 1, 2, 4, 8 at 8 x nt rows,
and 2 rows on the 1-tile kernel) and each geometry of GEOMETRIES (warps splitting K, k chunks in
flight per warp): the kernel's median time over --reps launches between CUDA events (the _xb
pass not included: it is its own launch of T blocks), as TB/s of weights; norm-less shapes
also with x through an _xb pass (bf16 rows: half the bytes of x each block reads). --prebuild ARCH
compiles the code object into --cache on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).parents[2] / "tests")]

from hipc.compiler.kernels.linear import GEMVM_UNROLL, LinearParams, batch_gemv  # noqa: E402
from hipc.compiler.targets import GpuTarget  # noqa: E402

SHAPES = {  # name: N weight rows, K, epilogue, norm
    "qkv": (6144, 4096, "none", True),
    "o": (4096, 4096, "residual", False),
    "gate_up": (28672, 4096, "glu", True),
    "down": (4096, 14336, "residual", False),
    "head": (128256, 4096, "none", True),
}
# (warps, unroll or None for GEMVM_UNROLL's, 16-row tiles per block, x through _xb even without
# a norm, x loaded a batch ahead): the default first
GEOMETRIES = [
    (8, None, 1, False, False),
    (4, 4, 1, False, False),
    (8, None, 1, False, True),
    (8, None, 2, False, True),
    (8, None, 2, False, False),
    (8, None, 1, True, False),
    (8, None, 1, True, True),
]


def label(warps: int, u: int, mt: int, xb: bool, xpipe: bool) -> str:
    return f"w{warps}u{u}m{mt}" + ("x" if xb else "") + ("p" if xpipe else "")


def kernels(target: GpuTarget):
    out = {}
    for name, (N, K, ep, norm) in SHAPES.items():
        p = LinearParams("bfloat16", N, K, 1e-5 if norm else 0.0, ep, False)
        for nt in (1, 2, 4, 8):
            for warps, unroll, mt, xb, xpipe in GEOMETRIES:
                u = unroll or GEMVM_UNROLL[nt]
                if warps * nt * mt > 64 or u * nt > 16 or (xb and norm):
                    continue  # static shared / x registers / the norm has its _xb anyway
                tag = label(warps, u, mt, xb, xpipe)
                out[name, nt, tag] = batch_gemv(
                    f"{name}_{tag}", p, target, [name], nt, warps, u, mt, xb or None, xpipe
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--prebuild", metavar="ARCH")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    from gpu_kernels import DeviceKernels, compiled, kernels_source

    if args.prebuild:
        ks = kernels(GpuTarget(args.prebuild))
        specs = [(k.fn, k.template, k.ctx, 0) for k in ks.values()]
        compiled(kernels_source(specs, args.prebuild), args.prebuild, args.cache)
        print(f"{len(specs)} kernels built into {args.cache}")
        return
    from cuda.bindings import driver as cu

    from hipc.runtime.backends.gpu_common import PackedArgs

    ks: dict = {}

    def build(arch):
        ks.update(kernels(GpuTarget(arch)))
        return [(k.fn, k.template, k.ctx, 0) for k in ks.values()]

    dk = DeviceKernels(build, cache=args.cache)
    d = dk.d
    rng = np.random.default_rng(0)
    base = rng.integers(0, 0x3F80, 1 << 24, dtype=np.uint16)  # bf16 in [0, 1), tiled
    ev = [cu.cuEventCreate(0)[1] for _ in range(2)]

    def timed(fn, grid, block, packed) -> float:
        times = []
        for _ in range(args.reps):
            cu.cuEventRecord(ev[0], d._stream)
            d.launch(fn, grid, block, 0, packed.address)
            cu.cuEventRecord(ev[1], d._stream)
            d.synchronize()
            times.append(cu.cuEventElapsedTime(ev[0], ev[1])[1])
        return statistics.median(times)

    # the copy rate: a device-to-device copy of 1 GiB (read + write)
    n = 1 << 30
    a, b = d.malloc(n), d.malloc(n)
    d.d2d(b, a, n)
    d.synchronize()
    cu.cuEventRecord(ev[0], d._stream)
    for _ in range(5):
        d.d2d(b, a, n)
    cu.cuEventRecord(ev[1], d._stream)
    d.synchronize()
    copy = 2 * n * 5 / (cu.cuEventElapsedTime(ev[0], ev[1])[1] / 1e3) / 1e12
    d.free(a)
    d.free(b)
    print(f"device copy: {copy:.2f} TB/s (read + write)")
    rows_of = {1: (2, 8), 2: (16,), 4: (32,), 8: (64,)}
    results: dict = {}
    for name, (N, K, ep, _) in SHAPES.items():
        n_out = N // 2 if ep == "glu" else N
        w = dk.upload(np.resize(base, N * K))
        x = dk.upload(rng.standard_normal(64 * K).astype(np.float32) * 0.1)
        xb = dk.upload(np.full(64 * K, 0x3F80, np.uint16))
        y = dk.upload(np.zeros(64 * n_out, np.float32))
        for (sname, nt, geom), k in ks.items():
            if sname != name:
                continue
            src = xb if k.ctx["xb"] else x
            for T in rows_of[nt]:
                args_ = [("u64", src), ("i32", T), ("u64", w), ("u64", 0), ("u64", 0),
                         ("u64", 0), ("u64", y), ("u64", y)]  # fmt: skip
                ms = timed(dk.function(k.fn), (k.grid[0], 1, 1), (k.threads, 1, 1),
                           PackedArgs(args_))  # fmt: skip
                results[name, T, geom] = 2 * N * K / (ms / 1e3) / 1e12
                print(f"# {name} rows {T} {geom}: {ms * 1e3:.1f} us "
                      f"{results[name, T, geom]:.2f} TB/s", flush=True)  # fmt: skip
        dk.free()
    geoms = list(dict.fromkeys(g for _, _, g in results))
    print(f"\nbatch GEMV, TB/s of weights (copy {copy:.2f}); columns: w warps, u chunks in "
          "flight, m 16-row tiles per block, x: x through _xb (its pass not timed), p: x a "
          "batch ahead")  # fmt: skip
    print("| shape | rows | " + " | ".join(geoms) + " |")
    print("|---|---:|" + "---:|" * len(geoms))
    for name in SHAPES:
        for T in (2, 8, 16, 32, 64):
            cells = [results.get((name, T, g)) for g in geoms]
            if any(c is not None for c in cells):
                txt = " | ".join("" if c is None else f"{c:.2f}" for c in cells)
                print(f"| {name} | {T} | {txt} |")
    dk.close()


if __name__ == "__main__":
    main()
