"""moe: a sparse layer's routed experts, reading only the experts its tokens chose.

Anchors on hipc::Experts. Takes its hipc::MoERouter as a prologue (the expert ids and
weights never leave the kernel) and a residual Add as its epilogue (the residual stream
updated in place). CPU: templates/cpu/moe.cpp.j2 over hipc_cpu_moe.h: routing as
torch.topk orders ties, tokens grouped by expert, three matmuls per routed expert over
its tokens (decode: k GEMVs of each; prefill: one GEMM per routed expert).

GPU (templates/hip/moe_*.hip.j2): routing on the device, inside the captured decode graph.
Decode is two kernels: `_up` routes the token in every block (E logits, cheaper than a
launch) and computes silu(gate) * up for the k routed experts' rows only; `_down` multiplies
each output's k expert rows as one row against the k activations, scales each expert's part
by its weight, and adds the residual (the sum is complete in one lane: no atomics). Prefill
groups the (token, slot) pairs by expert on the device (count, prefix sum, scatter) and runs
a grouped GEMM over tiles that never straddle two experts (bf16 experts on the matrix
instructions, moe_mma.hip.j2 after linear_mma's pipeline; other types SIMT, dequantized on
load), then a combine kernel adds each token's k rows in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hipc.compiler.codegen.environment import WEIGHT_SUFFIX
from hipc.compiler.ir import Graph, Node
from hipc.compiler.kernels.base import (
    CPU_INDENT,
    GPU_INDENT,
    FusionError,
    GpuKernel,
    KernelKind,
    Params,
    SelectedKernel,
    Signature,
)
from hipc.compiler.kernels.linear import MmaTile

if TYPE_CHECKING:
    from hipc.compiler.codegen.bindings import Binder
    from hipc.compiler.codegen.hip import GpuProgramBuilder
    from hipc.compiler.passes.fuse import FusedGroup, Proposals
    from hipc.compiler.targets import GpuTarget

# bytes of one row of `n` inputs per storage type (GGUF blocks of 32)
_BLOCK = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
_DENSE = {"float32": 4, "float16": 2, "bfloat16": 2}


def row_bytes(wtype: str, n: int) -> int:
    if wtype in _BLOCK:
        return n // 32 * _BLOCK[wtype]
    return n * _DENSE[wtype]


@dataclass(frozen=True)
class MoEParams(Params):
    wtype: str  # the experts' storage type (all three alike)
    E: int  # experts
    top_k: int  # experts per token
    H: int  # hidden width (the experts' input and output)
    F: int  # an expert's intermediate width
    normalize: bool  # renormalise the routed weights
    fused_gate_up: bool  # gate and up as one [2F, H] block per expert (HF transformers >= 5)
    residual: bool

    def tag(self) -> str:
        return f"{self.wtype}_e{self.E}k{self.top_k}_{self.H}x{self.F}"


CPU = Signature.parse("""
int T, const float* x, const float* logits, int ldl, const void* gate, const void* up,
const void* down, const float* res, float* y
""")

# the GPU kernels (templates/hip/moe_decode.hip.j2, moe_prefill.hip.j2)
UP = Signature.parse("""
const float* __restrict__ x, const float* __restrict__ logits, const void* __restrict__ gate,
const void* __restrict__ up, float* __restrict__ act, int* route_ids, float* route_w
""")
DOWN = Signature.parse("""
const float* __restrict__ act, const int* __restrict__ route_ids,
const float* __restrict__ route_w, const void* __restrict__ down, const float* res, float* y
""")
ROUTE = Signature.parse("const float* __restrict__ logits, int ldl, int* route_ids, float* route_w")
GROUP = Signature.parse("const int* __restrict__ route_ids, int T, int* src, int* pos, int* tiles")
GATE_UP = Signature.parse("""
const float* __restrict__ x, const int* __restrict__ src, const int* __restrict__ tiles,
const void* __restrict__ gate, const void* __restrict__ up, float* __restrict__ act
""")
PREFILL_DOWN = Signature.parse("""
const float* __restrict__ act, const int* __restrict__ tiles, const void* __restrict__ down,
float* __restrict__ out
""")
COMBINE = Signature.parse("""
const float* __restrict__ out, const int* __restrict__ pos, const float* __restrict__ route_w,
const float* res, float* y
""")

GPU_WTYPES = ("float32", "float16", "bfloat16", "q4_0", "q4_1", "q8_0")
MOE_WAVES = 8  # waves per decode block
MOE_ROWS = 2  # outputs per wave in _up, and in _down for dense types (two rows per dot)
# _down of quantized experts: one output per wave, so that H / 8 blocks cover the GPU, with up
# to this many 32-weight blocks per lane in flight (q8_0 blocks are twice the bytes)
MOE_DOWN_UNITS = {"q4_0": 8, "q4_1": 8, "q8_0": 4}
TILE = 64  # the prefill GEMM's rows (token, slot pairs) and outputs per tile
XQ_BLOCK_BYTES = 80  # x staged per 32 values as int8 hi + lo (prelude: hipc_xq<true>::INTS * 4)


# The grouped prefill GEMMs on matrix instructions (bf16 experts), linear_mma's pipeline on
# tiles of TILE rows (an expert's rows rarely fill 128): 64 rows x 128 weight rows a block,
# 256 threads, every wave's columns an even number of MMA tiles (gate and up halves).
MOE_MMA_TILES = {
    **dict.fromkeys(
        ("sm_80", "sm_89", "sm_90"),
        MmaTile("HIPC_MMA_NV", "mma.sync.m16n8k16 bf16", TILE, 128, 32, 2, 4),
    ),
    **dict.fromkeys(
        ("gfx1100", "gfx1101", "gfx1151"),
        MmaTile("HIPC_MMA_WMMA", "v_wmma_f32_16x16x16_bf16", TILE, 128, 16, 2, 4),
    ),
    "gfx1201": MmaTile("HIPC_MMA_WMMA12", "v_wmma_f32_16x16x16_bf16 (gfx12)", TILE, 128, 16, 2, 4),
    **dict.fromkeys(
        ("gfx90a", "gfx942"),
        MmaTile("HIPC_MMA_MFMA", "v_mfma_f32_16x16x16_bf16", TILE, 128, 32, 1, 4),
    ),
}


@dataclass(frozen=True)
class GroupedGemm:
    """One prefill GEMM launch over the tile list: kernel name, grid.x, threads, shared bytes."""

    kernel: str
    blocks_x: int
    threads: int
    shared: int = 0


@dataclass(frozen=True)
class MoEGpu:
    """The GPU kernels of one moe kernel and their launch geometry."""

    decode: GpuKernel  # renders {fn}_up and {fn}_down
    prefill: GpuKernel  # renders {fn}_route, _group, _gate_up, _down, _combine
    up_blocks: int
    down_blocks: int
    threads: int
    up_shared: int  # dynamic shared bytes of _up / _down (x / act staged, quantized types)
    down_shared: int
    max_tiles: int  # the prefill GEMMs' grid.y: tiles there can be for max_tokens tokens
    mma: GpuKernel | None  # renders {fn}_gate_up and {fn}_down on matrix instructions
    gate_up: GroupedGemm  # the prefill GEMMs launched (SIMT, or those of `mma`)
    down: GroupedGemm

    def scratch(self, max_tokens: int, p: MoEParams) -> dict[str, int]:
        pairs = max_tokens * p.top_k
        return {
            "moe_ids": 4 * pairs,
            "moe_w": 4 * pairs,
            "moe_src": 4 * pairs,
            "moe_pos": 4 * pairs,
            "moe_tiles": 4 * (3 * self.max_tiles + 1),
            "moe_act": 4 * pairs * p.F,
            "moe_out": 4 * pairs * p.H,
        }


def max_tiles(max_tokens: int, p: MoEParams) -> int:
    """Tiles of TILE rows, none straddling two experts: each expert with rows adds at most one
    partial tile to the full ones."""
    pairs = max_tokens * p.top_k
    return pairs // TILE + min(p.E, pairs)


def gpu_kernels(
    fn: str, p: MoEParams, target: GpuTarget, nodes: list[str], max_tokens: int
) -> MoEGpu:
    wave = target.wave
    ws = WEIGHT_SUFFIX[p.wtype]
    quant = p.wtype in _BLOCK
    # quantized: whole 32-weight blocks; dense: the GEMVs' 16-byte loads
    unit = 32 if quant else 16 // _DENSE[p.wtype]
    if p.H % unit or p.F % unit:
        raise FusionError(
            f"{nodes[0]}: the GPU experts kernels need widths in multiples of {unit} "
            f"(hidden {p.H}, expert {p.F})"
        )
    tiles = max_tiles(max_tokens, p)
    common = dict(nodes=nodes, wave=wave, wsuffix=ws, quant=quant, **p.context())
    threads = MOE_WAVES * wave
    p_down = 1 if quant else MOE_ROWS
    up_blocks = -(-p.top_k * p.F // (MOE_WAVES * MOE_ROWS))
    down_blocks = -(-p.H // (MOE_WAVES * p_down))
    down_steps = -(-(p.top_k * p.F // 32) // wave)  # blocks per lane of a quantized _down row
    decode = GpuKernel(
        f"{fn}_decode",
        "moe_decode",
        dict(
            common,
            waves=MOE_WAVES,
            P=MOE_ROWS,
            P_down=p_down,
            unroll=min(down_steps, MOE_DOWN_UNITS.get(p.wtype, 1)),
            up_blocks=up_blocks,
            down_blocks=down_blocks,
            up_params=UP.render(GPU_INDENT + 3),
            down_params=DOWN.render(GPU_INDENT + 5),
        ),
        [up_blocks],
        threads,
    )
    tile = MOE_MMA_TILES.get(target.arch)
    if p.wtype != "bfloat16" or p.H % 8 or p.F % 8:
        tile = None  # the instructions take bf16 weights as stored, 16 bytes at a time
    prefill = GpuKernel(
        f"{fn}_prefill",
        "moe_prefill",
        dict(
            common,
            mma=tile is not None,
            bm=TILE,
            bn=TILE,
            max_tiles=tiles,
            route_params=ROUTE.render(0),
            group_params=GROUP.render(0),
            gate_up_params=GATE_UP.render(GPU_INDENT + 8),
            down_params=PREFILL_DOWN.render(GPU_INDENT + 5),
            combine_params=COMBINE.render(GPU_INDENT + 8),
        ),
        [],
        256,
    )
    mma = None
    gate_up = GroupedGemm(f"{prefill.fn}_gate_up", -(-p.F // TILE), 256)
    down = GroupedGemm(f"{prefill.fn}_down", -(-p.H // TILE), 256)
    if tile is not None:
        mma = GpuKernel(
            f"{fn}_mma",
            "moe_mma",
            dict(
                common,
                instruction=tile.instruction,
                bm=tile.bm,
                bn=tile.bn,
                bk=tile.bk,
                wm=tile.wm,
                wn=tile.wn,
                min_blocks=tile.min_blocks,
                max_tiles=tiles,
                gate_up_params=GATE_UP.render(GPU_INDENT + 8),
                down_params=PREFILL_DOWN.render(GPU_INDENT + 5),
            ),
            [],
            tile.wm * tile.wn * wave,
            tile.shared_bytes(split=True),
        )
        # the grouped GEMMs stage x as bf16 hi + lo (as the dense GEMM's `split` policy)
        threads_mma, smem = tile.wm * tile.wn * wave, tile.shared_bytes(split=True)
        gate_up = GroupedGemm(f"{mma.fn}_gate_up", -(-p.F // (tile.bn // 2)), threads_mma, smem)
        down = GroupedGemm(f"{mma.fn}_down", -(-p.H // tile.bn), threads_mma, smem)
    return MoEGpu(
        decode,
        prefill,
        up_blocks,
        down_blocks,
        threads,
        p.H // 32 * XQ_BLOCK_BYTES if quant else 0,
        p.top_k * p.F // 32 * XQ_BLOCK_BYTES if quant else 0,
        tiles,
        mma,
        gate_up,
        down,
    )


ROUTING = GpuKernel("hipc_moe_routing", "moe_route", {}, [], 0)  # device functions, once


class MoE(KernelKind):
    name = "moe"
    anchors = frozenset({"hipc::Experts"})
    roles = frozenset({"prologue:router", "epilogue:residual"})
    cpu_signature = CPU

    def propose(self, graph: Graph, n: Node, p: Proposals) -> None:
        router = graph.producer(n.inputs[1])
        if router is not None and router.op == "hipc::MoERouter":
            others = [u.name for o in router.outputs for u in p.users(o) if u is not n]
            why = f"its routes are also read by {', '.join(others)}" if others else None
            p.propose(n, router, "prologue:router", router.outputs[1], why, side="prologue")
        user = p.only_user(n.outputs[0])
        if user is not None and user.op == "Add":
            p.propose(n, user, "epilogue:residual", n.outputs[0])
        elif user is not None:
            p.propose(
                n, user, "epilogue", n.outputs[0], f"no {user.op} epilogue in the moe kernels"
            )

    def select(self, g: Graph, grp: FusedGroup) -> SelectedKernel:
        ex = grp.anchor
        x, _, _, *ws = ex.inputs
        router = grp.node_with_role("prologue:router")
        if router is None:
            raise FusionError(
                f"{grp.name}: the experts kernel routes its tokens itself, "
                "but its MoERouter could not join it"
            )
        dtypes = {g.values[w].dtype for w in ws}
        if len(dtypes) != 1:
            raise FusionError(f"{grp.name}: expert weights in mixed types {sorted(dtypes)}")
        E, H, F = (int(d) for d in g.values[ws[-1]].shape)
        fused = len(ws) == 2
        refs: dict[str, Any] = {
            "x": ("act", x),
            "logits": ("act", router.inputs[0]),
            "gate": ("weight", ws[0]),
            "up": ("weight", ws[0] if fused else ws[1]),
            "down": ("weight", ws[-1]),
            "res": ("none", None),
        }
        y = ex.outputs[0]
        if (add := grp.node_with_role("epilogue:residual")) is not None:
            y = add.outputs[0]
            refs["res"] = ("act", next(i for i in add.inputs if i != ex.outputs[0]))
        refs["y"] = ("act", y)
        params = MoEParams(
            wtype=dtypes.pop(),
            E=E,
            top_k=int(router.attrs["top_k"]),
            H=H,
            F=F,
            normalize=bool(router.attrs.get("normalize")),
            fused_gate_up=fused,
            residual=add is not None,
        )
        return SelectedKernel(grp.name, grp.node_names, self, params, refs)

    def cpu_kernel(self, k: SelectedKernel, activations: str) -> tuple[str, dict[str, Any]]:
        p: MoEParams = k.params
        if p.wtype not in _BLOCK and p.wtype not in _DENSE:
            kinds = ", ".join([*_DENSE, *_BLOCK])
            raise FusionError(
                f"{k.refs['gate'][1]}: expert weight type {p.wtype} has no CPU MoE kernel "
                f"(supported: {kinds})"
            )
        ws = WEIGHT_SUFFIX[p.wtype]
        in_row = row_bytes(p.wtype, p.H)
        return "cpu/moe.cpp.j2", dict(
            mm=("a16_" if activations == "int16" else "") + ws,
            params=CPU.render(CPU_INDENT),
            in_row_bytes=in_row,
            gate_stride=(2 if p.fused_gate_up else 1) * p.F * in_row,
            down_stride=p.H * row_bytes(p.wtype, p.F),
        )

    def cpu_call(self, k: SelectedKernel, b: Binder) -> dict[str, Any]:
        p: MoEParams = k.params
        r = k.refs
        if b.ld(r["x"][1]) != p.H:
            raise FusionError(f"{k.group}: input rows are strided ({b.ld(r['x'][1])} != {p.H})")
        return {
            "T": b.int("T"),
            "x": b.act(r["x"][1]),
            "logits": b.act(r["logits"][1]),
            "ldl": b.int(b.ld(r["logits"][1])),
            "gate": b.ref(r["gate"]),
            "up": b.ref(r["up"]),
            "down": b.ref(r["down"]),
            "res": b.ref(r["res"]),
            "y": b.act(r["y"][1]),
        }

    def _gpu(self, k: SelectedKernel, g: GpuProgramBuilder) -> MoEGpu:
        p: MoEParams = k.params
        if p.wtype not in GPU_WTYPES:
            raise FusionError(
                f"{k.refs['gate'][1]}: expert weight type {p.wtype} has no GPU MoE kernel "
                f"(supported: {', '.join(GPU_WTYPES)})"
            )
        return gpu_kernels(k.fn, p, g.target, k.nodes, g.max_tokens)

    def gpu_scratch(self, k: SelectedKernel, g: GpuProgramBuilder) -> dict[str, int]:
        return self._gpu(k, g).scratch(g.max_tokens, k.params)

    def gpu(self, k: SelectedKernel, b: Binder, g: GpuProgramBuilder) -> None:
        p: MoEParams = k.params
        r = k.refs
        if b.ld(r["x"][1]) != p.H or b.ld(r["y"][1]) != p.H:
            raise FusionError(f"{k.group}: the experts' rows are strided")
        m = self._gpu(k, g)
        g.kernel(ROUTING)
        dec, pre = g.kernel(m.decode), g.kernel(m.prefill)
        if m.mma is not None:
            g.kernel(m.mma)
        s = {name: b.scratch(g.scratch(name)) for name in m.scratch(g.max_tokens, p)}
        x, y, res = b.act(r["x"][1]), b.act(r["y"][1]), b.ref(r["res"])
        logits = b.act(r["logits"][1])
        gate, up, down = b.ref(r["gate"]), b.ref(r["up"]), b.ref(r["down"])
        block = [m.threads]
        g.launch("decode", k.group, f"{dec}_up", [m.up_blocks], block, UP,
                 {"x": x, "logits": logits, "gate": gate, "up": up, "act": s["moe_act"],
                  "route_ids": s["moe_ids"], "route_w": s["moe_w"]},
                 shared=m.up_shared, overlap=True)  # fmt: skip
        g.launch("decode", k.group, f"{dec}_down", [m.down_blocks], block, DOWN,
                 {"act": s["moe_act"], "route_ids": s["moe_ids"], "route_w": s["moe_w"],
                  "down": down, "res": res, "y": y},
                 shared=m.down_shared, overlap=True)  # fmt: skip
        g.launch("prefill", k.group, f"{pre}_route", ["T"], [256], ROUTE,
                 {"logits": logits, "ldl": b.int(b.ld(r["logits"][1])),
                  "route_ids": s["moe_ids"], "route_w": s["moe_w"]})  # fmt: skip
        g.launch("prefill", k.group, f"{pre}_group", [1], [1024], GROUP,
                 {"route_ids": s["moe_ids"], "T": b.int("T"), "src": s["moe_src"],
                  "pos": s["moe_pos"], "tiles": s["moe_tiles"]})  # fmt: skip
        gu, dn = m.gate_up, m.down
        g.launch("prefill", k.group, gu.kernel, [gu.blocks_x, m.max_tiles], [gu.threads],
                 GATE_UP, {"x": x, "src": s["moe_src"], "tiles": s["moe_tiles"], "gate": gate,
                           "up": up, "act": s["moe_act"]}, shared=gu.shared)  # fmt: skip
        g.launch("prefill", k.group, dn.kernel, [dn.blocks_x, m.max_tiles], [dn.threads],
                 PREFILL_DOWN, {"act": s["moe_act"], "tiles": s["moe_tiles"], "down": down,
                                "out": s["moe_out"]}, shared=dn.shared)  # fmt: skip
        g.launch("prefill", k.group, f"{pre}_combine", ["T"], [256], COMBINE,
                 {"out": s["moe_out"], "pos": s["moe_pos"], "route_w": s["moe_w"], "res": res,
                  "y": y})  # fmt: skip


KIND = MoE()
