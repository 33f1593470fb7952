"""Siblings: consecutive quantized decode GEMVs that read the same input, as one kernel.

passes/repack.py merges linears that read one input into one wide linear only where their
weights share a storage type. llama.cpp's mixes break that: Q4_K_M keeps v (and the down
projection) of half the layers in Q6_K beside a Q4_K q and k, so those layers' decode runs a
q+k GEMV, then a v GEMV. The q+k one is 80 blocks of an H200's 132 SMs; the v one then waits
for it before staging x and streaming its 3.4 MB: a kernel boundary and a dependent tail a
layer. A sibling kernel (templates/hip/linear_gemv_siblings.hip.j2) gives each GEMV a range
of one grid's blocks, each block running its GEMV's own code (the template's `segment`
rendering), so they stream side by side on different SMs.

Merged: adjacent decode launches of the register GEMV (linear_gemv_q) with the same x, norm
and block size, whose only activation input is that x (no residual, no gate), so no block of
one can write what a block of the other reads. The block budget of the widest one is shared
in proportion to the weight bytes. HIPC_DECODE_SIBLINGS=0 at compile time keeps one launch
each (benchmarks compare the two).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.base import Arg, Signature
from hipc.compiler.kernels.linear import stream_blocks

if TYPE_CHECKING:
    from hipc.compiler.codegen.hip import GpuProgramBuilder
    from hipc.compiler.kernels.base import GpuKernel

SIBLINGS_ENV = "HIPC_DECODE_SIBLINGS"


def siblings_enabled() -> bool:
    return os.environ.get(SIBLINGS_ENV) != "0"


def _args(launch: dict, sig: Signature) -> dict:
    return {a.name: b for a, b in zip(sig.args, launch["args"], strict=True)}


def _eligible(launch: dict, k: GpuKernel | None, sig: Signature | None) -> bool:
    if k is None or sig is None or k.template != "linear_gemv_q" or not launch.get("overlap"):
        return False
    if "tokens" in launch or launch.get("resident"):
        return False
    args = _args(launch, sig)
    return set(args) == {"x", "W", "norm_w", "bias", "res", "y"} and args["res"]["kind"] == "null"


def _siblings(a: tuple, b: tuple) -> bool:
    (la, ka, sa), (lb, kb, sb) = a, b
    xa, xb = _args(la, sa), _args(lb, sb)
    return (
        ka.threads == kb.threads
        and ka.ctx["K"] == kb.ctx["K"]
        and ka.ctx["lo"] == kb.ctx["lo"]
        and ka.ctx["norm_eps"] == kb.ctx["norm_eps"]
        and xa["x"] == xb["x"]
        and xa["norm_w"] == xb["norm_w"]
    )


def merge_siblings(g: GpuProgramBuilder) -> None:
    """Replace each run of adjacent sibling decode GEMVs by one launch (g.specs: the kernels
    by name; g.signatures: each launch's signature)."""
    items = [(la, g.specs.get(la["kernel"]), g.signatures.get(id(la))) for la in g.steps["decode"]]
    out: list[dict] = []
    i = 0
    while i < len(items):
        run = [items[i]]
        if _eligible(*items[i]):
            while (
                i + len(run) < len(items)
                and _eligible(*items[i + len(run)])
                and _siblings(run[0], items[i + len(run)])
            ):
                run.append(items[i + len(run)])
        out.append(run[0][0] if len(run) == 1 else _merged(g, run))
        i += len(run)
    g.steps["decode"] = out


def weight_bytes(k: GpuKernel) -> int:
    c = k.ctx
    return c["N"] * (c["K"] // c["block_values"]) * c["block_bytes"]


def segment_blocks(ks: list[GpuKernel]) -> list[int]:
    """Each GEMV's blocks of a sibling grid: the widest geometry's block budget shared in
    proportion to the weight bytes, the largest GEMV first, each taking as few blocks as
    stream its groups in that budget (linear.stream_blocks) and leaving the rest on."""
    budget = min(k.ctx["max_blocks"] for k in ks)
    left_bytes = sum(weight_bytes(k) for k in ks)
    blocks = [0] * len(ks)
    for n in sorted(range(len(ks)), key=lambda n: -weight_bytes(ks[n])):
        c = ks[n].ctx
        share = max(1, budget * weight_bytes(ks[n]) // left_bytes)
        groups = -(-c["n_out"] // (c["rows"] // 2 if c["epilogue"] == "glu" else c["rows"]))
        blocks[n] = stream_blocks(groups, c["waves"], share)
        budget, left_bytes = max(1, budget - blocks[n]), left_bytes - weight_bytes(ks[n])
    return blocks


def render_siblings(
    kernels: dict[str, str], wave: int, gemvs: list[tuple[GpuKernel, Signature]]
) -> tuple[str, int]:
    """The sibling kernel of `gemvs` (each a register GEMV and its signature) and its segment
    functions, rendered into `kernels` (name -> source) where not there yet; its name and
    blocks. Its parameters are each GEMV's, in order, prefixed s0_, s1_, ..."""
    counts = segment_blocks([k for k, _ in gemvs])
    lines: list[tuple[Arg, ...]] = []
    segments, first = [], 0
    for n, ((k, sig), blocks) in enumerate(zip(gemvs, counts, strict=True)):
        name = f"{k.fn}_seg{blocks}"
        if name not in kernels:
            ctx = {"wave": wave, **k.ctx, "blocks": blocks, "segment": True,
                   "params": sig.render(len(f"HIPC_DEVICE void {name}("))}  # fmt: skip
            kernels[name] = render(f"hip/{k.template}.hip.j2", fn=k.fn, **ctx)
        lines.append(tuple(Arg(a.ctype, f"s{n}_{a.name}") for a in sig.args))
        args = ", ".join(f"s{n}_{a.name}" for a in sig.args)
        segments.append({"fn": k.fn, "blocks": blocks, "first": first, "args": args})
        first += blocks
    digest = hashlib.sha1("+".join(s["fn"] + str(s["blocks"]) for s in segments).encode())
    fn = f"linear_siblings{len(gemvs)}_{digest.hexdigest()[:8]}"
    if fn not in kernels:
        kernels[fn] = render(
            "hip/linear_gemv_siblings.hip.j2",
            fn=fn,
            segments=segments,
            threads=gemvs[0][0].threads,
            min_blocks=min(k.ctx["min_blocks"] for k, _ in gemvs),
            blocks=first,
            params=Signature(tuple(lines)).render(len(f"{fn}(")),
        )
    return fn, first


def _merged(g: GpuProgramBuilder, run: list[tuple]) -> dict:
    fn, blocks = render_siblings(g.kernels, g.target.wave, [(k, sig) for _, k, sig in run])
    return {
        "group": ",".join(launch["group"] for launch, _, _ in run),
        "kernel": fn,
        "grid": [blocks],
        "block": [run[0][1].threads],
        "shared": max(launch["shared"] for launch, _, _ in run),
        "args": [a for launch, _, _ in run for a in launch["args"]],
        "overlap": True,
    }
