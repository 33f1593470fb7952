"""Decode kernels alone on the GPU: quantized GEMVs and the decode attention, timed and checked.

    # here (no GPU needed): build every variant's code object ahead of time
    python docs/benchmarks/bench_gpu_gemv.py --prebuild .work/fatbins
    # on the GPU machine
    python docs/benchmarks/bench_gpu_gemv.py --cache .work/fatbins [--out FILE]

For the Llama-3-8B and SmolLM2-135M linears (their fused forms: norm prologue, GLU,
residual), every QuantGemv geometry listed is rendered with each --activations rounding
(int16: x as int8 hi + lo planes; int8: one plane), compiled into one code object
(tests/gpu_kernels.DeviceKernels), checked once against NumPy in float64 (x as the kernel
holds it), and timed as a captured graph of back-to-back launches (overlapped as decode
launches them), each launch reading another copy of the weights so that L2 holds none of
them (replayed warm first: replay_time). GB/s counts the weight bytes read once per launch.
With --layers, each LAYERS chain is timed per variant, per pick:* table (quant_gemv's choice
for each matrix from another table) and as the mix of each shape's fastest variant alone.

The decode attention (Llama-3-8B heads, bf16 KV cache) is timed the same way for several
(waves per block, blocks per layer) at a few positions, each launch on another copy of the
cache; its outputs are checked against the default variant's.
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
sys.path.insert(0, str(ROOT / "docs" / "benchmarks"))

from hipc.base.launch_plan import KV_BLOCK  # noqa: E402
from hipc.compiler.kernels.attention import AttentionParams, decode_attention  # noqa: E402
from hipc.compiler.kernels.linear import (  # noqa: E402
    QUANT_GEMV_TABLE,
    BulkSpec,
    LinearParams,
    QuantGemv,
    QuantGemvBulk,
    decode_gemv,
    quant_gemv,
)
from hipc.compiler.targets import GpuTarget  # noqa: E402
from hipc.runtime.backends.gpu_common import PackedArgs  # noqa: E402

from gpu_kernels import DeviceKernels, compiled, held_x, kernels_source, pack  # noqa: E402

# name: (wtype, N, K, epilogue, norm)
SHAPES = {
    "l8_qkv": ("q4_0", 6144, 4096, "none", True),
    "l8_o": ("q4_0", 4096, 4096, "residual", False),
    "l8_gate_up": ("q4_0", 2 * 14336, 4096, "glu", True),
    "l8_down": ("q4_0", 4096, 14336, "residual", False),
    "l8_head_q6k": ("q6_k", 128256, 4096, "none", True),
    "l8_qkv_q4k": ("q4_k", 6144, 4096, "none", True),
    "l8_qk_q4k": ("q4_k", 5120, 4096, "none", True),
    "l8_v_q6k": ("q6_k", 1024, 4096, "none", True),
    "l8_o_q4k": ("q4_k", 4096, 4096, "residual", False),
    "l8_gate_up_q4k": ("q4_k", 2 * 14336, 4096, "glu", True),
    "l8_down_q6k": ("q6_k", 4096, 14336, "residual", False),
    "l8_down_q4k": ("q4_k", 4096, 14336, "residual", False),
    "l8_down_iq4nl": ("iq4_nl", 4096, 14336, "residual", False),
    "l8_down_iq4xs": ("iq4_xs", 4096, 14336, "residual", False),
    "l8_gate_up_iq4xs": ("iq4_xs", 2 * 14336, 4096, "glu", True),
    # Llama-3-8B's Q3_K_M: q + k and gate/up in Q3_K
    "l8_qk_q3k": ("q3_k", 5120, 4096, "none", True),
    "l8_gate_up_q3k": ("q3_k", 2 * 14336, 4096, "glu", True),
    # Qwen3-30B-A3B's attention linears (hidden 2048, 32 + 2 x 4 heads of 128): few rows
    "q3moe_qkv": ("q4_0", 5120, 2048, "none", True),
    "q3moe_o": ("q4_0", 2048, 4096, "residual", False),
    "smol_qkv": ("q4_1", 960, 576, "none", True),
    "smol_o": ("q4_1", 576, 576, "residual", False),
    "smol_gate_up": ("q4_1", 2 * 1536, 576, "glu", True),
    "smol_down": ("q4_1", 576, 1536, "residual", False),
}
# name: (geometry, the GLU's geometry: a GLU group is a gate + up row pair, so rows >= 2);
# "default" is quant_gemv's choice by matrix size, "base" the kernel this branch started from
# (--baseline TEMPLATE, with the geometry it chose: BASE_GEOMETRY), "lp" quant_gemv's choice
# with the wave's rows prefetched to L2 before the wait (QuantGemv.l2_prefetch)
GEOMETRIES = {
    "default": (None, None),
    "base": (None, None),
    "lp": (None, None),
    # 8-wave blocks capped at 128 registers, one per SM: the next kernel's block fits beside
    # (its ring loaded before its wait while this one runs)
    "w8s3m2": (QuantGemv(8, 2, 2, 132, 2, 3, 8), QuantGemv(8, 2, 2, 132, 2, 3, 8)),
    "w8s3m2lp": (
        QuantGemv(8, 2, 2, 132, 2, 3, 8, l2_prefetch=True),
        QuantGemv(8, 2, 2, 132, 2, 3, 8, l2_prefetch=True),
    ),
    # 1-row groups of 4 units: qkv's 6144 rows over 128 blocks (2-row groups: 96)
    "r1u4s3": (QuantGemv(16, 1, 4, 132, 1, 3, 8), QuantGemv(16, 2, 2, 132, 1, 4, 8)),
    "r2u2s4m1": (QuantGemv(16, 2, 2, 132, 1, 4, 8), QuantGemv(16, 2, 2, 132, 1, 4, 8)),
    "r4u2s2m1": (QuantGemv(16, 4, 2, 132, 1, 2, 8), QuantGemv(16, 4, 1, 132, 1, 3, 8)),
    "r2u4s2m1": (QuantGemv(16, 2, 4, 132, 1, 2, 8), QuantGemv(16, 2, 4, 132, 1, 2, 8)),
    "w8r2u2s6": (QuantGemv(8, 2, 2, 132, 1, 6, 8), QuantGemv(8, 2, 2, 132, 1, 6, 8)),
    "copy16r2u4": (QuantGemv(16, 2, 4, 128, 1, 1), QuantGemv(16, 2, 4, 128, 1, 1)),
    # bulk copies into shared memory (linear_gemv_qbulk): (stage KiB at most, stages, waves at
    # most, blocks per SM it is sized for[, outputs a wave multiplies at once[, Q4_K in
    # 64-weight units]]); bulk_geometry makes the QuantGemvBulk
    "bulk16x4m2": ((16, 4, 8, 2), None),
    "bulk24x4m2": ((24, 4, 8, 2), None),
    "bulk32x6m1": ((32, 6, 16, 1), None),
    "bulk24x4m2r2": ((24, 4, 8, 2, 2), None),
}
# the K-quants' units are 128 weights (64-96 bytes of quants): fewer of them in flight
KQUANT_GEOMETRIES = {
    "default": (None, None),
    "base": (None, None),
    "lp": (None, None),
    # Q4_K in 64-weight units on 128 registers (Q6_K spills there): room for the next block
    "k8r2s3k64m2": (
        QuantGemv(8, 2, 1, 132, 2, 3, 8, unit64=True),
        QuantGemv(8, 2, 1, 132, 2, 3, 8, unit64=True),
    ),
    # 16 waves of 2-row rings of 2 64-weight units (Q6_K without spills on 128 registers)
    "k16r2s2k64": (
        QuantGemv(16, 2, 1, 132, 1, 2, 8, unit64=True),
        QuantGemv(16, 2, 1, 132, 1, 2, 8, unit64=True),
    ),
    "k8r4s2p1": (QuantGemv(8, 4, 1, 132, 1, 2, 4, 1), QuantGemv(8, 4, 1, 132, 1, 2, 4, 1)),
    "k8r2s3": (QuantGemv(8, 2, 1, 132, 1, 3, 8), QuantGemv(8, 2, 1, 132, 1, 3, 8)),
    "k8r2s2": (QuantGemv(8, 2, 1, 132, 1, 2, 8), QuantGemv(8, 2, 1, 132, 1, 2, 8)),
    "k16r2s2": (QuantGemv(16, 2, 1, 132, 1, 2, 8), QuantGemv(16, 2, 1, 132, 1, 2, 8)),
    "k16r1s3": (QuantGemv(16, 1, 1, 132, 1, 3, 8), QuantGemv(16, 2, 1, 132, 1, 2, 8)),
    "k8r2s2m2": (QuantGemv(8, 2, 1, 132, 2, 2, 8), QuantGemv(8, 2, 1, 132, 2, 2, 8)),
    "k8r4s1": (QuantGemv(8, 4, 1, 132, 1, 1), QuantGemv(8, 4, 1, 132, 1, 1)),
    "k8r1s3m2": (QuantGemv(8, 1, 1, 132, 2, 3), QuantGemv(8, 4, 1, 132, 1, 1)),
    "bulk16x4m2": ((16, 4, 8, 2), None),
    "bulk24x4m2": ((24, 4, 8, 2), None),
    "bulk32x6m1": ((32, 6, 16, 1), None),
    "bulk24x4m2r2": ((24, 4, 8, 2, 2), None),
    "bulk24x4m2k64": ((24, 4, 8, 2, 1, True), None),
    # the register kernel with 64-weight units
    "k8r4s1k64": (
        QuantGemv(8, 4, 1, 132, 1, 1, unit64=True),
        QuantGemv(8, 4, 1, 132, 1, 1, unit64=True),
    ),
    "k16r2s3k64": (
        QuantGemv(16, 2, 1, 132, 1, 3, 8, unit64=True),
        QuantGemv(16, 2, 1, 132, 1, 3, 8, unit64=True),
    ),
}
KQUANTS = ("q4_k", "q5_k", "q6_k", "q3_k")
# "pick:NAME": every matrix gets what quant_gemv would give it from the table PICKS[NAME]
# (linear.QUANT_GEMV_TABLE with some classes replaced), so a layer chain can mix the
# geometries that won alone shape by shape; the chains also time the mix of each shape's
# fastest variant alone ("best alone") without naming it
W8S3M2 = QuantGemv(8, 2, 2, 132, 2, 3, 8)
PICKS = {
    # the down projections' rows prefetched to L2, the rest as now
    "lpdown": {
        **QUANT_GEMV_TABLE,
        **{
            (f, "long"): replace(QUANT_GEMV_TABLE[f, "long"], l2_prefetch=True)
            for f in ("q", "q4_k", "q5_k", "q6_k")
        },
    },
    # the 32-weight types' large matrices in 8-wave 128-register blocks, downs prefetched
    "m2lpdown": {
        **QUANT_GEMV_TABLE,
        ("q", "short"): W8S3M2,
        ("q", "narrow"): W8S3M2,
        ("q", "glu"): W8S3M2,
        **{
            (f, "long"): replace(g, l2_prefetch=True)
            for f, g in (("q", W8S3M2), ("q4_k", QUANT_GEMV_TABLE["q4_k", "long"]))
        },
        ("q6_k", "long"): replace(QUANT_GEMV_TABLE["q6_k", "long"], l2_prefetch=True),
    },
}


def base_geometry(wtype: str, N: int, K: int) -> QuantGemv:
    """The geometry the baseline kernel was run with (quant_gemv before the ring)."""
    if wtype in KQUANTS:
        return QuantGemv(8, 4, 1, 132, 1)
    blocks = {"q4_0": 18, "q4_1": 20, "q8_0": 34}[wtype]
    big = N * K // 32 * blocks >= 4 << 20 or K >= 1536
    g = QuantGemv(16, 2, 4, 128, 1) if big else QuantGemv(8, 2, 4, 256, 2)
    return replace(g, unroll=g.unroll // 2) if wtype == "q8_0" else g


ACTIVATIONS = ("int16", "int8")
# (waves per block, blocks per layer) of the decode attention; default first
ATTENTION_VARIANTS = [(4, 256), (2, 512), (4, 512), (2, 1024), (4, 1024)]
ATTENTION_POSITIONS = (512, 2000)
L8_ATTENTION = AttentionParams(
    NH=32, NKV=8, D=128, scale=128**-0.5, window=0, interleaved=False, norm_eps=0.0
)
ATTENTION_CTX = 4096
L2_BYTES = 60 << 20
CHECK_MAX_VALUES = 64_000_000  # larger matrices are timed, not checked (float64 NumPy)
# a decode layer's GEMVs in launch order (attention between qkv and o is left out)
LAYERS = {
    "q4_0": ("l8_qkv", "l8_o", "l8_gate_up", "l8_down"),
    # Llama-3-8B's Q4_K_M: half the layers Q4_K throughout (q, k, v fused), half with Q6_K v
    # and down (llama-quantize's use_more_bits)
    "q4_k_m": ("l8_qkv_q4k", "l8_o_q4k", "l8_gate_up_q4k", "l8_down_q4k"),
    "q4_k_m6": ("l8_qk_q4k", "l8_v_q6k", "l8_o_q4k", "l8_gate_up_q4k", "l8_down_q6k"),
}


def bulk_geometry(spec: tuple, wtype: str, N: int, K: int, glu: bool) -> QuantGemvBulk:
    """A bulk* variant's geometry for one matrix (linear.BulkSpec)."""
    return BulkSpec(*spec).geometry(wtype, K, glu)


