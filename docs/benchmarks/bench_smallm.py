"""The batch step's bf16 linears (small-M GEMMs) at the Llama-3-8B shapes: the current batch GEMV
("base", linear_gemvm) against its variants, at 8, 16, 32 and 64 rows, beside the copy rate.

    python docs/benchmarks/bench_smallm.py [--cache DIR] [--prebuild sm_90] [--out DIR]

Per shape (qkv 6144x4096 and gate/up 28672x4096 GLU with their norm's _xb pass, o 4096x4096 with
the residual and bf16 x as the attention hands it over in batch steps, down 4096x14336 with the
residual and float32 x, as the batch plans bind them; and the 128256x4096 LM head with a few
of the variants), rows and variant: the kernel's median time over
--reps launches between CUDA events (L2 overwritten before each; the _xb pass not included), as TB/s of weights and as a
share of the device-to-device copy rate measured first (read + write counted, as every hipc
table does); each variant's output against base's on the same inputs (relative error: a
broken geometry shows). Then a 32-layer chain of a layer's four linears (qkv, o, gate/up, down,
the norm shapes with their _xb pass; 32 distinct weight sets, 14 GB, so nothing stays in L2),
captured as one CUDA graph with the overlap launches of a batch plan: ms per chain and TB/s, for
base, each uniform variant family and "best" (each shape's fastest variant at those rows in this
run). Results as JSON and markdown under --out (default $OUT/smallm). --prebuild ARCH compiles
the code object into --cache on a machine with no GPU.

Variants: "base" = linear_gemvm with session 7's geometry (gemvm_plain), "base-p" x a batch
ahead, "base-m2p" two 16-row tiles a block and x a batch ahead ("base-w4m2p" the same with 4
warps, "base-w2m4p" 2 warps of 4 tiles); "aWxMuU" = batch_gemv_split (linear_gemvs) with W warps of M tiles and U chunks in
flight, x double-buffered by cp.async ("-3b": three buffers, one barrier a piece), K split so
the grid is about 8 warps per SM ("-hs": half those splits); "gemm" the wgmma GEMM (the batch steps' linear above 8 rows in session 7);
"default" what the compiler picks now (gemvm_geometry up to gemvm_rows, else the GEMM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).parents[2] / "tests")]

from hipc.compiler.kernels.linear import (  # noqa: E402
    BATCH_GEMV_ROWS,
    GEMVM_WARPS,
    LinearParams,
    batch_gemv,
    batch_gemv_split,
    gemvm_geometry,
    gemvm_kernel,
    gemvm_plain,
    gemvm_rows,
    gemvs_splits,
    prefill_gemm,
    select_wgmma,
)
from hipc.compiler.targets import GpuTarget  # noqa: E402

SHAPES = {  # name: N weight rows, K, epilogue, norm
    "qkv": (6144, 4096, "none", True),
    "o": (4096, 4096, "residual", False),  # x: bf16 rows from the attention (BF16_IN)
    "gate_up": (28672, 4096, "glu", True),
    "down": (4096, 14336, "residual", False),
}
# timed alone too: the LM head (not in the chain; it runs once a step), with fewer variants
ALONE = {**SHAPES, "head": (128256, 4096, "none", True)}
HEAD_VARIANTS = {"base", "base-p", "a4x2u4", "a8x1u4", "a8x2u2", "gemm", "default"}
BF16_IN = {"o"}
FLUSH = 256 << 20  # bytes written between timed launches
ROWS = (8, 16, 32, 64)
# batch_gemv_split geometries: (warps, mt, unroll, splits factor, x buffers filled by cp.async); a geometry
# whose x pieces pass 48 KiB of shared memory runs with half the chunks in flight
# (session 8's first call also had the plain-staged s4x2u4, s8x1u4, s4x1u8, s4x4u2, s2x2u4 and
# a4x2u4 with twice the splits: slower than these everywhere)
SPLITS = {
    "a4x2u4": (4, 2, 4, 1, 2),
    "a4x2u4-hs": (4, 2, 4, 0.5, 2),
    "a8x1u4": (8, 1, 4, 1, 2),
    "a8x2u2": (8, 2, 2, 1, 2),
    "a4x2u4-3b": (4, 2, 4, 1, 3),
    "a8x1u4-3b": (8, 1, 4, 1, 3),
}
GEMM_TILES: dict = {}  # the prefill GEMMs' wgmma tiles, by kernel name
BASES = {  # linear_gemvm: session 7's geometry (gemvm_plain) and these changes
    "base": {},
    "base-p": dict(xpipe=True),
    "base-m2p": dict(mt=2, xpipe=True),
    "base-w4m2p": dict(warps=4, mt=2, xpipe=True),
    "base-w2m4p": dict(warps=2, mt=4, xpipe=True),
}


def split_count(p: LinearParams, warps: int, mt: int, unroll: int, factor: float) -> int:
    return gemvs_splits(p, warps, mt, unroll, factor)


def params(name: str) -> LinearParams:
    N, K, ep, norm = ALONE[name]
    return LinearParams("bfloat16", N, K, 1e-5 if norm else 0.0, ep, False)


def kernels(target: GpuTarget) -> dict:
    out = {}
    for name in ALONE:
        p = params(name)
        # the prefill GEMM that batch steps above BATCH_GEMV_ROWS run now: the tile the plans
        # pick for their short steps (select_wgmma at 512 tokens), x in bf16
        tile = select_wgmma(p, 512)
        gemm = prefill_gemm(f"{name}_gemm", p, target, [name], wgmma=tile)
        GEMM_TILES[gemm.fn] = tile
        for rows in ROWS:
            nt = rows // 8
            xb = {"xb": True} if name in BF16_IN else {}
            for var, extra in BASES.items():
                if name == "head" and var not in HEAD_VARIANTS:
                    continue
                geo = {**gemvm_plain(p, nt), **extra, **xb}
                if geo.get("warps", GEMVM_WARPS) * nt * geo.get("mt", 1) > 64:
                    continue  # its partial tiles past 48 KiB of static shared memory
                fn = f"{name}_{var.replace('-', '_')}"
                out[name, rows, var] = batch_gemv(fn, p, target, [name], nt, **geo)
            for var, (w, mt, u, factor, xasync) in SPLITS.items():
                if mt * nt > 16 or (name == "head" and var not in HEAD_VARIANTS):
                    continue  # accumulators past the register file
                s = split_count(p, w, mt, u, factor)
                fn = f"{name}_{var.replace('-', '_')}"
                while True:
                    try:
                        out[name, rows, var] = batch_gemv_split(
                            fn, p, target, [name], nt, w, mt, u, s, xasync=xasync, **xb
                        )
                        break
                    except ValueError:
                        u //= 2
            out[name, rows, "gemm"] = gemm
            # what the compiler picks now: the batch GEMV's geometry up to its rows, else the GEMM
            if rows <= gemvm_rows(p, BATCH_GEMV_ROWS):
                geo = {**gemvm_geometry(p, nt), **xb}
                out[name, rows, "default"] = gemvm_kernel(
                    f"{name}_default", p, target, [name], nt, geo
                )
            else:
                out[name, rows, "default"] = gemm
    return out


def unique_specs(ks: dict) -> list:
    return list({k.fn: (k.fn, k.template, k.ctx, k.shared) for k in ks.values()}.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--prebuild", metavar="ARCH")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "smallm")
    args = ap.parse_args()
    from gpu_kernels import DeviceKernels, compiled, kernels_source

    if args.prebuild:
        specs = unique_specs(kernels(GpuTarget(args.prebuild)))
        compiled(kernels_source(specs, args.prebuild), args.prebuild, args.cache)
        print(f"{len(specs)} kernels built into {args.cache}")
        return
    from cuda.bindings import driver as cu

    from hipc.runtime.backends.gpu_common import PackedArgs

    ks: dict = {}

    def build(arch):
        ks.update(kernels(GpuTarget(arch)))
        return unique_specs(ks)

    dk = DeviceKernels(build, cache=args.cache)
    d = dk.d
    rng = np.random.default_rng(0)
    ev = [cu.cuEventCreate(0)[1] for _ in range(2)]

    flush = d.malloc(FLUSH)

    def elapsed(reps: int, run, *a) -> float:
        """Median ms of `run(*a)` between two events, L2 (50 MiB) overwritten before each: the
        o and qkv weights would otherwise stay there from one launch to the next."""
        times = []
        for _ in range(reps):
            d.memset0(flush, FLUSH)
            cu.cuEventRecord(ev[0], d._stream)
            run(*a)
            cu.cuEventRecord(ev[1], d._stream)
            d.synchronize()
            times.append(cu.cuEventElapsedTime(ev[0], ev[1])[1])
        return statistics.median(times)

    n = 1 << 30
    a, b = d.malloc(n), d.malloc(n)
    d.d2d(b, a, n)
    d.synchronize()
    copy = 2 * n / (elapsed(5, d.d2d, b, a, n) / 1e3) / 1e12
    d.free(a)
    d.free(b)
    print(f"device copy: {copy:.2f} TB/s (read + write)", flush=True)

    def launch(k, src, T, w, res, y, overlap=False):
        """One launch of kernel `k` (x `src`: float32 rows, or bf16 where k.ctx["xb"] or the
        GEMM); returns its packed arguments (kept alive by a graph's caller)."""
        if k.template == "linear_wgmma":
            tile = GEMM_TILES[k.fn]
            N, K = k.ctx["N"], k.ctx["K"]
            xmap = d.tensor_map(src, K, 64, 64, tile.bm // tile.cm)
            wmap = d.tensor_map(w, K, N, 64, tile.bn // 2)
            packed = PackedArgs([("tmap", xmap), ("tmap", wmap), ("i32", T), ("u64", 0),
                                 ("u64", res), ("u64", y)])  # fmt: skip
            grid = tile.grid(T, k.ctx["n_out"], k.ctx["epilogue"] == "glu")
            d.launch(dk.function(k.fn), grid, (k.threads, 1, 1), k.shared, packed.address,
                     overlap=tile.pdl)  # fmt: skip
            return packed
        packed = PackedArgs([("u64", src), ("i32", T), ("u64", w), ("u64", 0), ("u64", 0),
                             ("u64", 0), ("u64", res), ("u64", y)])  # fmt: skip
        grid = (k.grid[0], k.grid[1] if len(k.grid) > 1 else 1, 1)
        d.launch(dk.function(k.fn), grid, (k.threads, 1, 1), 0, packed.address, overlap=overlap)
        return packed

    def bf16_x(k) -> bool:
        return k.template == "linear_wgmma" or k.ctx["xb"]

    # each kernel alone: x as float32 and as bf16 rows of the same values (so every kernel
    # multiplies the same numbers); residual in place (res = y), as the plans bind it
    base_bits = rng.integers(0x3C00, 0x3F80, 1 << 24, dtype=np.uint16)  # bf16 in [2^-7, 1)
    kern: dict = {}
    for name, (N, K, ep, _) in ALONE.items():
        n_out = N // 2 if ep == "glu" else N
        w = dk.upload(np.resize(base_bits, N * K))
        xbits = np.resize(base_bits, 64 * K)
        x = dk.upload((xbits.astype(np.uint32) << 16).view(np.float32))
        xb = dk.upload(xbits)
        res = dk.upload(rng.standard_normal(64 * n_out).astype(np.float32))
        y = dk.upload(np.zeros(64 * n_out, np.float32))
        for rows in ROWS:
            want = None
            for (sname, r, var), k in ks.items():
                if (sname, r) != (name, rows):
                    continue
                src = xb if bf16_x(k) else x
                d.d2d(y, res, 64 * n_out * 4)
                try:
                    launch(k, src, rows, w, y, y)
                    got = dk.read(y, (rows, n_out))
                except Exception as e:  # a geometry the device refuses: the others still run
                    print(f"{name} rows {rows} {var}: {e}", flush=True)
                    continue
                if want is None:
                    want = got  # base, the first of each (shape, rows)
                err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
                ms = elapsed(args.reps, launch, k, src, rows, w, y, y)
                tbs = 2 * N * K / (ms / 1e3) / 1e12
                kern[name, rows, var] = dict(us=ms * 1e3, tbs=tbs, err=err,
                                             grid=list(k.grid), threads=k.threads)  # fmt: skip
                print(f"# {name} rows {rows} {var} grid {k.grid}x{k.threads}: {ms * 1e3:.1f} us "
                      f"{tbs:.2f} TB/s ({tbs / copy:.0%} of copy), vs base {err:.1e}", flush=True)  # fmt: skip
        dk.free()

    variants = list(BASES) + list(SPLITS) + ["gemm", "default"]
    best = {}
    for name in ALONE:
        for rows in ROWS:
            cands = {v: kern[name, rows, v] for v in variants if (name, rows, v) in kern}
            ok = {v: c for v, c in cands.items() if c["err"] <= 1e-3}
            best[name, rows] = min(ok, key=lambda v: ok[v]["us"])

    # the 32-layer chain, one graph per (config, rows)
    layer_bytes = sum(2 * N * K for N, K, _, _ in SHAPES.values())
    L = args.layers
    weights = {
        name: [d.malloc(2 * N * K) for _ in range(L)] for name, (N, K, _, _) in SHAPES.items()
    }
    for name, ptrs in weights.items():
        N, K = SHAPES[name][:2]
        for ptr in ptrs:  # +v, -v alternating: the chain's values stay bounded
            cu.cuMemsetD32Async(ptr, 0xBC003C00, N * K // 2, d._stream)
    h = dk.upload(rng.standard_normal(64 * 4096).astype(np.float32))
    attn = dk.upload(np.resize(base_bits, 64 * 4096))  # bf16, as the attention writes it
    qkv_out = dk.upload(np.zeros(64 * 6144, np.float32))
    glu_out = dk.upload(np.zeros(64 * 14336, np.float32))
    glu_b = dk.upload(np.resize(base_bits, 64 * 14336))  # as gate/up's GEMM hands down bf16
    xbuf = dk.upload(np.zeros(64 * 14336, np.uint16))
    outs = {"qkv": qkv_out, "gate_up": glu_out}
    norm_w = dk.upload(np.ones(4096, np.float32))
    configs = {"base": {}, **{v: {} for v in variants[1:]}, "best": {}}
    chain: dict = {}
    for rows in ROWS:
        for config in configs:
            pick = {}
            for name in SHAPES:
                var = best[name, rows] if config == "best" else config
                pick[name] = ks.get((name, rows, var)) if (name, rows, var) in kern else None
            if any(k is None for k in pick.values()):
                continue
            keep = []
            d.begin_capture()
            for layer in range(L):
                for name in SHAPES:
                    k = pick[name]
                    src = {"qkv": h, "o": attn, "gate_up": h, "down": glu_out}[name]
                    if name == "down" and bf16_x(k):
                        src = glu_b
                    if SHAPES[name][3]:  # the norm's _xb pass
                        xb_args = PackedArgs([("u64", src), ("u64", norm_w), ("u64", xbuf)])
                        d.launch(dk.function(f"{k.fn}_xb"), (rows, 1, 1), (256, 1, 1), 0,
                                 xb_args.address, overlap=True)  # fmt: skip
                        keep.append(xb_args)
                        src = xbuf
                    y = outs.get(name, h)
                    keep.append(launch(k, src, rows, weights[name][layer], h, y, overlap=True))
            graph = d.end_capture()
            exe = d.instantiate(graph)
            d.graph_launch(exe)
            d.synchronize()
            ms = elapsed(5, d.graph_launch, exe)
            d.destroy_graph(graph, exe)
            tbs = L * layer_bytes / (ms / 1e3) / 1e12
            chain[config, rows] = dict(ms=ms, tbs=tbs)
            print(f"# chain {config} rows {rows}: {ms:.3f} ms, {tbs:.2f} TB/s", flush=True)

    lines = [f"device copy {copy:.2f} TB/s (read + write). us per launch (TB/s of weights, % of "
             "copy); `*` the fastest of the row; `!` output differs from base by > 1e-3", ""]  # fmt: skip
    lines.append("| shape | rows | " + " | ".join(variants) + " |")
    lines.append("|---|---:|" + "---:|" * len(variants))
    for name in ALONE:
        for rows in ROWS:
            cells = []
            for v in variants:
                c = kern.get((name, rows, v))
                if c is None:
                    cells.append("")
                    continue
                mark = ("*" if best[name, rows] == v else "") + ("!" if c["err"] > 1e-3 else "")
                cells.append(f"{c['us']:.1f} ({c['tbs']:.2f}, {c['tbs'] / copy:.0%}){mark}")
            lines.append(f"| {name} | {rows} | " + " | ".join(cells) + " |")
    lines += ["", f"{L}-layer chain (qkv, o, gate/up, down + the _xb passes), one graph: ms "
              f"(TB/s of {L * layer_bytes / 1e9:.1f} GB of weights)", ""]  # fmt: skip
    cols = [c for c in configs if any((c, r) in chain for r in ROWS)]
    lines.append("| rows | " + " | ".join(cols) + " | best picks |")
    lines.append("|---:|" + "---:|" * len(cols) + "---|")
    for rows in ROWS:
        cells = [f"{chain[c, rows]['ms']:.3f} ({chain[c, rows]['tbs']:.2f})"
                 if (c, rows) in chain else "" for c in cols]  # fmt: skip
        picks = ", ".join(f"{n} {best[n, rows]}" for n in SHAPES)
        lines.append(f"| {rows} | " + " | ".join(cells) + f" | {picks} |")
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "results.json").write_text(json.dumps({
        "copy_tbs": copy,
        "kernels": [dict(shape=n, rows=r, variant=v, **c) for (n, r, v), c in kern.items()],
        "chain": [dict(config=c, rows=r, **m) for (c, r), m in chain.items()],
        "best": [dict(shape=n, rows=r, variant=v) for (n, r), v in best.items()],
    }, indent=1))  # fmt: skip
    print("\n" + table)
    dk.close()


if __name__ == "__main__":
    main()
