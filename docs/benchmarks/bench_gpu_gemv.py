"""Quantized decode GEMVs alone on the GPU: each model shape and geometry, timed and checked.

    python docs/benchmarks/bench_gpu_gemv.py [--out FILE]

For the Llama-3-8B and SmolLM2-135M linears (their fused forms: norm prologue, GLU,
residual), every QuantGemv geometry listed is rendered, compiled into one code object
(tests/gpu_kernels.DeviceKernels), checked once against NumPy in float64, and timed as a
captured graph of back-to-back launches (overlapped as decode launches them), each
launch reading another copy of the weights so that L2 holds none of them. GB/s counts
the weight bytes read once per launch; the device-to-device copy rate is measured too.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from hipc.compiler.kernels.linear import LinearParams, QuantGemv, decode_gemv  # noqa: E402
from hipc.compiler.targets import GpuTarget  # noqa: E402
from hipc.runtime.backends.gpu_common import PackedArgs  # noqa: E402

from gpu_kernels import DeviceKernels, pack  # noqa: E402

# name: (wtype, N, K, epilogue, norm)
SHAPES = {
    "l8_qkv": ("q4_0", 6144, 4096, "none", True),
    "l8_o": ("q4_0", 4096, 4096, "residual", False),
    "l8_gate_up": ("q4_0", 2 * 14336, 4096, "glu", True),
    "l8_down": ("q4_0", 4096, 14336, "residual", False),
    "l8_head_q8": ("q8_0", 128256, 4096, "none", True),
    "smol_qkv": ("q4_1", 960, 576, "none", True),
    "smol_o": ("q4_1", 576, 576, "residual", False),
    "smol_gate_up": ("q4_1", 2 * 1536, 576, "glu", True),
    "smol_down": ("q4_1", 576, 1536, "residual", False),
}
GEOMETRIES = {
    "default": None,  # quant_gemv's choice by matrix size
    "w8r2u4": QuantGemv(8, 2, 4, 256, 2),
    "w8r2u4_nopf": QuantGemv(8, 2, 4, 256, 2, prefetch=False),
    "w16r4u2": QuantGemv(16, 4, 2, 128, 1),
    "w16r4u2_nopf": QuantGemv(16, 4, 2, 128, 1, prefetch=False),
    "w16r2u4": QuantGemv(16, 2, 4, 128, 1),
}
L2_BYTES = 60 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--geometries", default=",".join(GEOMETRIES))
    ap.add_argument("--launches", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    geoms = args.geometries.split(",")
    specs = {}

    def build(arch):
        for si, s in enumerate(shapes):
            wtype, N, K, epilogue, norm = SHAPES[s]
            p = LinearParams(wtype, N, K, 1e-5 if norm else 0.0, epilogue, bias=False)
            for gi, g in enumerate(geoms):
                geo = GEOMETRIES[g]
                if geo and wtype == "q8_0" and geo.unroll > 1:  # the same bytes in flight
                    geo = replace(geo, unroll=geo.unroll // 2)
                specs[s, g] = decode_gemv(f"s{si}g{gi}", p, GpuTarget(arch), [s], geo)
        return [(k.fn, k.template, k.ctx, k.shared) for k in specs.values()]

    dev = DeviceKernels(build)
    d = dev.d
    lines = ["| shape | MB | " + " | ".join(geoms) + " |", "|---|---:|" + "---:|" * len(geoms)]
    rng = np.random.default_rng(0)
    for s in shapes:
        wtype, N, K, epilogue, norm = SHAPES[s]
        n_out = N // 2 if epilogue == "glu" else N
        raw, w = pack(0.05 * rng.standard_normal((N, K)), wtype)
        x = (rng.standard_normal(K) * 3).astype(np.float32)
        g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
        r = rng.standard_normal(n_out).astype(np.float32)
        xn = x.astype(np.float64)
        if norm:
            xn = xn / np.sqrt(np.mean(xn * xn) + 1e-5) * g
        acc = w @ xn
        want = acc[:n_out] / (1 + np.exp(-acc[:n_out])) * acc[n_out:] if epilogue == "glu" else acc
        if epilogue == "residual":
            want = want + r
        copies = max(2, -(-2 * L2_BYTES // raw.nbytes))
        wbufs = [dev.upload(raw) for _ in range(copies)]
        xb, gb, rb, yb = dev.upload(x), dev.upload(g), dev.upload(r), dev.poisoned(n_out)
        cells = []
        for gname in geoms:
            k = specs[s, gname]
            fn = dev.function(k.fn)

            head = [xb]
            tail = [gb if norm else 0, 0, rb if epilogue == "residual" else 0, yb]
            packed = [PackedArgs([("u64", p) for p in [*head, wb, *tail]]) for wb in wbufs]
            grid = (*k.grid, 1, 1)[:3]
            d.launch(fn, grid, (k.threads, 1, 1), k.shared, packed[0].address)
            got = dev.read(yb, n_out)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            d.synchronize()
            d.begin_capture()
            for i in range(args.launches):
                p = packed[i % copies]
                d.launch(fn, grid, (k.threads, 1, 1), k.shared, p.address, overlap=True)
            ge = d.instantiate(d.end_capture())
            d.graph_launch(ge)
            d.synchronize()
            t = time.perf_counter()
            reps = 5
            for _ in range(reps):
                d.graph_launch(ge)
            d.synchronize()
            us = (time.perf_counter() - t) / (reps * args.launches) * 1e6
            gbs = raw.nbytes / us / 1e3
            cells.append(f"{us:.1f} us {gbs:,.0f} GB/s e={err:.0e}")
        lines.append(f"| {s} | {raw.nbytes / 1e6:.1f} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
        dev.free()
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