def geometries(wtype: str) -> list[str]:
    """The variants of a weight type, in the order they are built and timed."""
    return list(KQUANT_GEOMETRIES if wtype in KQUANTS else GEOMETRIES) + [
        f"pick:{n}" for n in PICKS
    ]


def variant_geometry(g: str, wtype: str, N: int, K: int, epilogue: str):
    """The geometry of variant `g` for one matrix (None: quant_gemv's)."""
    glu = epilogue == "glu"
    if g.startswith("pick:"):
        return quant_gemv(wtype, N, K, glu, table=PICKS[g.removeprefix("pick:")])
    if g == "base":
        return base_geometry(wtype, N, K)
    if g == "lp":
        return replace(quant_gemv(wtype, N, K, glu), l2_prefetch=True)
    geos = (KQUANT_GEOMETRIES if wtype in KQUANTS else GEOMETRIES)[g]
    if g.startswith("bulk"):
        return bulk_geometry(geos[0], wtype, N, K, glu)
    geo = geos[1] if glu else geos[0]
    if geo and wtype == "q8_0" and geo.unroll > 1:  # the same bytes in flight
        geo = replace(geo, unroll=geo.unroll // 2)
    return geo


def gemv_specs(arch: str, shapes: list[str], variants=None, activations=ACTIVATIONS) -> dict:
    specs = {}
    for si, s in enumerate(shapes):
        wtype, N, K, epilogue, norm = SHAPES[s]
        p = LinearParams(wtype, N, K, 1e-5 if norm else 0.0, epilogue, bias=False)
        for gi, g in enumerate(geometries(wtype)):
            if variants and g not in variants:
                continue
            geo = variant_geometry(g, wtype, N, K, epilogue)
            for a in activations:
                fn = f"s{si}g{gi}{a}"
                k = decode_gemv(fn, p, GpuTarget(arch), [s], geo, activations=a)
                if g == "base":  # the baseline template's names (its geometry is the same)
                    k = replace(k, template="baseline", ctx={**k.ctx, "prefetch": False})
                specs[s, g, a] = k
    return specs


def use_baseline(template: Path) -> None:
    """Kernels whose template is "baseline" render from `template` (the GEMV before this
    branch's ring), with the prelude and filters of this checkout."""
    import jinja2

    from hipc.compiler.codegen.environment import c_float

    import gpu_kernels

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template.parent)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["c_float"] = c_float
    plain = gpu_kernels.render

    def render(name: str, **ctx) -> str:
        if name == "hip/baseline.hip.j2":
            return env.get_template(template.name).render(**ctx)
        return plain(name, **ctx)

    gpu_kernels.render = render


