"""moe: a sparse layer's routed experts, reading only the experts its tokens chose.

Anchors on hipc::Experts. Takes its hipc::MoERouter as a prologue (the expert ids and
weights never leave the kernel) and a residual Add as its epilogue (the residual stream
updated in place). CPU: templates/cpu/moe.cpp.j2 over hipc_cpu_moe.h: routing as
torch.topk orders ties, tokens grouped by expert, three matmuls per routed expert over
its tokens (decode: k GEMVs of each; prefill: one GEMM per routed expert).

GPU (templates/hip/moe_*.hip.j2): routing on the device, inside the captured decode graph.
With the router's matmul (and the RMSNorm before it, where only the router and the experts
read it) fused in (prologue:gate), decode is three kernels: `_route` (the norm, the E logits
over many blocks, the last block's softmax and top-k), `_up` (silu(gate) * up for the k routed
experts' rows only) and `_down` (each output's k expert rows as one row against the k
activations, each expert's part scaled by its weight, plus the residual: the sum is complete
in one lane, no atomics), which loads its first weights before waiting on `_up` (the route is
two kernels back). Without it (a router read elsewhere too: Qwen2-MoE's shared-expert gate),
`_up` routes the token in every block from the given logits. Prefill groups the (token, slot)
pairs by expert on the device (count, prefix sum, scatter) and runs a grouped GEMM over tiles
that never straddle two experts (bf16 and quantized experts on the matrix instructions,
moe_mma.hip.j2 after linear_mma's pipeline, quantized ones as their integer quants scaled per
group; f32/f16 SIMT), then a combine kernel adds each token's k rows in a fixed order. Expert
weights in any GPU type, the downs' type their own (llama-quantize's Q4_K_M: Q6_K downs;
_part: each matrix's unit and chunks).
Tiles of 64 rows (MMA slices past a tile's rows skipped), or, opted in (short_tiles), as tall
as a step's average expert fills (tile_rows, tile_ranges: one grouping and GEMM pair per
height, each launched for its step sizes only)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hipc.compiler.codegen.environment import CPU_WTYPES, WEIGHT_SUFFIX
from hipc.compiler.ir import DENSE_BYTES, Graph, Node, row_bytes
from hipc.compiler.kernels import linear
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
from hipc.compiler.kernels.linear import QUANT_TYPES, MmaTile

if TYPE_CHECKING:
    from hipc.compiler.codegen.bindings import Binder
    from hipc.compiler.codegen.hip import GpuProgramBuilder
    from hipc.compiler.passes.fuse import FusedGroup, Proposals
    from hipc.compiler.targets import GpuTarget


@dataclass(frozen=True)
class MoEParams(Params):
    wtype: str  # the experts' storage type (gate and up; down too unless down_wtype)
    E: int  # experts
    top_k: int  # experts per token
    H: int  # hidden width (the experts' input and output)
    F: int  # an expert's intermediate width
    normalize: bool  # renormalise the routed weights
    fused_gate_up: bool  # gate and up as one [2F, H] block per expert (HF transformers >= 5)
    residual: bool
    router: str = ""  # the router matmul's weight type when it is fused in ("": logits given)
    norm_eps: float = 0.0  # the RMSNorm before the router and the experts, when fused in
    # the down projections' type where it differs (llama-quantize's Q4_K_M: some layers'
    # downs in Q6_K)
    down_wtype: str = ""
    # the CPU's expert matrices in row lanes (passes/lanes.py): gate/up, down
    layout: str = "gguf"
    down_layout: str = "gguf"

    def tag(self) -> str:
        down = f"_d{self.down_wtype}" if self.down_wtype else ""
        lanes = ("_lanes" if self.layout == "lanes" else "") + (
            "_dlanes" if self.down_layout == "lanes" else ""
        )
        return f"{self.wtype}{down}_e{self.E}k{self.top_k}_{self.H}x{self.F}{lanes}"


CPU = Signature.parse("""
int T, const float* x, const float* logits, int ldl, const void* gate, const void* up,
const void* down, const float* res, float* y
""")
# the router (and its RMSNorm) fused in: x is the residual stream before the norm
CPU_ROUTER = Signature.parse("""
int T, const float* x, const float* norm_w, const void* router, const void* gate,
const void* up, const void* down, const float* res, float* y
""")

# the GPU kernels (templates/hip/moe_decode.hip.j2, moe_prefill.hip.j2)
UP = Signature.parse("""
const float* __restrict__ x, const float* __restrict__ logits, const void* __restrict__ gate,
const void* __restrict__ up, float* __restrict__ act, int* route_ids, float* route_w
""")
DOWN = Signature.parse("""
const float* __restrict__ act, const int* __restrict__ route_ids,
const float* __restrict__ route_w, const void* __restrict__ down, const float* res, float* y,
const float* __restrict__ logits
""")
ROUTE = Signature.parse("const float* __restrict__ logits, int ldl, int* route_ids, float* route_w")
# the router fused in: x (the residual stream) -> its norm xn (what the experts read), the
# logits, the route; `count` hands the decode kernel's blocks over to the last one
ROUTER = Signature.parse("""
int T, const float* __restrict__ x, const float* __restrict__ norm_w, const void* __restrict__ router,
float* __restrict__ xn, float* logits, unsigned* count, int* route_ids, float* route_w
""")
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

MOE_WAVES = 8  # waves per decode block
MOE_ROWS = 2  # outputs per wave in _up, and in _down for dense types (two rows per dot)
# _down of quantized experts: one output per wave, so that H / 8 blocks cover the GPU, with up
# to this many units per lane in flight (by unit, prelude: hipc_unit_*). Q4_0/Q4_1 timed on the
# H200; the others sized by their registers to hold about as many (~40: q8_0's 9 a unit, the
# K-quants' 13-29), not timed.
MOE_DOWN_UNITS = {
    "q4_0": 8, "q4_1": 8, "iq4_nl": 8, "q5_0": 6, "q5_1": 6, "q8_0": 4,
    "q4_k64": 3, "q6_k64": 2, "iq4_xs": 2, "q3_k": 2, "q2_k": 3, "q5_k": 1,
}  # fmt: skip
# The experts' GEMV units: 64-weight ones where the prelude has them (a 128-weight unit leaves
# half of a wave's lanes idle on a 2048-wide row: 16 units)
MOE_UNIT64 = True
# _down of quantized experts: waves per block. Every block stages all k x F activations as
# int8 planes after waiting on _up (the critical path): 16 waves stage them in half the
# rounds of 8, over half the blocks (H / 16: about one per SM at H = 2048)
MOE_DOWN_WAVES = 16
# _up of quantized experts: blocks per SM its registers are capped for (__launch_bounds__). At
# 2 (90 registers) the k x F / 16 = 384 blocks of Qwen3-30B-A3B's shape took two rounds of an
# H200's 132 x 2 slots, the second streaming its weights after the first had finished; at 3
# (79 registers, no spills) all of them are resident at once. Experts in 128-weight units (Q5_K,
# IQ4_XS: 19-29 registers a unit) take 2: at 3 nvcc spilled 150-290 bytes a thread (sm_90), at
# 2 none (IQ4_XS) and 52 (Q5_K), at Qwen3-30B-A3B's shape
MOE_UP_BLOCKS_PER_SM = 3
# Opt-in, not yet timed on a GPU (docs/benchmarks/moedec_check.sh times them):
# MOE_ROUTE_WAVE: the decode router's last block routes the token with its first wave alone
# (no barriers; the block only where the top k + 1 hold a tie, moe_route.hip.j2). GPU-tested
# (test_moe_kernels, H200), but its k + 1 rounds of 5 dependent shuffle pairs (~2,000 cycles
# by count) may well cost more than the block-wide ranking's ten barriers (~1,500).
MOE_ROUTE_WAVE = False
# MOE_ROUTE_LOCAL: with the router fused in, no block hands the route over: _route writes the
# logits, and _up (after its wait) and _down (before it: the logits are two kernels back)
# each route the token with one wave. The last block's count and two L2 round trips leave
# the critical path, but _down's blocks, resident only as _up's leave, route before loading.
# Host-tested only.
MOE_ROUTE_LOCAL = False
TILE = 64  # the prefill GEMM's rows (token, slot pairs) and outputs per tile
# x staged per 32 values (prelude: hipc_xq<LO>::INTS * 4): int8 hi + lo planes, or one plane
# with CompileOptions.activations "int8" (as the dense GEMVs: linear.XQ_BLOCK_BYTES)
XQ_BLOCK_BYTES = 80
XQ_BYTES = {"int16": XQ_BLOCK_BYTES, "int8": 48}


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
# Shorter tiles on NVIDIA for experts with few rows each: a prefill step of T tokens gives an
# expert T * k / E rows on average (16 for the Qwen3.5-35B shape at 512 tokens: a 64-row tile
# multiplies 48 rows of padding). The same 128 weight rows a block; the waves all along the
# outputs once the rows are one or two MMA tiles. Rows: the tile list's granularity too.
_NV_SHORT = {
    32: MmaTile("HIPC_MMA_NV", "mma.sync.m16n8k16 bf16", 32, 128, 32, 1, 8),
    16: MmaTile("HIPC_MMA_NV", "mma.sync.m16n8k16 bf16", 16, 128, 32, 1, 4),
}
MOE_SHORT_TILES = dict.fromkeys(("sm_80", "sm_89", "sm_90"), _NV_SHORT)
# The heights compiled models take, each for the steps whose average expert has at most half
# its rows (tile_rows). None by default: on the H200 the kernels alone (bench_gpu_moe_prefill.py,
# Q4_0 experts, x in bf16, session 10) favoured 32-row tiles where the average expert has 16 rows
# (Qwen3.5-35B at 512 tokens: one layer's chain 1,124 us against 1,316 on 64 rows; Qwen3-30B at
# 512, 32 rows an expert: 1,196 against 1,069), but in the compiled Qwen3.5-35B shape the experts'
# gate/up took 21.1 ms per 512-token step on 32-row tiles against 17.9 on 64-row ones (the
# per-kernel profile of bench_gpu_hybrid.py, two calls), so the 64-row tile stays. The 16-row
# tile lost everywhere it was timed.
MOE_SHORT_ROWS: tuple[int, ...] = ()
# HIPC_MOE_SHORT_TILES=1 compiles every height of MOE_SHORT_TILES (experiments), =0 none
SHORT_TILES_ENV = "HIPC_MOE_SHORT_TILES"


def short_tiles(arch: str) -> dict[int, MmaTile]:
    """The short tiles compiled models use on `arch` (MOE_SHORT_ROWS, or as SHORT_TILES_ENV
    says)."""
    every = MOE_SHORT_TILES.get(arch, {})
    env = os.environ.get(SHORT_TILES_ENV)
    if env == "1":
        return every
    if env == "0":
        return {}
    return {bm: t for bm, t in every.items() if bm in MOE_SHORT_ROWS}


def tile_rows(tokens: int, p: MoEParams, arch: str) -> int:
    """The prefill tiles' rows for a step of `tokens`: the shortest short tile (short_tiles)
    that the average expert (tokens * k / E rows) fills at most half of, else TILE."""
    for bm, lo, hi in tile_ranges(tokens, p, arch):
        if lo <= tokens <= hi:
            return bm
    return TILE


def tile_ranges(max_tokens: int, p: MoEParams, arch: str) -> list[tuple[int, int, int]]:
    """(rows, lo, hi): steps of lo..hi tokens group their rows in tiles of `rows`, covering
    1..max_tokens (a compiled model launches each height's GEMMs for its steps only)."""
    out, lo = [], 1
    for bm in sorted(short_tiles(arch)):
        hi = min(max_tokens, bm * p.E // (2 * p.top_k))
        if hi >= lo:
            out.append((bm, lo, hi))
            lo = hi + 1
    if lo <= max_tokens:
        out.append((TILE, lo, max_tokens))
    return out


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
    threads: int  # _route's and _up's
    down_threads: int
    up_shared: int  # dynamic shared bytes of _up / _down (x / act staged, quantized types)
    down_shared: int
    max_tiles: int  # the prefill GEMMs' grid.y: tiles there can be for max_tokens tokens
    mma: GpuKernel | None  # renders {fn}_gate_up and {fn}_down on matrix instructions
    gate_up: GroupedGemm  # the prefill GEMMs launched (SIMT, or those of `mma`)
    down: GroupedGemm

    route_blocks: int = 0  # the decode's {fn}_route grid, when the router is fused in

    def scratch(self, max_tokens: int, p: MoEParams) -> dict[str, int]:
        pairs = max_tokens * p.top_k
        router = (
            {"moe_xn": 4 * max_tokens * p.H, "moe_logits": 4 * max_tokens * p.E, "moe_count": 4}
            if p.router
            else {}
        )
        return {
            **router,
            "moe_ids": 4 * pairs,
            "moe_w": 4 * pairs,
            "moe_src": 4 * pairs,
            "moe_pos": 4 * pairs,
            "moe_tiles": 4 * (3 * self.max_tiles + 1),
            "moe_act": 4 * pairs * p.F,
            "moe_out": 4 * pairs * p.H,
        }


def max_tiles(max_tokens: int, p: MoEParams, bm: int = TILE) -> int:
    """Tiles of bm rows, none straddling two experts: each expert with rows adds at most one
    partial tile to the full ones."""
    pairs = max_tokens * p.top_k
    return pairs // bm + min(p.E, pairs)


def _part(wtype: str) -> dict[str, Any]:
    """What the GPU templates take of one expert matrix's type (gate/up, or down): its suffix,
    its GEMV unit (quantized) and whether its groups have offsets (the matrix-instruction
    GEMMs add offset times the group's sum of x: w = s q + o)."""
    ws = WEIGHT_SUFFIX[wtype]
    qt = QUANT_TYPES.get(ws)
    if qt is None:
        return dict(wsuffix=ws, quant=False, unit=ws, unit_values=16 // DENSE_BYTES[wtype],
                    block_values=16 // DENSE_BYTES[wtype], has_offset=False)  # fmt: skip
    return dict(
        wsuffix=ws,
        quant=True,
        **linear.unit_of(ws, MOE_UNIT64),
        block_values=qt.block_values,
        has_offset=ws in linear.OFFSET_TYPES,
    )


def gpu_kernels(
    fn: str,
    p: MoEParams,
    target: GpuTarget,
    nodes: list[str],
    max_tokens: int,
    activations: str = "int16",
    rows: int | None = None,
    split: bool = True,
) -> MoEGpu:
    """`activations`: how the quantized experts' decode GEMVs round x and act (int16: int8 hi +
    lo planes, int8: one plane), CompileOptions.activations as the dense GEMVs take it;
    `rows`: the prefill tiles' rows (default tile_rows(); the SIMT GEMMs take TILE only);
    `split`: the matrix-instruction GEMMs take x as bf16 hi + lo (--prefill-precision split),
    else rounded to bf16 once (half the matrix work, as the dense prefill GEMMs by default)."""
    wave = target.wave
    xq_bytes = XQ_BYTES[activations]
    down_wtype = p.down_wtype or p.wtype
    parts = {"gate": _part(p.wtype), "down": _part(down_wtype)}
    quant = parts["gate"]["quant"]
    if parts["down"]["quant"] != quant:
        raise ValueError(f"{nodes[0]}: {p.wtype} gate/up with {down_wtype} down (MoE._gpu refuses)")
    # rows of whole blocks (a K-quant's 256 weights: gate/up's H inputs, down's F; Qwen2-MoE's
    # F = 1408 downs are Q5_0/Q8_0 beside Q4_K gate/up) or 16-byte loads (dense); quantized
    # activations are staged 32 at a time
    for width, n, part in (("hidden", p.H, parts["gate"]), ("expert", p.F, parts["down"])):
        unit = max(part["block_values"], 32 if quant else 1)
        if n % unit:
            raise FusionError(
                f"{nodes[0]}: the GPU experts kernels need a {width} width in multiples of "
                f"{unit} for {part['wsuffix']} (hidden {p.H}, expert {p.F})"
            )
    common = dict(
        nodes=nodes,
        wave=wave,
        **p.context(),
        **parts["gate"],
        **{f"d{k}": v for k, v in parts["down"].items()},
    )
    threads = MOE_WAVES * wave
    rsplit, route_blocks = router_split(p, wave)
    if p.router:
        common.update(
            rsuffix=WEIGHT_SUFFIX[p.router],
            route_split=rsplit,
            route_wave=MOE_ROUTE_WAVE and p.top_k < wave,
            route_blocks=route_blocks,
            route_params=ROUTER.render(GPU_INDENT + 6),
        )
    p_down = 1 if quant else MOE_ROWS
    up_blocks = -(-p.top_k * p.F // (MOE_WAVES * MOE_ROWS))
    down_waves = MOE_DOWN_WAVES if quant else MOE_WAVES
    down_blocks = -(-p.H // (down_waves * p_down))
    up_per_sm = MOE_UP_BLOCKS_PER_SM if quant and parts["gate"]["unit_values"] <= 64 else 2
    # units per lane of a quantized _down row
    down_steps = -(-(p.top_k * p.F // parts["down"]["unit_values"]) // wave)
    decode = GpuKernel(
        f"{fn}_decode",
        "moe_decode",
        dict(
            common,
            waves=MOE_WAVES,
            P=MOE_ROWS,
            P_down=p_down,
            lo=activations == "int16",
            route_local=bool(p.router) and MOE_ROUTE_LOCAL and p.top_k < wave,
            up_min_blocks=up_per_sm,
            down_waves=down_waves,
            unroll=min(down_steps, MOE_DOWN_UNITS.get(parts["down"]["unit"], 1)),
            up_blocks=up_blocks,
            down_blocks=down_blocks,
            up_params=UP.render(GPU_INDENT + 3),
            down_params=DOWN.render(GPU_INDENT + 5),
        ),
        [up_blocks],
        threads,
    )
    tile = MOE_MMA_TILES.get(target.arch)
    bm = tile_rows(max_tokens, p, target.arch) if rows is None else rows
    if bm != TILE and tile is not None:
        short = MOE_SHORT_TILES.get(target.arch, {})
        if bm not in short:
            raise ValueError(f"no {bm}-row MoE tile on {target.arch} (have {sorted(short)})")
        tile = short[bm]
    if not (quant or {p.wtype, down_wtype} == {"bfloat16"}) or p.H % 8 or p.F % 8:
        tile = None  # bf16 weights as stored, 16 bytes at a time, or the blocks' quants
    if tile is None:
        bm = TILE  # the SIMT GEMMs' tiles
    elif quant and tile is not None:
        # as linear's quantized tiles: the groups' scales and partial products take registers
        tile = replace(tile, min_blocks=1)
        if not target.arch.startswith("sm_") and tile.shared_bytes(True, quant=True) > 64 << 10:
            tile = None
    tiles = max_tiles(max_tokens, p, bm)
    prefill = GpuKernel(
        f"{fn}_prefill",
        "moe_prefill",
        dict(
            common,
            mma=tile is not None,
            bm=bm,
            bn=TILE,
            max_tiles=tiles,
            route_params=ROUTER.render(0) if p.router else ROUTE.render(0),
            # tokens per fused-router block: the router is read from L2 once per block
            route_tokens=max(1, min(4, ROUTE_SHARED // (4 * p.H))),
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
        threads_mma, smem = tile.threads(wave), tile.shared_bytes(split=split, quant=quant)
        mma = GpuKernel(
            f"{fn}_mma",
            "moe_mma",
            dict(
                common,
                **tile.fields(),
                split=split,
                max_tiles=tiles,
                gate_up_params=GATE_UP.render(GPU_INDENT + 8),
                down_params=PREFILL_DOWN.render(GPU_INDENT + 5),
            ),
            [],
            threads_mma,
            smem,
        )
        gate_up = GroupedGemm(f"{mma.fn}_gate_up", -(-p.F // (tile.bn // 2)), threads_mma, smem)
        down = GroupedGemm(f"{mma.fn}_down", -(-p.H // tile.bn), threads_mma, smem)
    return MoEGpu(
        decode,
        prefill,
        up_blocks,
        down_blocks,
        threads,
        down_waves * wave,
        p.H // 32 * xq_bytes if quant else 0,
        p.top_k * p.F // 32 * xq_bytes if quant else 0,
        tiles,
        mma,
        gate_up,
        down,
        route_blocks if p.router else 0,
    )


ROUTER_WTYPES = ("float32", "float16", "bfloat16")
ROUTE_SHARED = 32 << 10  # the prefill's fused router stages its tokens' normed x in this


ROUTE_WAVES = 512  # the decode router's work items (router row parts) to aim for


def router_split(p: MoEParams, wave: int) -> tuple[int, int]:
    """The fused decode router's geometry: waves per router row (a power of two dividing
    MOE_WAVES, each wave a contiguous part of the row, 4 values a load) and the blocks of
    MOE_WAVES waves covering the E rows. Many small blocks: the 4 * E * H bytes of an f32
    router are read at DRAM speed rather than by a few SMs."""
    split = 1
    while split < MOE_WAVES and p.E * split * 2 <= ROUTE_WAVES and p.H % (8 * split) == 0:
        split *= 2
    return split, -(-p.E * split // MOE_WAVES)


ROUTING = GpuKernel("hipc_moe_routing", "moe_route", {}, [], 0)  # device functions, once


class MoE(KernelKind):
    name = "moe"
    anchors = frozenset({"hipc::Experts"})
    roles = frozenset({"prologue:router", "prologue:gate", "epilogue:residual"})
    cpu_signature = CPU

    def propose(self, graph: Graph, n: Node, p: Proposals) -> None:
        router = graph.producer(n.inputs[1])
        if router is not None and router.op == "hipc::MoERouter":
            others = [u.name for o in router.outputs for u in p.users(o) if u is not n]
            why = f"its routes are also read by {', '.join(others)}" if others else None
            p.propose(n, router, "prologue:router", router.outputs[1], why, side="prologue")
            self._propose_gate(graph, n, router, p)
        user = p.only_user(n.outputs[0])
        if user is not None and user.op == "Add":
            p.propose(n, user, "epilogue:residual", n.outputs[0])
        elif user is not None:
            p.propose(
                n, user, "epilogue", n.outputs[0], f"no {user.op} epilogue in the moe kernels"
            )

    def _propose_gate(self, graph: Graph, n: Node, router: Node, p: Proposals) -> None:
        """The router's matmul, and the RMSNorm both it and the experts read, as the moe
        kernel's prologue: on the GPU the decode step then routes in one kernel (norm, the
        E logits, softmax and top-k) instead of a norm, a GEMV and routing in every block."""
        lin = graph.producer(router.inputs[0])
        if lin is None or lin.op != "hipc::Linear":
            return
        w = graph.values[lin.inputs[1]]
        why = None
        if len(lin.inputs) > 2:
            why = "the router has a bias"
        elif w.dtype not in ROUTER_WTYPES:
            why = f"no fused router for {w.dtype} weights (float32, float16, bfloat16)"
        elif [u.name for u in p.users(lin.outputs[0])] != [router.name]:
            why = f"{lin.outputs[0]} has other readers"
        elif lin.inputs[0] != n.inputs[0]:
            why = "the router and the experts read different inputs"
        norm = graph.producer(lin.inputs[0])
        brings = []
        if (
            why is None
            and norm is not None
            and norm.op == "RMSNormalization"
            and {u.name for u in p.users(norm.outputs[0])} == {lin.name, n.name}
        ):
            brings = [norm]  # nothing else reads the norm: it comes along (and is scored)
        value = norm.outputs[0] if brings else lin.outputs[0]
        p.propose(n, lin, "prologue:gate", value, why, side="prologue", brings=brings)

    def select(self, g: Graph, grp: FusedGroup) -> SelectedKernel:
        ex = grp.anchor
        x, _, _, *ws = ex.inputs
        router = grp.node_with_role("prologue:router")
        if router is None:
            raise FusionError(
                f"{grp.name}: the experts kernel routes its tokens itself, "
                "but its MoERouter could not join it"
            )
        dtypes = {g.values[w].dtype for w in ws[:-1]}
        if len(dtypes) != 1:
            raise FusionError(f"{grp.name}: gate and up experts in mixed types {sorted(dtypes)}")
        wtype, down_wtype = dtypes.pop(), g.values[ws[-1]].dtype
        E, H, F = (int(d) for d in g.values[ws[-1]].shape)
        fused = len(ws) == 2
        lin = next((m for m in grp.prologue if m.op == "hipc::Linear"), None)
        norm = next((m for m in grp.prologue if m.op == "RMSNormalization"), None)
        if norm is not None:
            x = norm.inputs[0]
        refs: dict[str, Any] = {
            "x": ("act", x),
            "logits": ("act", router.inputs[0]) if lin is None else ("none", None),
            "router": ("weight", lin.inputs[1]) if lin is not None else ("none", None),
            "norm_w": ("weight", norm.inputs[1]) if norm is not None else ("none", None),
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
            wtype=wtype,
            E=E,
            top_k=int(router.attrs["top_k"]),
            H=H,
            F=F,
            normalize=bool(router.attrs.get("normalize")),
            fused_gate_up=fused,
            residual=add is not None,
            router=g.values[lin.inputs[1]].dtype if lin is not None else "",
            norm_eps=float(norm.attrs["epsilon"]) if norm is not None else 0.0,
            down_wtype=down_wtype if down_wtype != wtype else "",
        )
        return SelectedKernel(grp.name, grp.node_names, self, params, refs)

    def cpu_signature_of(self, k: SelectedKernel) -> Signature:
        return CPU_ROUTER if k.params.router else CPU

    def cpu_kernel(self, k: SelectedKernel, activations: str) -> tuple[str, dict[str, Any]]:
        p: MoEParams = k.params
        # the experts run the dense matmuls of their type (templates/cpu/hipc_cpu_moe.h)
        down = p.down_wtype or p.wtype
        for role, wtype in (("gate", p.wtype), ("down", down)):
            if wtype not in CPU_WTYPES:
                raise FusionError(
                    f"{k.refs[role][1]}: expert weight type {wtype} has no CPU MoE kernel "
                    f"(supported: {', '.join(CPU_WTYPES)})"
                )
        a16 = "a16_" if activations == "int16" else ""
        in_row = row_bytes(p.wtype, p.H)
        lanes = "lanes_" if p.layout == "lanes" else ""
        down_lanes = "lanes_" if p.down_layout == "lanes" else ""
        return "cpu/moe.cpp.j2", dict(
            mm=a16 + lanes + WEIGHT_SUFFIX[p.wtype],
            mm_down=a16 + down_lanes + WEIGHT_SUFFIX[down],
            rsuffix=WEIGHT_SUFFIX.get(p.router, ""),
            params=self.cpu_signature_of(k).render(CPU_INDENT),
            in_row_bytes=in_row,
            gate_stride=(2 if p.fused_gate_up else 1) * p.F * in_row,
            down_stride=p.H * row_bytes(down, p.F),
        )

    def cpu_call(self, k: SelectedKernel, b: Binder) -> dict[str, Any]:
        p: MoEParams = k.params
        r = k.refs
        if b.ld(r["x"][1]) != p.H:
            raise FusionError(f"{k.group}: input rows are strided ({b.ld(r['x'][1])} != {p.H})")
        route = (
            {"norm_w": b.ref(r["norm_w"]), "router": b.ref(r["router"])}
            if p.router
            else {"logits": b.act(r["logits"][1]), "ldl": b.int(b.ld(r["logits"][1]))}
        )
        return {
            "T": b.int("T"),
            "x": b.act(r["x"][1]),
            **route,
            "gate": b.ref(r["gate"]),
            "up": b.ref(r["up"]),
            "down": b.ref(r["down"]),
            "res": b.ref(r["res"]),
            "y": b.act(r["y"][1]),
        }

    def _gpu(self, k: SelectedKernel, g: GpuProgramBuilder) -> MoEGpu:
        p: MoEParams = k.params
        down = p.down_wtype or p.wtype
        if (WEIGHT_SUFFIX[p.wtype] in QUANT_TYPES) != (WEIGHT_SUFFIX[down] in QUANT_TYPES):
            raise FusionError(
                f"{k.refs['down'][1]}: {down} down experts beside {p.wtype} gate/up ones have no "
                "GPU MoE kernel (both quantized or both dense)"
            )
        return gpu_kernels(
            k.fn, p, g.target, k.nodes, g.max_tokens, g.activations,
            split=g.prefill_precision == "split",
        )  # fmt: skip

    def _short(self, k: SelectedKernel, g: GpuProgramBuilder, m: MoEGpu):
        """The prefill's other tile heights, for the shorter steps: [(MoEGpu, lo, hi)] (the
        one of `m`, for the longest steps, is not among them)."""
        if m.mma is None:
            return [], (1, g.max_tokens)
        ranges = tile_ranges(g.max_tokens, k.params, g.target.arch)
        split = g.prefill_precision == "split"
        out = [
            (gpu_kernels(f"{k.fn}_r{bm}", k.params, g.target, k.nodes, hi, g.activations, bm,
                         split), lo, hi)
            for bm, lo, hi in ranges[:-1]
        ]  # fmt: skip
        return out, ranges[-1][1:]

    def gpu_scratch(self, k: SelectedKernel, g: GpuProgramBuilder) -> dict[str, int]:
        m = self._gpu(k, g)
        s = m.scratch(g.max_tokens, k.params)
        tiles = max([m.max_tiles] + [v.max_tiles for v, _, _ in self._short(k, g, m)[0]])
        return {**s, "moe_tiles": 4 * (3 * tiles + 1)}

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
        gate, up, down = b.ref(r["gate"]), b.ref(r["up"]), b.ref(r["down"])
        block = [m.threads]
        if p.router:
            route_args = {"T": b.int("T"), "x": x, "norm_w": b.ref(r["norm_w"]), "router": b.ref(r["router"]),
                          "xn": s["moe_xn"], "logits": s["moe_logits"], "count": s["moe_count"],
                          "route_ids": s["moe_ids"], "route_w": s["moe_w"]}  # fmt: skip
            g.launch("decode", k.group, f"{dec}_route", [m.route_blocks], block, ROUTER,
                     route_args, overlap=True)  # fmt: skip
            x, logits = s["moe_xn"], s["moe_logits"]  # the experts read the norm's result
        else:
            logits = b.act(r["logits"][1])
        g.launch("decode", k.group, f"{dec}_up", [m.up_blocks], block, UP,
                 {"x": x, "logits": logits, "gate": gate, "up": up, "act": s["moe_act"],
                  "route_ids": s["moe_ids"], "route_w": s["moe_w"]},
                 shared=m.up_shared, overlap=True)  # fmt: skip
        g.launch("decode", k.group, f"{dec}_down", [m.down_blocks], [m.down_threads], DOWN,
                 {"act": s["moe_act"], "route_ids": s["moe_ids"], "route_w": s["moe_w"],
                  "down": down, "res": res, "y": y, "logits": logits},
                 shared=m.down_shared, overlap=True)  # fmt: skip
        if p.router:
            tt = m.prefill.ctx["route_tokens"]
            g.launch("prefill", k.group, f"{pre}_route", [f"cdiv(T,{tt})"], [256], ROUTER,
                     route_args)  # fmt: skip
        else:
            g.launch("prefill", k.group, f"{pre}_route", ["T"], [256], ROUTE,
                     {"logits": logits, "ldl": b.int(b.ld(r["logits"][1])),
                      "route_ids": s["moe_ids"], "route_w": s["moe_w"]})  # fmt: skip
        # the grouping and the grouped GEMMs at each tile height, for its steps (tile_ranges)
        short, (lo, hi) = self._short(k, g, m)
        for v, vlo, vhi in [*short, (m, lo, hi)]:
            tokens = None if (vlo, vhi) == (1, g.max_tokens) else (vlo, vhi)
            vpre = g.kernel(v.prefill)
            if v.mma is not None:
                g.kernel(v.mma)
            g.launch("prefill", k.group, f"{vpre}_group", [1], [1024], GROUP,
                     {"route_ids": s["moe_ids"], "T": b.int("T"), "src": s["moe_src"],
                      "pos": s["moe_pos"], "tiles": s["moe_tiles"]}, tokens=tokens)  # fmt: skip
            gu, dn = v.gate_up, v.down
            g.launch("prefill", k.group, gu.kernel, [gu.blocks_x, v.max_tiles], [gu.threads],
                     GATE_UP, {"x": x, "src": s["moe_src"], "tiles": s["moe_tiles"],
                               "gate": gate, "up": up, "act": s["moe_act"]},
                     shared=gu.shared, tokens=tokens)  # fmt: skip
            g.launch("prefill", k.group, dn.kernel, [dn.blocks_x, v.max_tiles], [dn.threads],
                     PREFILL_DOWN, {"act": s["moe_act"], "tiles": s["moe_tiles"], "down": down,
                                    "out": s["moe_out"]}, shared=dn.shared, tokens=tokens)  # fmt: skip
        g.launch("prefill", k.group, f"{pre}_combine", ["T"], [256], COMBINE,
                 {"out": s["moe_out"], "pos": s["moe_pos"], "route_w": s["moe_w"], "res": res,
                  "y": y})  # fmt: skip


KIND = MoE()
