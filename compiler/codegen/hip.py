"""Render the HIP program for one GPU arch and the launch lists the runtime replays.

One source holds every kernel (deduplicated by specialization); plan.json's "gpu"
section lists, for decode (one token, GEMV-shaped kernels) and prefill (T tokens,
GEMM-shaped kernels), each launch's kernel, grid/block and argument bindings in the
format runtime/gpu_plan.py reads. Python decides names, geometry and bindings; the
templates only place them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hipc.compiler.codegen.environment import WEIGHT_SUFFIX, render, template_text
from hipc.compiler.codegen.hip_kernels import (
    ATTN_WAVES,
    DECODE_WAVES,
    MAX_GEMV_K,
    MMA_TILES,
    decode_attention,
    decode_gemv,
    kv_context,
    prefill_gemm,
    wave_size,
)
from hipc.compiler.passes.fuse import FusionError
from hipc.compiler.passes.memory import MemoryPlan
from hipc.compiler.passes.select import Launch, weight_order

# Kernel parameters (select.PARAM_DEFAULTS) the GPU templates do not implement yet. A
# whole-row post-norm needs every output of a row in one block, which the GEMV's row
# split does not give.
GPU_UNSUPPORTED = {
    "linear": ("act", "post_norm_eps", "softcap"),
    "attention": ("softcap",),
    "embedding": ("scale",),
}


@dataclass
class HipProgram:
    source: str
    weights: list[str]
    states: list[str]
    gpu: dict[str, Any]


def render_hip_program(
    name: str,
    launches: list[Launch],
    memory: MemoryPlan,
    states: list[str],
    hipc_version: str,
    target: str,
    max_ctx: int,
    kv_storage: str = "float32",
    quant_layout: str = "split",
) -> HipProgram:
    wave = wave_size(target)
    weights = weight_order(launches)
    kernels: dict[str, str] = {}
    # scratch: inv_rms [max_tokens] for the GEMM norm, then the decode attention's partials
    # and its per-head counters (zeroed at load; the merging block resets its counter)
    partial_at = -(-4 * memory.max_tokens // 256) * 256
    scratch_need = partial_at
    decode: list[dict] = []
    prefill: list[dict] = []

    def act(value: str, row_skip: bool = False) -> dict:
        view = memory.views[value]
        if view.buffer in memory.outputs:
            return {"kind": "output", "name": value}
        offset = 4 * (memory.offsets[view.buffer] * memory.max_tokens + view.col)
        arg = {"kind": "arena", "offset": offset}
        if row_skip:
            arg["row_skip"] = view.ld
        return arg

    def bind(ref: tuple[str, str | None]) -> dict:
        kind, what = ref
        if kind == "weight":
            return {"kind": "weight", "index": weights.index(what)}
        if kind == "state":
            return {"kind": "state", "index": states.index(what)}
        if kind == "none":
            return {"kind": "null"}
        raise ValueError(kind)

    def add_kernel(fn: str, template: str, **ctx: Any) -> str:
        if fn not in kernels:
            kernels[fn] = render(f"hip/{template}.hip.j2", **{"fn": fn, "wave": wave, **ctx})
        return fn

    for launch in launches:
        spec, a = launch.kernel, launch.args
        p = spec.param_dict
        nodes = launch.nodes
        if spec.template in ("linear", "embedding") and p["wtype"] not in WEIGHT_SUFFIX:
            raise FusionError(f"{launch.group}: weight type {p['wtype']} has no HIP kernel")
        missing = [k for k in GPU_UNSUPPORTED.get(spec.template, ()) if k in dict(spec.params)]
        if missing:
            raise FusionError(
                f"{launch.group}: the GPU {spec.template} kernels have no {', '.join(missing)} "
                "yet (the cpu target has)"
            )
        ws = WEIGHT_SUFFIX.get(p.get("wtype", ""), "")
        if spec.template == "linear":
            n_out = p["N"] // 2 if p["epilogue"] == "glu" else p["N"]
            if p["K"] > MAX_GEMV_K:
                raise FusionError(
                    f"{launch.group}: K={p['K']} exceeds the GEMV's shared-memory row ({MAX_GEMV_K})"
                )
            last_only = memory.views[a["y"][1]].buffer in memory.outputs
            x = act(a["x"][1], row_skip=last_only)
            res = act(a["res"][1]) if a["res"][0] == "act" else {"kind": "null"}
            y = act(a["y"][1])
            dk = decode_gemv(spec.fn, p, target, nodes)
            decode.append(
                _launch(
                    launch.group,
                    add_kernel(dk.fn, dk.template, **dk.ctx),
                    dk.grid,
                    [dk.threads],
                    [x, bind(a["w"]), bind(a["norm_w"]), bind(a["bias"]), res, y],
                    shared=dk.shared,
                    overlap=True,
                )
            )
            pg = prefill_gemm(spec.fn, p, target, nodes)
            gemm = add_kernel(pg.fn, pg.template, **pg.ctx)
            rows = "rows" if last_only else "T"
            inv_rms = {"kind": "scratch", "offset": 0}
            if p["norm_eps"]:
                prefill.append(
                    _launch(
                        launch.group,
                        f"{gemm}_stats",
                        [rows],
                        [256],
                        [x, {"kind": "int", "value": rows}, inv_rms],
                    )
                )
            prefill.append(
                _launch(
                    launch.group,
                    gemm,
                    [-(-n_out // pg.block_outputs), f"cdiv({rows},{pg.block_tokens})"],
                    [pg.threads],
                    [
                        x,
                        {"kind": "int", "value": rows},
                        bind(a["w"]),
                        bind(a["norm_w"]),
                        inv_rms if p["norm_eps"] else {"kind": "null"},
                        bind(a["bias"]),
                        res,
                        y,
                    ],
                    shared=pg.shared,
                )
            )
        elif spec.template == "attention":
            D = p["D"]
            qv, kv, vv = (memory.views[a[n][1]] for n in ("q", "k", "v"))
            kv_ctx = kv_context(kv_storage)
            block = max(D // 2, wave)
            rope = add_kernel(
                f"{spec.fn}_rope_kv", "rope_kv", nodes=nodes, block=block, **kv_ctx, **p
            )
            attn = add_kernel(
                f"{spec.fn}_attn", "attention", nodes=nodes, waves=ATTN_WAVES, **kv_ctx, **p
            )
            if DECODE_WAVES * wave < D // 2:
                raise FusionError(f"{launch.group}: head dim {D} is too wide for the decode block")
            dk = decode_attention(spec.fn, p, target, nodes, max_ctx, kv_storage)
            attn_decode = add_kernel(dk.fn, dk.template, **dk.ctx)
            splits = dk.grid[1]
            counters_at = partial_at + 4 * p["NH"] * splits * (D + 2)
            scratch_need = max(scratch_need, counters_at + 4 * p["NH"])
            start = {"kind": "input", "name": "start"}
            cos, sin = bind(a["cos"]), bind(a["sin"])
            kc, vc = bind(a["k_cache"]), bind(a["v_cache"])
            q, k, v = act(a["q"][1]), act(a["k"][1]), act(a["v"][1])
            prefill.append(
                _launch(
                    launch.group,
                    rope,
                    ["T", p["NKV"]],
                    [block],
                    [
                        k,
                        {"kind": "int", "value": kv.ld},
                        v,
                        {"kind": "int", "value": vv.ld},
                        start,
                        bind(a["k_norm_w"]),
                        cos,
                        sin,
                        kc,
                        vc,
                    ],
                )
            )
            prefill.append(
                _launch(
                    launch.group,
                    attn,
                    ["T", p["NH"]],
                    [ATTN_WAVES * wave],
                    [
                        q,
                        {"kind": "int", "value": qv.ld},
                        start,
                        bind(a["q_norm_w"]),
                        cos,
                        sin,
                        kc,
                        vc,
                        act(a["out"][1]),
                    ],
                )
            )
            decode.append(
                _launch(
                    launch.group,
                    attn_decode,
                    dk.grid,
                    [dk.threads],
                    [
                        q,
                        k,
                        v,
                        start,
                        bind(a["q_norm_w"]),
                        bind(a["k_norm_w"]),
                        cos,
                        sin,
                        kc,
                        vc,
                        {"kind": "scratch", "offset": partial_at},
                        {"kind": "scratch", "offset": counters_at},
                        act(a["out"][1]),
                    ],
                    overlap=True,
                )
            )
        elif spec.template == "embedding":
            emb = add_kernel(f"{spec.fn}_embed", "embedding", nodes=nodes, wsuffix=ws, **p)
            for plan in (decode, prefill):
                plan.append(
                    _launch(
                        launch.group,
                        emb,
                        ["T"],
                        [256],
                        [{"kind": "input", "name": "ids"}, bind(a["w"]), act(a["out"][1])],
                        overlap=plan is decode,
                    )
                )

    source = program_source(name, hipc_version, target, list(kernels.values()), quant_layout)
    gpu = {
        "arena_bytes": 4 * memory.max_tokens * memory.arena_cols,
        "scratch_bytes": scratch_need,
        "wave": wave,
        "decode": decode,
        "prefill": prefill,
    }
    return HipProgram(source, weights, states, gpu)


def program_source(
    name: str, hipc_version: str, target: str, kernels: list[str], quant_layout: str = "split"
) -> str:
    """One compilable HIP source: the prelude for `target`, then the rendered kernels.
    `quant_layout`: how the artifact stores quantized blocks (CompileOptions.quant_layout)."""
    tile = MMA_TILES.get(target)
    return render(
        "hip/program.hip.j2",
        name=name,
        qsplit=int(quant_layout == "split"),
        hipc_version=hipc_version,
        target=target,
        wave=wave_size(target),
        mma_macro=tile.macro if tile else None,
        prelude=template_text("hip/prelude.h").replace("#pragma once", ""),
        kernels=kernels,
    )


def _launch(
    group: str,
    kernel: str,
    grid: list,
    block: list,
    args: list[dict],
    shared: int = 0,
    overlap: bool = False,
) -> dict:
    launch = {
        "group": group,
        "kernel": kernel,
        "grid": grid,
        "block": block,
        "shared": shared,
        "args": args,
    }
    if overlap:
        # the kernel waits for the one before (hipc_wait_prior) before touching its outputs,
        # so the runtime may launch it early where the GPU allows (programmatic launch)
        launch["overlap"] = True
    return launch