def attention_specs(arch: str) -> dict:
    return {
        v: decode_attention(
            f"att_w{v[0]}b{v[1]}",
            L8_ATTENTION,
            GpuTarget(arch),
            ["att"],
            ATTENTION_CTX,
            "bfloat16",
            waves=v[0],
            blocks=v[1],
        )
        for v in ATTENTION_VARIANTS
    }


def as_built(specs: dict) -> list:
    return [(k.fn, k.template, k.ctx, k.shared) for k in specs.values()]


def random_raw(wtype: str, N: int, K: int, rng) -> np.ndarray:
    """Split-layout bytes of random blocks with sane f16 scales (timing only)."""
    from bench_gpu_quant import random_blocks

    from hipc.compiler.passes.repack import split_quant_blocks

    return split_quant_blocks(random_blocks(wtype.upper(), N, K, rng), wtype)


# Replays before timing (at least WARM_S seconds of them), then TRIALS timed runs of at least
# TRIAL_S seconds each; the fastest counts. Timed as cold_time (1 replay, then 5 timed: about
# 2 ms for a small matrix, right after the host spent seconds packing weights), the variant
# timed first for each shape (default) came out 3x slower than base on the 8B's small
# matrices on 2026-12-04 (o: 15.0 against 4.5 us) though both preload their whole rows before
# the wait and run one block per SM; the first variant's cold time is printed beside its own.
WARM_S, TRIAL_S, TRIALS = 0.05, 0.02, 3


