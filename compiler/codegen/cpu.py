"""Render the CPU program: kernels from templates/cpu and hipc_forward() from the launch list.

Python decides every name, pointer expression and specialization; the templates only
place them. The prelude headers are pasted into the source, so the rendered file is
self-contained and its hash (the cache key) covers everything that is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass

from hipc.base.version import ABI_VERSION
from hipc.compiler.codegen.environment import CPU_WTYPES, WEIGHT_SUFFIX, render, template_text
from hipc.compiler.passes.fuse import FusionError
from hipc.compiler.passes.memory import MemoryPlan
from hipc.compiler.passes.select import Launch, weight_order


@dataclass
class Program:
    source: str
    weights: list[str]  # W[i] order
    states: list[str]  # KV[j] order


def render_cpu_program(
    name: str,
    launches: list[Launch],
    memory: MemoryPlan,
    states: list[str],
    max_ctx: int,
    vocab: int,
    hipc_version: str,
    target: str,
    activations: str = "int16",
) -> Program:
    """activations: how quantized matmuls round the activations per 32-block: "int16"
    (within ~1e-5 of float32, the default) or "int8" (llama.cpp's choice, ~1e-2 error)."""
    weights = weight_order(launches)

    def weight(ref: str, ctype: str = "const float") -> str:
        return f"({ctype}*)W[{weights.index(ref)}]"

    def act(value: str, row_offset: str = "") -> tuple[str, int]:
        view = memory.views[value]
        if view.buffer in memory.outputs:
            base = "logits"
        else:
            base = f"A + {memory.offsets[view.buffer] * memory.max_tokens + view.col}"
        return (f"{base}{row_offset}", view.ld)

    kernels: dict[str, str] = {}
    calls = []
    for launch in launches:
        spec = launch.kernel
        p = spec.param_dict
        a = launch.args
        if spec.template in ("linear", "embedding") and p["wtype"] not in CPU_WTYPES:
            raise FusionError(
                f"{launch.group}: weight type {p['wtype']} has no CPU kernel "
                f"(supported: {', '.join(CPU_WTYPES)})"
            )
        if spec.fn not in kernels:
            kernels[spec.fn] = render(
                f"cpu/{spec.template}.cpp.j2",
                fn=spec.fn,
                nodes=launch.nodes,
                wsuffix=WEIGHT_SUFFIX.get(p.get("wtype", ""), ""),
                mm=("a16_" if activations == "int16" else "")
                + WEIGHT_SUFFIX.get(p.get("wtype", ""), ""),
                **p,
            )

        def opt(kind_ref: tuple[str, str | None]) -> str:
            return weight(kind_ref[1]) if kind_ref[0] == "weight" else "nullptr"

        if spec.template == "linear":
            y_value = a["y"][1]
            last_only = memory.views[y_value].buffer in memory.outputs
            rows = "rows" if last_only else "T"
            skip = f" + (size_t)(T - rows) * {p['K']}" if last_only else ""
            x, ldx = act(a["x"][1], skip)
            if ldx != p["K"]:
                raise FusionError(f"{launch.group}: input rows are strided ({ldx} != {p['K']})")
            res = act(a["res"][1])[0] if a["res"][0] == "act" else "nullptr"
            y = act(y_value)[0]
            post_norm = f", {weight(a['post_norm_w'][1])}" if p["post_norm_eps"] else ""
            calls.append(
                f"{spec.fn}({rows}, {x}, {weight(a['w'][1], 'const void')}, {opt(a['norm_w'])}, "
                f"{opt(a['bias'])}, {res}, {y}{post_norm})"
            )
        elif spec.template == "attention":
            (q, ldq), (k, ldk), (v, ldv) = (act(a[n][1]) for n in ("q", "k", "v"))
            kc, vc = states.index(a["k_cache"][1]), states.index(a["v_cache"][1])
            calls.append(
                f"{spec.fn}(T, start, {q}, {ldq}, {k}, {ldk}, {v}, {ldv}, {opt(a['q_norm_w'])}, "
                f"{opt(a['k_norm_w'])}, {weight(a['cos'][1])}, {weight(a['sin'][1])}, KV[{kc}], KV[{vc}], "
                f"{act(a['out'][1])[0]})"
            )
        elif spec.template == "embedding":
            calls.append(
                f"{spec.fn}(T, ids, {weight(a['w'][1], 'const void')}, {act(a['out'][1])[0]})"
            )

    # pasted in whole (minus include guards) so the source alone determines the binary
    prelude = "\n".join(
        template_text(f"cpu/{h}").replace("#pragma once", "")
        for h in ("hipc_cpu.h", "hipc_cpu_ops.h")
    )
    source = render(
        "cpu/program.cpp.j2",
        name=name,
        hipc_version=hipc_version,
        target=target,
        prelude=prelude,
        kernels=list(kernels.values()),
        max_tokens=memory.max_tokens,
        max_ctx=max_ctx,
        vocab=vocab,
        arena_floats_per_token=memory.arena_cols,
        abi_version=ABI_VERSION,
        launches=[
            {"group": lt.group, "nodes": lt.nodes, "call": c}
            for lt, c in zip(launches, calls, strict=True)
        ],
    )
    return Program(source, weights, states)
