"""The GPU kernels' specializations: for each kernel kind, the template, its context and
its launch geometry on a target (wave size, matrix instruction, tile). codegen/hip.py
renders them into one program and binds them into launch plans; tests/gpu render single
kernels through the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hipc.compiler.codegen.environment import WEIGHT_SUFFIX

GEMV_WAVES = 8  # 8 waves: more rows in flight per SM when x (K floats) fills shared memory
# Before its wait a small GEMV (latency-bound: SmolLM2's) pulls its rows towards L2, so
# the loads after the wait hit L2. Big ones stream at bandwidth anyway: on the H200
# prefetching their row heads cost 4-7% of an 8B decode step.
GEMV_PREFETCH_MAX = 16 << 20
ATTN_WAVES = 8
DECODE_WAVES = 4  # decode attention: a chunk of 4 waves x one 32/64-key tile each per block
DECODE_BLOCKS = 256  # decode attention blocks per layer (heads x splits): ~2 per SM of an H200
KV_TYPES = {"float32": ("float", "f32"), "bfloat16": ("uint16_t", "bf16")}


def kv_context(kv_storage: str) -> dict[str, str]:
    """The attention templates' KV element type and the suffix of its prelude helpers."""
    kv_type, kv_suffix = KV_TYPES[kv_storage]
    return dict(kv_type=kv_type, kv_suffix=kv_suffix)


MAX_GEMV_K = 16384  # the GEMV stages x in shared memory: 64 KiB, the smallest limit (AMD LDS)
SIMT_TILE = 64  # the SIMT GEMM's tokens and outputs per block


@dataclass(frozen=True)
class MmaTile:
    """One platform's matrix instruction and the prefill GEMM geometry built on it."""

    macro: str  # HIPC_MMA_* defined for the prelude
    instruction: str  # as the disassembly names it (for the kernel's header comment)
    bm: int  # tokens per block
    bn: int  # weight rows per block (outputs, or gate + up rows with the GLU epilogue)
    bk: int  # K per shared-memory stage
    wm: int  # waves along tokens
    wn: int  # waves along outputs
    min_blocks: int = 1  # NVIDIA: blocks per SM to fit registers for (__launch_bounds__)

    def shared_bytes(self) -> int:
        """Two stages of x hi, x lo (bm rows each) and W (bn rows), bf16, rows padded by 8."""
        return 2 * (2 * self.bm + self.bn) * (self.bk + 8) * 2


# 128 x 128 blocks of 256 threads everywhere: 8 warps of 64 x 32 on NVIDIA and RDNA, 4 wave64s of
# 64 x 64 on CDNA (64 accumulator floats per lane in every case), within AMD's 64 KiB of LDS. RDNA
# stages 16 deep, not 32: its A/B fragments are 8 VGPRs each, and with two k steps in flight clang
# spills past 256 VGPRs. gfx12 (gfx1201) has WMMA with another operand layout: SIMT there for now.
# On the H200 (bf16 GLU, T=512, 8000 x 4080, TFLOP/s of useful work): 70 for one 128 x 128 block
# per SM, 90 with registers capped for two (a few bytes spill), 74 staging 64 deep, 102 for
# 128 x 256 blocks (warps of 64 x 64) -- which leave SMs idle when there are few output blocks, so
# they are only taken for wide layers (WIDE_BLOCKS or more column blocks: gate/up, the LM head).
_NV = MmaTile("HIPC_MMA_NV", "mma.sync.m16n8k16 bf16", 128, 128, 32, 2, 4, min_blocks=2)
_NV_WIDE = MmaTile("HIPC_MMA_NV", "mma.sync.m16n8k16 bf16", 128, 256, 32, 2, 4)
_WMMA = MmaTile("HIPC_MMA_WMMA", "v_wmma_f32_16x16x16_bf16", 128, 128, 16, 2, 4)
_MFMA = MmaTile("HIPC_MMA_MFMA", "v_mfma_f32_16x16x16_bf16", 128, 128, 32, 2, 2)
MMA_TILES = {
    "sm_80": _NV,
    "sm_89": _NV,
    "sm_90": _NV,
    "gfx1100": _WMMA,
    "gfx1101": _WMMA,
    "gfx1151": _WMMA,
    "gfx90a": _MFMA,
    "gfx942": _MFMA,
}
MMA_WIDE_TILES = {"sm_80": _NV_WIDE, "sm_89": _NV_WIDE, "sm_90": _NV_WIDE}
WIDE_BLOCKS = 64


def wave_size(target: str) -> int:
    """Wavefront width: CDNA (gfx9*) runs wave64; NVIDIA warps and RDNA (gfx1x) wave32."""
    return 64 if target.startswith("gfx9") else 32