def replay_time(d, ge, per_replay: int) -> float:
    """us per unit of work of the instantiated graph `ge` (`per_replay` units a replay)."""
    n, t = 0, time.perf_counter()
    while n < 2 or time.perf_counter() - t < WARM_S:
        d.graph_launch(ge)
        d.synchronize()
        n += 1
    reps = max(2, int(TRIAL_S / ((time.perf_counter() - t) / n)) + 1)
    best = float("inf")
    for _ in range(TRIALS):
        t = time.perf_counter()
        for _ in range(reps):
            d.graph_launch(ge)
        d.synchronize()
        best = min(best, (time.perf_counter() - t) / reps)
    return best / per_replay * 1e6


def cold_time(d, ge, per_replay: int) -> float:
    """us per unit as this benchmark timed before replay_time: one replay, then 5 timed."""
    d.graph_launch(ge)
    d.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        d.graph_launch(ge)
    d.synchronize()
    return (time.perf_counter() - t) / (5 * per_replay) * 1e6


def graph_time(d, fn, grid, threads, shared, packed, launches, cold=False):
    """(us per launch of `launches` back-to-back launches (overlapped), cycling `packed`;
    with `cold`, the same as cold_time measured before, else None)."""
    d.synchronize()
    d.begin_capture()
    for i in range(launches):
        p = packed[i % len(packed)]
        d.launch(fn, grid, (threads, 1, 1), shared, p.address, overlap=True)
    ge = d.instantiate(d.end_capture())
    first = cold_time(d, ge, launches) if cold else None
    us = replay_time(d, ge, launches)
    return us, first


