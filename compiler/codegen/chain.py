"""Chains: runs of consecutive decode GEMVs launched as the phases of one kernel.

In the decode step a quantized GEMV's blocks fill their SMs (16 waves of ~120 registers), so
the next GEMV's blocks cannot be resident beside them: each kernel boundary is the last
block's exit, the next grid's launch, its first weight loads' round trip and only then its
work (docs/benchmarks/gpu-h200.md, session 13's timeline: 1.4-2.4 us a boundary, three a
layer). A chain (templates/hip/linear_chain.hip.j2) runs such a run of GEMVs (o, gate/up,
down and the next layer's q/k/v between two attentions) in one grid whose blocks stay
resident: after a phase each block loads the next phase's first weights, then meets the
others at a barrier (prelude: hipc_chain) and goes on. Each phase is the GEMV's own template
rendered as a device function (its `phase` flag), so a chain computes what its GEMVs do.

Only where the GPU can hold every block at once: NVIDIA sm_90+ (where kernels already
overlap), GEMVs of one block per SM and the same block size; the launch says `resident`
and the runtime refuses a GPU that cannot hold the grid. HIPC_DECODE_CHAIN=1 at compile time
turns chains on (docs/benchmarks/chain_check.py compares the two).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.base import Arg, Signature

if TYPE_CHECKING:
    from hipc.compiler.codegen.hip import GpuProgramBuilder
    from hipc.compiler.kernels.base import GpuKernel
    from hipc.compiler.targets import GpuTarget

CHAIN_ENV = "HIPC_DECODE_CHAIN"
COUNT = Arg("unsigned long long*", "count")  # the launch's barrier counter (scratch)


def chains_enabled(target: GpuTarget) -> bool:
    """Opt-in (HIPC_DECODE_CHAIN=1) until timed on the H200 against separate kernels."""
    return target.family == "nvidia" and target.sm >= 90 and os.environ.get(CHAIN_ENV) == "1"


def chainable(launch: dict, k: GpuKernel | None) -> bool:
    """A quantized decode GEMV whose blocks each take an SM, launched to overlap."""
    return (
        k is not None
        and k.template == "linear_gemv_q"
        and launch.get("overlap", False)
        and "tokens" not in launch
        and k.ctx["min_blocks"] == 1
        and not k.ctx["l2_prefetch"]
        and not k.ctx["next_prefetch"]
    )


def chain_decode(g: GpuProgramBuilder, specs: dict[str, GpuKernel], sigs: list[Signature]) -> None:
    """Replace each run of two or more chainable decode launches of one block size by a
    chain launch. `specs`: the rendered kernels by name; `sigs`: each decode launch's
    signature, in order."""
    launches = g.steps["decode"]
    out: list[dict] = []
    i = 0
    while i < len(launches):
        j = i
        if chainable(launches[i], specs.get(launches[i]["kernel"])):
            threads = specs[launches[i]["kernel"]].threads
            while (
                j + 1 < len(launches)
                and chainable(launches[j + 1], specs.get(launches[j + 1]["kernel"]))
                and specs[launches[j + 1]["kernel"]].threads == threads
            ):
                j += 1
        if j == i:
            out.append(launches[i])
        else:
            out.append(_chain(g, [specs[launches[n]["kernel"]] for n in range(i, j + 1)],
                              launches[i : j + 1], sigs[i : j + 1]))  # fmt: skip
        i = j + 1
    g.steps["decode"] = out


def _chain(
    g: GpuProgramBuilder, ks: list[GpuKernel], launches: list[dict], sigs: list[Signature]
) -> dict:
    lines: list[tuple[Arg, ...]] = []
    phases = []
    for n, (k, sig) in enumerate(zip(ks, sigs, strict=True)):
        if f"{k.fn}_phase" not in g.kernels:
            plain = Signature(tuple(tuple(Arg(a.pointer_type, a.name) for a in line)
                                    for line in sig.lines))  # fmt: skip
            indent = len("HIPC_PHASE void {{ fn }}_phase(")
            ctx = {"wave": g.target.wave, **k.ctx, "phase": True, "params": plain.render(indent)}
            g.kernels[f"{k.fn}_phase"] = render(f"hip/{k.template}.hip.j2", fn=k.fn, **ctx)
        lines.append(tuple(Arg(a.pointer_type, f"p{n}_{a.name}") for a in sig.args))
        phases.append({"fn": k.fn, "args": ", ".join(f"p{n}_{a.name}" for a in sig.args)})
    lines.append((COUNT,))
    digest = hashlib.sha1("+".join(k.fn for k in ks).encode()).hexdigest()[:8]
    fn = f"linear_chain{len(ks)}_{digest}"
    blocks = max(k.grid[0] for k in ks)
    if fn not in g.kernels:
        g.kernels[fn] = render(
            "hip/linear_chain.hip.j2",
            fn=fn,
            phases=phases,
            threads=ks[0].threads,
            blocks=blocks,
            params=Signature(tuple(lines)).render(len("{{ fn }}(")),
        )
    count = g.chain_counter()
    return {
        "group": ",".join(launch["group"] for launch in launches),
        "kernel": fn,
        "grid": [blocks],
        "block": [ks[0].threads],
        "shared": max(launch["shared"] for launch in launches),
        "args": [a for launch in launches for a in launch["args"]]
        + [{"kind": "scratch", "offset": count}],
        "overlap": True,
        "resident": True,
    }