def mma_tile(target: str, p: dict[str, Any]) -> MmaTile | None:
    """The matrix-instruction GEMM for a linear's prefill, or None for the SIMT one.

    Dense bf16 weights only: they feed the instruction as stored. f16 would need x split in f16,
    whose range (65504) activations can exceed; quantized types dequantize in the SIMT tile.
    K % 8 == 0 because W is loaded 16 bytes at a time.
    """
    tile = MMA_TILES.get(target)
    if tile is None or p["wtype"] != "bfloat16" or p["K"] % 8:
        return None
    wide = MMA_WIDE_TILES.get(target)
    glu = p["epilogue"] == "glu"
    n_out = p["N"] // 2 if glu else p["N"]
    if wide and -(-n_out // (wide.bn // 2 if glu else wide.bn)) >= WIDE_BLOCKS:
        return wide
    return tile


@dataclass(frozen=True)
class PrefillGemm:
    """The prefill kernel of one linear: its name, template context and launch geometry."""

    fn: str
    template: str
    ctx: dict[str, Any]
    block_outputs: int  # grid.x = ceil(n_out / block_outputs)
    block_tokens: int  # grid.y = ceil(rows / block_tokens)
    threads: int
    shared: int


def prefill_gemm(
    fn: str, p: dict[str, Any], target: str, nodes: list[str], simt: bool = False
) -> PrefillGemm:
    """`fn`: the linear's kernel stem; `p`: its specialization (wtype, N, K, norm_eps, epilogue,
    bias). `simt` forces the SIMT kernel (the GPU tests time one against the other)."""
    wave = wave_size(target)
    n_out = p["N"] // 2 if p["epilogue"] == "glu" else p["N"]
    common = dict(nodes=nodes, wsuffix=WEIGHT_SUFFIX[p["wtype"]], n_out=n_out, wave=wave, **p)
    tile = None if simt else mma_tile(target, p)
    if tile is None:
        return PrefillGemm(f"{fn}_gemm", "linear_gemm", common, SIMT_TILE, SIMT_TILE, 256, 0)
    bn_out = tile.bn // 2 if p["epilogue"] == "glu" else tile.bn
    ctx = dict(
        common,
        instruction=tile.instruction,
        bm=tile.bm,
        bn=tile.bn,
        bk=tile.bk,
        wm=tile.wm,
        wn=tile.wn,
        min_blocks=tile.min_blocks,
        bn_out=bn_out,
        shared=tile.shared_bytes(),
    )
    threads = tile.wm * tile.wn * wave
    return PrefillGemm(
        f"{fn}_mma", "linear_mma", ctx, bn_out, tile.bm, threads, tile.shared_bytes()
    )


@dataclass(frozen=True)
class DecodeKernel:
    """A decode (one-token) kernel: its name, template context and launch geometry."""

    fn: str
    template: str
    ctx: dict[str, Any]
    grid: list[int]
    threads: int
    shared: int = 0


@dataclass(frozen=True)
class QuantGemv:
    """A quantized GEMV's geometry: waves per block, weight rows per wave and group (with
    the GLU epilogue gate and up rows: rows // 2 outputs), the 32-weight blocks per lane
    and row whose loads are in flight together (16 bytes of quants each, 32 for q8_0), and
    at most how many blocks: each stages x once, then its waves stream group after group,
    so fewer blocks stage x fewer times; registers are capped for min_blocks blocks per SM
    (NVIDIA), so that max_blocks of them are resident at once on an H200's 132 SMs."""

    waves: int = 8
    rows: int = 2
    unroll: int = 4
    max_blocks: int = 256
    min_blocks: int = 2
    # pull the first group's rows towards L2 while x is staged (when it takes several
    # batches): on the H200 it cost the 8B down GEMV 15.2 -> 18.1 us, so it is off
    prefetch: bool = False


# Small matrices (SmolLM2's, latency-bound): 8-wave blocks, two per SM. Large ones
# (QUANT_GEMV_LARGE_BYTES and up): 16-wave blocks of 4-row groups, one per SM. On the H200
# (bench_gpu_gemv.py, 8B Q4_0 shapes, per layer) the large geometry took 46.7 us where the
# small one took 48.4 (SmolLM2 shapes: 8.6 us small, 10.5 large). q8_0 blocks are twice
# the bytes: half the unroll.
QUANT_GEMV_SMALL = QuantGemv(8, 2, 4, 256, 2)
QUANT_GEMV_LARGE = QuantGemv(16, 4, 2, 128, 1)
QUANT_GEMV_LARGE_BYTES = 4 << 20
XQ_BLOCK_BYTES = 80  # x staged per 32 values (prelude: HIPC_XQ_INTS * 4)


@dataclass(frozen=True)
class QuantType:
    """A quantized type as the GPU kernels see it (prelude: hipc_qmat_*, hipc_unit_*)."""

    block_values: int  # weights per block
    block_bytes: int
    quant_bytes: int  # of which quants (the split layout's first region)
    unit_values: int  # weights a GEMV lane takes per step and row


QUANT_TYPES = {
    "q4_0": QuantType(32, 18, 16, 32),
    "q4_1": QuantType(32, 20, 16, 32),
    "q8_0": QuantType(32, 34, 32, 32),
    "q6_k": QuantType(256, 210, 192, 128),
    "q5_0": QuantType(32, 22, 16, 32),
    "q5_1": QuantType(32, 24, 16, 32),
    "q4_k": QuantType(256, 144, 128, 128),
    "q5_k": QuantType(256, 176, 160, 128),
}
# a K-quant unit is 21-27 registers (64-96 bytes of quants): a row pair, one unit each in flight
QUANT_GEMV_Q6_K = QuantGemv(8, 2, 1, 128, 1)


def quant_gemv(wsuffix: str, N: int, K: int) -> QuantGemv:
    if QUANT_TYPES[wsuffix].unit_values > 32:  # the K-quants' units of 128
        return QUANT_GEMV_Q6_K
    qt = QUANT_TYPES[wsuffix]
    big = N * (K // qt.block_values) * qt.block_bytes >= QUANT_GEMV_LARGE_BYTES
    g = QUANT_GEMV_LARGE if big else QUANT_GEMV_SMALL
    if wsuffix in ("q5_0", "q5_1"):  # a sixth register per unit: 4 units in flight, no spills
        g = replace(g, rows=2, unroll=2)
    if wsuffix == "q8_0":
        g = replace(g, unroll=max(1, g.unroll // 2))
    return g


def stream_blocks(groups: int, waves: int, max_blocks: int) -> int:
    """Blocks for `groups` units of work streamed by `waves` waves a block: as few groups per
    wave as max_blocks allows, then as few blocks as give every wave that many."""
    per_wave = -(-groups // (waves * max_blocks))
    return -(-groups // (waves * per_wave))


def decode_gemv(
    fn: str, p: dict[str, Any], target: str, nodes: list[str], quant: QuantGemv | None = None
) -> DecodeKernel:
    """The GEMV of one linear (`p`: wtype, N, K, norm_eps, epilogue, bias). `quant`
    overrides quant_gemv's geometry (bench_gpu_gemv.py times several)."""
    wave = wave_size(target)
    ws = WEIGHT_SUFFIX[p["wtype"]]
    glu = p["epilogue"] == "glu"
    n_out = p["N"] // 2 if glu else p["N"]
    rows_per_block = GEMV_WAVES * (1 if glu else 2)
    grid = [-(-n_out // rows_per_block)]
    if ws in QUANT_TYPES:
        qt = QUANT_TYPES[ws]
        g = quant or quant_gemv(ws, p["N"], p["K"])
        groups = -(-n_out // (g.rows // 2 if glu else g.rows))
        steps = -(-(p["K"] // qt.unit_values) // wave)
        blocks = stream_blocks(groups, g.waves, g.max_blocks)
        ctx = dict(
            nodes=nodes,
            wave=wave,
            wsuffix=ws,
            n_out=n_out,
            waves=g.waves,
            rows=g.rows,
            unroll=g.unroll,
            blocks=blocks,
            min_blocks=g.min_blocks,
            prefetch=g.prefetch and steps > g.unroll,
            **qt.__dict__,
            **p,
        )
        shared = p["K"] // 32 * XQ_BLOCK_BYTES
        return DecodeKernel(f"{fn}_gemv", "linear_gemv_q", ctx, [blocks], g.waves * wave, shared)
    ctx = dict(
        nodes=nodes,
        wave=wave,
        wsuffix=ws,
        n_out=n_out,
        waves=GEMV_WAVES,
        rows_per_block=rows_per_block,
        prefetch=gemv_prefetch(row_bytes(ws, p["K"]), p["N"]),
        **p,
    )
    shared = 4 * p["K"] if p["norm_eps"] else 0  # the normalized x, staged
    return DecodeKernel(f"{fn}_gemv", "linear_gemv", ctx, grid, GEMV_WAVES * wave, shared)


def decode_attention(
    fn: str, p: dict[str, Any], target: str, nodes: list[str], max_ctx: int, kv_storage: str
) -> DecodeKernel:
    """The decode attention of one layer (`p`: NH, NKV, D, scale, window, norm_eps, ...)."""
    wave = wave_size(target)
    splits = decode_splits(p["NH"], max_ctx, wave)
    ctx = dict(
        nodes=nodes,
        wave=wave,
        waves=DECODE_WAVES,
        splits=splits,
        **kv_context(kv_storage),
        **p,
    )
    return DecodeKernel(
        f"{fn}_decode", "attention_decode", ctx, [p["NH"], splits], DECODE_WAVES * wave
    )


def decode_splits(heads: int, max_ctx: int, wave: int) -> int:
    """Blocks per head of the decode attention: ~DECODE_BLOCKS in all, never more than
    the context has chunks. Fixed at compile time (the decode graph is captured once);
    each block loops over every SPLITS-th chunk, so any context length runs."""
    chunks = -(-max_ctx // (DECODE_WAVES * wave))
    return max(1, min(chunks, -(-DECODE_BLOCKS // heads)))


def gemv_prefetch(row: int, rows: int) -> int:
    """Bytes of each weight row a GEMV prefetches before its wait: all or nothing."""
    return row if row * rows <= GEMV_PREFETCH_MAX else 0


def row_bytes(wsuffix: str, K: int) -> int:
    if wsuffix in QUANT_TYPES:
        qt = QUANT_TYPES[wsuffix]
        return K // qt.block_values * qt.block_bytes
    return K * {"f32": 4, "f16": 2, "bf16": 2}[wsuffix]