def bench_gemvs(
    dev, specs, shapes, launches, activations=ACTIVATIONS, check_max=CHECK_MAX_VALUES, times=None
) -> list[str]:
    """Each shape's variants alone; `times` (if given) gets {(shape, variant, activations): us}
    of those whose numbers are right (or unchecked and finite)."""
    d = dev.d
    lines = []
    rng = np.random.default_rng(0)
    for s in shapes:
        wtype, N, K, epilogue, norm = SHAPES[s]
        n_out = N // 2 if epilogue == "glu" else N
        check = check_max >= N * K
        if check:
            raw, w = pack(0.05 * rng.standard_normal((N, K)), wtype)
        else:
            raw, w = random_raw(wtype, N, K, rng), None
        x = (rng.standard_normal(K) * 3).astype(np.float32)
        g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
        r = rng.standard_normal(n_out).astype(np.float32)
        want = {}
        if check:
            inv = 1 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5) if norm else 1.0
            for a in activations:
                xs = x * g if norm else x
                held = held_x(xs, a)
                acc = w @ held * inv
                if epilogue == "glu":
                    acc = acc[:n_out] / (1 + np.exp(-acc[:n_out])) * acc[n_out:]
                want[a] = acc + (r if epilogue == "residual" else 0.0)
            del w
        # at least four copies: with two, a 66 MB matrix (132 MB against 50-60 MB of L2) read
        # faster than the copy ceiling (session 33: some lines survived between launches)
        copies = max(4, -(-4 * L2_BYTES // raw.nbytes))
        wbufs = [dev.upload(raw) for _ in range(copies)]
        xb, gb, rb, yb = dev.upload(x), dev.upload(g), dev.upload(r), dev.poisoned(n_out)
        cells = []
        for gname in geometries(wtype):
            for a in activations:
                if (s, gname, a) not in specs:
                    continue
                k = specs[s, gname, a]
                fn = dev.function(k.fn)
                tail = [gb if norm else 0, 0, rb if epilogue == "residual" else 0, yb]
                packed = [PackedArgs([("u64", p) for p in [xb, wb, *tail]]) for wb in wbufs]
                grid = (*k.grid, 1, 1)[:3]
                d.launch(fn, grid, (k.threads, 1, 1), k.shared, packed[0].address)
                got = dev.read(yb, n_out)
                if check:
                    err = float(np.linalg.norm(got - want[a]) / np.linalg.norm(want[a]))
                    flag = f" e={err:.0e}" + (" BAD" if not err <= 1e-4 else "")
                else:
                    flag = "" if np.isfinite(got).all() else " NaN"
                # the first variant after the upload also as timed before replay_time
                us, cold = graph_time(d, fn, grid, k.threads, k.shared, packed, launches, not cells)
                if times is not None and not flag.endswith(("BAD", "NaN")):
                    times[s, gname, a] = us
                if not cells:
                    flag += f" (cold {cold:.1f} us)"
                cells.append(f"{gname}/{a}: {us:.1f} us {raw.nbytes / us / 1e3:,.0f} GB/s{flag}")
        best = min(cells, key=lambda c: float(c.split(": ")[1].split(" us")[0]))
        lines.append(f"| {s} | {raw.nbytes / 1e6:.1f} | best {best} | " + "; ".join(cells) + " |")
        print(lines[-1], flush=True)
        dev.free()
    return lines


def best_alone(times: dict, chain, activations) -> dict:
    """{label: ({shape: variant}, activations)}: per activations, each shape of `chain` with
    its fastest variant alone (pick:* variants aside: they repeat others' geometries; base
    too: its template is not this checkout's)."""
    mixes = {}
    for a in activations:
        mix = {}
        for s in chain:
            cands = {v: us for (s2, v, a2), us in times.items() if s2 == s and a2 == a}
            cands = {v: us for v, us in cands.items() if not v.startswith(("pick:", "base"))}
            if not cands:
                break
            mix[s] = min(cands, key=cands.get)
        else:
            mixes[f"best alone ({', '.join(mix[s] for s in chain)})/{a}"] = (mix, a)
    return mixes


def bench_layers(dev, specs, variants, activations, layers: int, times=None) -> list[str]:
    """Each LAYERS chain (a decode layer's GEMVs in order, on random blocks) `layers` times
    in one captured graph, launched overlapped as decode launches them, for each variant
    that has every shape, and for the mix of each shape's fastest variant alone (`times`:
    bench_gemvs's): us per layer and GB/s of weights. Unlike one kernel timed after itself,
    this has the boundaries between different kernels that a decode step has."""
    d = dev.d
    rng = np.random.default_rng(2)
    lines = []
    built = {s for s, _, _ in specs}
    for wtype, chain in LAYERS.items():
        if not built.issuperset(chain):
            continue
        sets, nbytes = [], 0
        x = dev.upload((rng.standard_normal(14336) * 3).astype(np.float32))
        g = dev.upload((1 + 0.2 * rng.standard_normal(14336)).astype(np.float32))
        r = dev.upload(rng.standard_normal(14336).astype(np.float32))
        ys = [dev.poisoned(SHAPES[s][1]) for s in chain]
        for _ in range(2):  # two copies of every weight: no layer finds its weights in L2
            raws = [random_raw(SHAPES[s][0], SHAPES[s][1], SHAPES[s][2], rng) for s in chain]
            nbytes = sum(a.nbytes for a in raws)
            sets.append([dev.upload(a) for a in raws])
        cells, keep = [], []
        runs = {f"{v}/{a}": ({s: v for s in chain}, a) for v in variants for a in activations}
        runs.update(best_alone(times or {}, chain, activations))
        for label, (mix, a) in runs.items():
            ks = [specs.get((s, mix[s], a)) for s in chain]
            if None in ks:
                continue
            d.synchronize()
            d.begin_capture()
            for i in range(layers):
                for j, (s, k) in enumerate(zip(chain, ks, strict=True)):
                    norm, residual = SHAPES[s][4], SHAPES[s][3] == "residual"
                    args = [x, sets[i % 2][j], g if norm else 0, 0, r if residual else 0, ys[j]]
                    packed = PackedArgs([("u64", p) for p in args])
                    keep.append(packed)  # the graph holds their addresses
                    grid = (*k.grid, 1, 1)[:3]
                    d.launch(dev.function(k.fn), grid, (k.threads, 1, 1), k.shared,
                             packed.address, overlap=True)  # fmt: skip
            us = replay_time(d, d.instantiate(d.end_capture()), layers)
            cells.append(f"{label}: {us:.1f} us {nbytes / us / 1e3:,.0f} GB/s")
        lines.append(
            f"| {wtype} layer ({'+'.join(chain)}) | {nbytes / 1e6:.1f} | " + "; ".join(cells) + " |"
        )
        print(lines[-1], flush=True)
        dev.free()
    return lines


def ceilings() -> str:
    """The device-to-device copy rate (read + write counted) and a read-only rate (a sum),
    through torch when it is installed."""
    try:
        import torch

        torch.cuda.init()
    except (ImportError, AssertionError, RuntimeError) as e:
        return f"ceilings: none ({e})"
    a = torch.empty(1 << 30, dtype=torch.float32, device="cuda")  # 4 GiB
    b = torch.empty_like(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rates = {}
    ops = (("copy", lambda: b.copy_(a), 8), ("read (sum)", lambda: a.sum(), 4))
    for name, op, nbytes in ops:
        op()
        torch.cuda.synchronize()
        s.record()
        for _ in range(5):
            op()
        e.record()
        torch.cuda.synchronize()
        rates[name] = nbytes * a.numel() * 5 / (s.elapsed_time(e) / 1e3)
    a = b = None  # free the 8 GiB before the kernels run
    torch.cuda.empty_cache()
    return "ceilings: " + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in rates.items())


def bench_attention(dev, specs, launches) -> list[str]:
    d = dev.d
    P = L8_ATTENTION
    NH, NKV, D, ctx = P.NH, P.NKV, P.D, ATTENTION_CTX
    rng = np.random.default_rng(1)
    cache_bytes = ctx * NKV * D * 2
    copies = max(2, -(-2 * L2_BYTES // (2 * cache_bytes)))
    caches = []
    for _ in range(copies):
        kc = rng.integers(0x3C00, 0x3E00, ctx * NKV * D, dtype=np.uint16)  # bf16 in ~[0.0078,0.03]
        caches.append((dev.upload(kc), dev.upload(kc[::-1].copy())))
    q = rng.standard_normal(NH * D).astype(np.float32)
    k = rng.standard_normal(NKV * D).astype(np.float32)
    v = rng.standard_normal(NKV * D).astype(np.float32)
    ang = np.arange(ctx)[:, None] * (10000.0 ** (-np.arange(D // 2) / (D // 2)))[None]
    cos_t, sin_t = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    qb, kb, vb = dev.upload(q), dev.upload(k), dev.upload(v)
    cb, sb = dev.upload(cos_t), dev.upload(sin_t)
    lines = []
    # one sequence whose block b is pool block b (the caches are contiguous)
    seq0 = dev.upload(np.zeros(1, np.int32))
    table = dev.upload(np.arange(-(-ctx // KV_BLOCK), dtype=np.int32))
    for pos in ATTENTION_POSITIONS:
        start = dev.upload(np.array([pos], np.int32))
        ref, cells = None, []
        for var, spec in specs.items():
            splits = spec.grid[1]
            partial = dev.poisoned(NH * splits * (D + 2))
            counters = dev.upload(np.zeros(NH, np.uint32))
            out = dev.poisoned(NH * D)
            packed = [
                PackedArgs(
                    [
                        ("u64", a)
                        for a in [
                            qb,
                            kb,
                            vb,
                            start,
                            seq0,
                            table,
                            0,
                            0,
                            cb,
                            sb,
                            kc,
                            vc,
                            partial,
                            counters,
                            out,
                        ]
                    ]
                )
                for kc, vc in caches
            ]
            fn = dev.function(spec.fn)
            grid = (spec.grid[0], splits, 1)  # heads, or KV heads (the grouped kernel)
            d.launch(fn, grid, (spec.threads, 1, 1), spec.shared, packed[0].address)
            got = dev.read(out, NH * D)
            ref = got if ref is None else ref
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            us, _ = graph_time(d, fn, grid, spec.threads, spec.shared, packed, launches)
            cells.append(
                f"w{var[0]}/b{var[1]} ({splits} splits): {us:.1f} us"
                + ("" if err <= 1e-5 else f" DIFFERS {err:.0e}")
            )
        lines.append(f"| attention p={pos} | " + "; ".join(cells) + " |")
        print(lines[-1], flush=True)
    dev.free()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", help="geometries to time (default: all)")
    ap.add_argument("--activations", default=",".join(ACTIVATIONS))
    ap.add_argument("--launches", type=int, default=64)
    ap.add_argument("--check-max", type=int, default=CHECK_MAX_VALUES, help="weights at most")
    ap.add_argument("--layers", type=int, default=0, help="also time LAYERS chains this long")
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--baseline", type=Path, help="the template of the 'base' variant")
    ap.add_argument("--cache", type=Path, help="code objects built ahead (--prebuild)")
    ap.add_argument("--prebuild", type=Path, help="build the code objects for --arch into DIR")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    variants = args.variants.split(",") if args.variants else None
    if variants and "base" in variants and not args.baseline:
        ap.error("--variants base needs --baseline TEMPLATE")
    if not args.baseline:
        every = [*GEOMETRIES, *KQUANT_GEOMETRIES, *(f"pick:{n}" for n in PICKS)]
        variants = variants or list(dict.fromkeys(every))
        variants = [v for v in variants if v != "base"]
    else:
        use_baseline(args.baseline)
    activations = tuple(args.activations.split(","))

    def build(arch: str) -> dict:
        return gemv_specs(arch, shapes, variants, activations)

    if args.prebuild:
        jobs = [build(args.arch)] + ([] if args.no_attention else [attention_specs(args.arch)])
        for specs in jobs:
            src = kernels_source(as_built(specs), args.arch)
            compiled(src, args.arch, args.prebuild)
        print(f"built into {args.prebuild}")
        return
    lines = [ceilings(), ""]
    print(lines[0], flush=True)
    specs = {}
    dev = DeviceKernels(lambda arch: as_built(specs.update(build(arch)) or specs), cache=args.cache)
    lines += [
        "| shape | MB | fastest | every variant (geometry/activations) |",
        "|---|---:|---|---|",
    ]
    times = {}
    lines += bench_gemvs(dev, specs, shapes, args.launches, activations, args.check_max, times)
    if args.layers:
        names = list(dict.fromkeys(v for _, v, _ in specs))
        lines += [
            "",
            f"| {args.layers} layers | MB per layer | us per layer, GB/s |",
            "|---|---:|---|",
        ]
        lines += bench_layers(dev, specs, names, activations, args.layers, times)
    dev.close()
    if not args.no_attention:
        att = {}
        dev = DeviceKernels(
            lambda arch: as_built(att.update(attention_specs(arch)) or att), cache=args.cache
        )
        lines += ["", "| decode attention, 8B heads, bf16 KV | (waves/blocks): time |", "|---|---|"]
        lines += bench_attention(dev, att, args.launches)
        dev.close()
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
