"""Render the CPU program: each kernel from its kind's template, and hipc_forward(), whose
body is the launch list printed as C calls. A step is T rows of any sequences (each row its
own position and block table over the paged KV pools), so one call advances a batch.

Each call's arguments are the launch plan's bindings (codegen/bindings.py) in the order of
the kind's declared signature, printed as C expressions. Python decides every name, pointer
expression and specialization; the templates only place them. The prelude headers are
pasted into the source, so the rendered file is self-contained and its hash (the cache key)
covers everything that is compiled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hipc.base.launch_plan import KV_BLOCK
from hipc.base.version import ABI_VERSION, HIPC_VERSION
from hipc.compiler.codegen.bindings import Binder, Binding
from hipc.compiler.codegen.environment import render, template_text
from hipc.compiler.kernels.base import Arg
from hipc.compiler.passes.select import weight_order

if TYPE_CHECKING:
    from hipc.compiler.pipeline import Compilation
    from hipc.compiler.targets import Target


def paste_includes(header: str) -> str:
    """header's text with each `#include "piece.h"` replaced by the piece (recursively), minus
    include guards: the source alone then determines the binary, and its hash is the cache key."""
    folder = header.rpartition("/")[0]
    lines = []
    for line in template_text(header).split("\n"):
        m = re.fullmatch(r'#include "([\w.]+)"', line)
        if m:
            lines.append(paste_includes(f"{folder}/{m[1]}"))
        elif line != "#pragma once":
            lines.append(line)
    return "\n".join(lines)


@dataclass
class CpuProgram:
    source: str
    plan: dict[str, Any]


def render_cpu_program(c: Compilation, target: Target) -> CpuProgram:
    """c.options.activations: how quantized matmuls round the activations per 32-block:
    "int16" (within ~1e-5 of float32, the default) or "int8" (llama.cpp's choice, ~1e-2)."""
    memory = c.memory
    binder = Binder(memory, weight_order(c.kernels), [s.name for s in c.states])
    kernels: dict[str, str] = {}
    forward = []
    for k in c.kernels:
        kind = k.kind
        template, ctx = kind.cpu_kernel(k, c.options.activations)
        if k.fn not in kernels:
            kernels[k.fn] = render(template, fn=k.fn, nodes=k.nodes, **ctx, **k.params.context())
        args = kind.cpu_signature_of(k).order(kind.cpu_call(k, binder), k.fn)
        forward.append({"group": k.group, "kernel": k.fn, "args": args})
    plan = {
        "entry": "hipc_forward",
        "abi_version": ABI_VERSION,
        "arena_bytes": memory.arena_bytes,
        "scratch_bytes": 0,
        "kv_block": KV_BLOCK,
        "steps": {"forward": forward},
    }
    gathered = [a["offset"] for lt in forward for a in lt["args"] if a.get("row_skip")]
    if len(gathered) != len(set(gathered)):
        # hipc_rows compacts the rows in place: a second reader would see them moved
        raise ValueError("two launches read the logits rows of one buffer")

    # hipc_forward() is the plan's forward list, printed as C calls
    signature = {k.fn: k.kind.cpu_signature_of(k) for k in c.kernels}
    nodes = {k.group: k.nodes for k in c.kernels}
    calls = [
        {
            "group": lt["group"],
            "nodes": nodes[lt["group"]],
            "call": f"{lt['kernel']}({', '.join(map(c_arg, lt['args'], signature[lt['kernel']].args))})",
        }
        for lt in plan["steps"]["forward"]
    ]
    prelude = paste_includes("cpu/hipc_cpu.h")
    # pasted only where a MoE kernel uses it: other models' sources (and their cache keys)
    # stay as they were
    if any(k.kind.name == "moe" for k in c.kernels):
        prelude += "\n" + paste_includes("cpu/hipc_cpu_moe.h")
    source = render(
        "cpu/program.cpp.j2",
        name=c.model.name,
        hipc_version=HIPC_VERSION,
        target=target.name,
        prelude=prelude,
        kernels=list(kernels.values()),
        max_tokens=memory.max_tokens,
        max_ctx=c.max_ctx,
        kv_block=KV_BLOCK,
        kv_table=-(-c.max_ctx // KV_BLOCK),
        vocab=c.model.config.vocab_size,
        arena_floats_per_token=memory.arena_cols,
        abi_version=ABI_VERSION,
        launches=calls,
    )
    return CpuProgram(source, plan)


def c_arg(b: Binding, arg: Arg) -> str:
    """A launch-plan binding as the C expression hipc_forward() passes for `arg`."""
    kind = b["kind"]
    if kind == "arena":
        expr = f"A + {b['offset'] // 4}"
        if b.get("row_skip"):
            # the rows whose logits are wanted, gathered to the front: one per sequence
            expr = f"hipc_rows({expr}, {b['row_skip']}, out_rows, n_out)"
        return expr
    if kind == "output":
        return "logits"
    if kind == "weight":
        return f"({arg.pointer_type})W[{b['index']}]"
    if kind == "state":
        return f"KV[{b['index']}]"
    if kind == "input":
        return b["name"]  # hipc_forward's own ids / pos / seq / blocks
    if kind == "int":
        return str(b["value"])
    if kind == "null":
        return "nullptr"
    raise ValueError(f"no CPU form for a {kind} argument")
