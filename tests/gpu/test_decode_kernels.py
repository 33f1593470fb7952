"""The decode kernels alone on a real GPU, against NumPy in float64.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). Each kernel is
rendered as codegen/hip.py renders it (compiler/kernels: decode_gemv, decode_attention,
the embedding's gpu_kernel), for
the device's arch, with random inputs and outputs poisoned with NaN, so a value a kernel
forgot to write, or a row it should not have read, shows. Weights of every storage type
are packed here the way GGUF / safetensors store them.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hipc.base.launch_plan import KV_BLOCK
from hipc.compiler.kernels.attention import decode_attention
from hipc.compiler.kernels.embedding import EmbeddingParams
from hipc.compiler.kernels.embedding import gpu_kernel as embedding_kernel
from hipc.compiler.kernels.linear import (
    QUANT_GEMV_LARGE,
    QUANT_GEMV_LARGE_DOWN,
    QUANT_GEMV_LARGE_GLU,
    QUANT_TYPES,
    LinearParams,
    QuantGemv,
    QuantGemvBulk,
    decode_gemv,
    prefill_gemm,
)
from hipc.compiler.reference.executor import round_bf16
from hipc.compiler.targets import GpuTarget

from gpu_kernels import (
    DeviceKernels,
    attention_clip,
    attention_params,
    attention_switches,
    held_x,
    pack,
    rope,
)
from support import rel_err

pytestmark = pytest.mark.gpu
EPS = 1e-5

# -- GEMV --------------------------------------------------------------------------------

# name: (wtype, N weight rows, K, epilogue, norm prologue, bias)
GEMVS = {
    "bf16_residual_bias": ("bfloat16", 200, 576, "residual", False, True),
    "bf16_glu_norm": ("bfloat16", 2 * 344, 1536, "glu", True, False),
    "bf16_odd_rows_norm_bias": ("bfloat16", 101, 4096, "none", True, True),
    "bf16_large_unprefetched": ("bfloat16", 4160, 4096, "residual", False, False),
    "f16_plain": ("float16", 96, 576, "none", False, False),
    "f32_glu_bias": ("float32", 2 * 48, 192, "glu", False, True),
    "q8_0_residual": ("q8_0", 130, 576, "residual", False, False),
    "q8_0_glu_norm_bias_k4096": ("q8_0", 2 * 40, 4096, "glu", True, True),
    "q4_0_glu_norm": ("q4_0", 2 * 64, 1536, "glu", True, False),
    "q4_0_odd_rows_k4096": ("q4_0", 37, 4096, "none", True, False),
    "q4_0_residual_k14336": ("q4_0", 48, 14336, "residual", False, False),
    "q4_1_norm_bias": ("q4_1", 96, 576, "none", True, True),
    "q4_1_glu_k1536": ("q4_1", 2 * 24, 1536, "glu", False, False),
    "q4_0_streamed_residual": ("q4_0", 203, 4096, "residual", False, True),
    "q8_0_streamed_glu_norm": ("q8_0", 2 * 75, 1536, "glu", True, False),
    "q4_1_streamed_norm_k14336": ("q4_1", 61, 14336, "none", True, False),
    "q6_k_norm_k4096": ("q6_k", 300, 4096, "none", True, False),
    "q6_k_glu_bias_k1024": ("q6_k", 2 * 40, 1024, "glu", False, True),
    "q6_k_streamed_residual_k14336": ("q6_k", 37, 14336, "residual", False, False),
    "q5_0_glu_norm_k1536": ("q5_0", 2 * 64, 1536, "glu", True, False),
    "q5_1_residual_bias": ("q5_1", 75, 576, "residual", False, True),
    "iq4_nl_glu_norm_k1536": ("iq4_nl", 2 * 64, 1536, "glu", True, False),
    "iq4_nl_residual_bias_k14336": ("iq4_nl", 75, 14336, "residual", False, True),
    "iq4_xs_norm_k4096": ("iq4_xs", 130, 4096, "none", True, False),
    "iq4_xs_glu_k1024": ("iq4_xs", 2 * 45, 1024, "glu", False, True),
    # rows of one and two super-blocks (a 256-wide model's matrices)
    "iq4_xs_glu_norm_k256": ("iq4_xs", 2 * 512, 256, "glu", True, False),
    "iq4_xs_residual_k512": ("iq4_xs", 256, 512, "residual", False, False),
    "q4_k_glu_norm_k256": ("q4_k", 2 * 512, 256, "glu", True, False),
    "q4_k_norm_k4096": ("q4_k", 130, 4096, "none", True, False),
    "q4_k_streamed_glu_k1024": ("q4_k", 2 * 45, 1024, "glu", True, True),
    "q5_k_residual_k14336": ("q5_k", 40, 14336, "residual", False, False),
    "q3_k_glu_norm_k256": ("q3_k", 2 * 512, 256, "glu", True, False),
    "q3_k_norm_k4096": ("q3_k", 130, 4096, "none", True, True),
    "q3_k_residual_k14336": ("q3_k", 41, 14336, "residual", False, False),
    "q3_k_streamed_glu_norm": ("q3_k", 2 * 45, 1024, "glu", True, False),
    # quant_gemv's own choices for matrices >= 4 MiB: gate/up (QUANT_GEMV_Q3_K_GLU), q+k
    # (QUANT_GEMV_Q3_K), on fewer rows than an 8B's
    "q3_k_default_glu_k4096": ("q3_k", 2 * 1300, 4096, "glu", True, False),
    "q3_k_default_short_k4096": ("q3_k", 5000, 4096, "none", True, False),
    # Q2_K (mins per 16): one super-block a row, a long row, quant_gemv's own geometry
    "q2_k_glu_norm_k256": ("q2_k", 2 * 512, 256, "glu", True, False),
    "q2_k_residual_k14336": ("q2_k", 41, 14336, "residual", False, False),
    "q2_k_default_glu_k4096": ("q2_k", 2 * 1300, 4096, "glu", True, False),
    "q4_0_ring4_rows1_k14336": ("q4_0", 45, 14336, "residual", False, True),
    "q6_k_ring3_preload1_norm": ("q6_k", 50, 4096, "none", True, False),
    "q4_k_ring3_glu_norm": ("q4_k", 2 * 33, 4096, "glu", True, False),
    "q4_0_l2_prefetch_glu_norm": ("q4_0", 2 * 70, 4096, "glu", True, False),
    "q4_1_copy_next_k14336": ("q4_1", 29, 14336, "residual", False, True),
    # the geometries quant_gemv gives matrices >= 4 MiB, on fewer rows
    "q4_0_large_glu_geometry": ("q4_0", 2 * 600, 4096, "glu", True, False),
    "q4_0_large_geometry_k14336": ("q4_0", 300, 14336, "residual", False, False),
    "q4_0_early_res_geometry_k14336": ("q4_0", 300, 14336, "residual", False, False),
    "q4_k64_early_res_k14336": ("q4_k", 45, 14336, "residual", False, False),
    "q8_0_large_glu_geometry": ("q8_0", 2 * 300, 4096, "glu", True, False),
    # the bulk-copy GEMV (split layout only): rings turned several times, partial last tiles
    "bulk_q4_0_residual_k14336": ("q4_0", 61, 14336, "residual", False, True),
    "bulk_q4_0_glu_norm": ("q4_0", 2 * 150, 4096, "glu", True, False),
    "bulk_q4_k_norm": ("q4_k", 133, 4096, "none", True, False),
    "bulk_q5_k_glu_k2048": ("q5_k", 2 * 70, 2048, "glu", False, True),
    "bulk_q6_k_residual_k14336": ("q6_k", 41, 14336, "residual", False, False),
    "bulk_q4_1_norm": ("q4_1", 90, 2048, "none", True, False),
    "bulk_q4_k64_glu_norm": ("q4_k", 2 * 70, 4096, "glu", True, False),
    "bulk_q4_k64_residual_k14336": ("q4_k", 37, 14336, "residual", False, True),
    "bulk_q6_k64_residual_k14336": ("q6_k", 29, 14336, "residual", False, False),
    "bulk_q6_k64_norm": ("q6_k", 70, 4096, "none", True, False),
    "bulk_q4_0_k2304_norm": ("q4_0", 50, 2304, "none", True, True),
    "q4_k64_ring_glu_norm": ("q4_k", 2 * 70, 4096, "glu", True, False),
    "q6_k64_copy_residual_k14336": ("q6_k", 45, 14336, "residual", False, False),
    # bench_gpu_gemv.py's candidates for quant_gemv's table (8-wave 128-register blocks,
    # rows prefetched to L2, 64-weight K-quant units), each wave several groups
    "q4_0_w8m2_glu_norm": ("q4_0", 2 * 700, 4096, "glu", True, False),
    "q4_0_w8m2_l2_residual_k14336": ("q4_0", 600, 14336, "residual", False, True),
    "q4_k64_w8m2_norm": ("q4_k", 700, 4096, "none", True, False),
    "q4_k64_w16_residual_k14336": ("q4_k", 300, 14336, "residual", False, False),
    "q4_k_copy_l2_glu_norm": ("q4_k", 2 * 300, 4096, "glu", True, False),
    "q6_k_ring_l2_residual_k14336": ("q6_k", 300, 14336, "residual", False, True),
    "q6_k64_w16_ring_norm": ("q6_k", 300, 4096, "none", True, False),
    # quant_gemv's own choice for down projections of 4 MiB and more (QUANT_GEMV_K64)
    "q4_k_default_long_k14336": ("q4_k", 600, 14336, "residual", False, False),
    "q6_k_default_long_k14336": ("q6_k", 600, 14336, "residual", False, False),
    # and for an o projection's (QUANT_GEMV_K64 too: "narrow", N <= K)
    "q4_k_default_narrow_k4096": ("q4_k", 2000, 4096, "residual", False, False),
}
# geometries other than the default: few blocks, so each wave streams many groups of rows
STREAMED = {
    "q4_0_streamed_residual": QuantGemv(waves=2, rows=4, unroll=2, max_blocks=3),
    "q8_0_streamed_glu_norm": QuantGemv(waves=4, rows=2, unroll=1, max_blocks=2),
    "q4_1_streamed_norm_k14336": QuantGemv(waves=2, rows=2, unroll=4, max_blocks=2),
    "q6_k_streamed_residual_k14336": QuantGemv(waves=2, rows=2, unroll=1, max_blocks=2),
    "q4_k_streamed_glu_k1024": QuantGemv(waves=2, rows=2, unroll=1, max_blocks=3),
    "q3_k_streamed_glu_norm": QuantGemv(waves=2, rows=2, unroll=1, max_blocks=3, stages=4),
    # rings of 3-4 batches whose last turn is partial, one filled before the wait
    "q4_0_ring4_rows1_k14336": QuantGemv(2, 1, 1, 3, 2, stages=4),
    "q6_k_ring3_preload1_norm": QuantGemv(2, 2, 1, 3, 1, stages=3, preload=1),
    "q4_k_ring3_glu_norm": QuantGemv(4, 2, 1, 3, 1, stages=3, xq_chunk=8),
    "q4_0_l2_prefetch_glu_norm": QuantGemv(4, 2, 1, 3, 2, stages=3, l2_prefetch=True),
    "q4_1_copy_next_k14336": QuantGemv(2, 2, 2, 3, 1, stages=1),
    "q4_0_large_glu_geometry": QUANT_GEMV_LARGE_GLU,
    "q4_0_large_geometry_k14336": QUANT_GEMV_LARGE,
    "q4_0_early_res_geometry_k14336": QUANT_GEMV_LARGE_DOWN,
    "q4_k64_early_res_k14336": QuantGemv(4, 2, 1, 3, 1, 2, 8, unit64=True, early_res=True),
    "q8_0_large_glu_geometry": replace(QUANT_GEMV_LARGE_GLU, unroll=1),
    "bulk_q4_0_residual_k14336": QuantGemvBulk(4, 2, 3, 5),
    "bulk_q4_0_glu_norm": QuantGemvBulk(8, 8, 4, 7),
    "bulk_q4_k_norm": QuantGemvBulk(4, 4, 3, 6),
    "bulk_q5_k_glu_k2048": QuantGemvBulk(2, 4, 2, 5),
    "bulk_q6_k_residual_k14336": QuantGemvBulk(8, 2, 3, 4),
    "bulk_q4_1_norm": QuantGemvBulk(4, 8, 2, 3),
    "bulk_q4_k64_glu_norm": QuantGemvBulk(8, 8, 3, 5, unit64=True),
    "bulk_q4_k64_residual_k14336": QuantGemvBulk(8, 2, 4, 4, rows_per_wave=2, unit64=True),
    "bulk_q6_k64_residual_k14336": QuantGemvBulk(8, 2, 3, 4, unit64=True),
    "bulk_q6_k64_norm": QuantGemvBulk(4, 4, 3, 5, unit64=True),
    "bulk_q4_0_k2304_norm": QuantGemvBulk(4, 4, 2, 4),
    "q4_k64_ring_glu_norm": QuantGemv(4, 2, 2, 5, 1, 3, unit64=True),
    "q6_k64_copy_residual_k14336": QuantGemv(4, 4, 1, 3, 1, 1, unit64=True),
    "q4_0_w8m2_glu_norm": QuantGemv(8, 2, 2, 40, 2, 3, 8),
    "q4_0_w8m2_l2_residual_k14336": QuantGemv(8, 2, 2, 20, 2, 3, 8, l2_prefetch=True),
    "q4_k64_w8m2_norm": QuantGemv(8, 2, 1, 30, 2, 3, 8, unit64=True),
    "q4_k64_w16_residual_k14336": QuantGemv(16, 2, 1, 5, 1, 3, 8, unit64=True),
    "q4_k_copy_l2_glu_norm": QuantGemv(8, 4, 1, 8, 1, 1, l2_prefetch=True),
    "q6_k_ring_l2_residual_k14336": QuantGemv(8, 2, 1, 9, 1, 3, 8, l2_prefetch=True),
    "q6_k64_w16_ring_norm": QuantGemv(16, 2, 1, 3, 1, 2, 8, unit64=True),
}
QUANT = tuple(QUANT_TYPES)


def gemv_params(case) -> LinearParams:
    wtype, N, K, epilogue, norm, bias = case
    return LinearParams(
        wtype=wtype, N=N, K=K, norm_eps=EPS if norm else 0.0, epilogue=epilogue, bias=bias
    )


def bulk(name: str) -> bool:
    return isinstance(STREAMED.get(name), QuantGemvBulk)


def gemv_specs(arch: str, layout: str = "split") -> dict:
    """Every GEMV case, and each quantized one again with --activations int8 (the bulk-copy
    ones in the split layout only: they copy its regions)."""
    specs = {}
    for i, (name, case) in enumerate(GEMVS.items()):
        if bulk(name) and layout != "split":
            continue
        specs[name] = decode_gemv(
            f"g{i}", gemv_params(case), GpuTarget(arch), [name], STREAMED.get(name)
        )
        if case[0] in QUANT:  # and with --activations int8: x as one int8 plane
            specs[name, "int8"] = decode_gemv(
                f"g{i}_a8",
                gemv_params(case),
                GpuTarget(arch),
                [name],
                STREAMED.get(name),
                activations="int8",
            )
    return specs


@pytest.fixture(scope="module", params=["split", "gguf"])
def gemvs(request):
    """Every GEMV in one code object, for the quantized-block layout `request.param`."""
    specs = {}

    def build(arch):
        specs.update(gemv_specs(arch, request.param))
        return [(k.fn, k.template, k.ctx, k.shared) for k in specs.values()]

    dev = DeviceKernels(build, quant_layout=request.param)
    dev.specs = specs
    dev.layout = request.param
    yield dev
    dev.close()


def run_gemv(gemvs, name, activations):
    wtype, N, K, epilogue, norm, bias = GEMVS[name]
    n_out = N // 2 if epilogue == "glu" else N
    rng = np.random.default_rng(sorted(GEMVS).index(name))
    raw, w = pack(0.05 * rng.standard_normal((N, K)), wtype, gemvs.layout)
    # activations with a few outlier channels (a block's int8 scale follows its largest value)
    x = rng.standard_normal(K) * 3
    x[rng.integers(0, K, 4)] *= 30
    x = x.astype(np.float32)
    g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    r = rng.standard_normal(n_out).astype(np.float32)
    xn = x.astype(np.float64)
    if wtype in QUANT:
        # x as the kernel holds it: it rounds x * g (the norm's 1 / rms scales the sums
        # afterwards), so only the kernel's own arithmetic is in the bound
        xn = held_x(x * g if norm else x, activations)
        if norm:
            xn = xn / np.sqrt(np.mean(x.astype(np.float64) ** 2) + EPS)
    elif norm:
        xn = xn / np.sqrt(np.mean(xn * xn) + EPS) * g
    acc = w @ xn + (b if bias else 0.0)
    if epilogue == "glu":
        want = acc[:n_out] / (1 + np.exp(-acc[:n_out])) * acc[n_out:]
    else:
        want = acc + (r if epilogue == "residual" else 0.0)

    k = gemvs.specs[name] if activations == "int16" else gemvs.specs[name, activations]
    dev = gemvs
    try:
        y = dev.poisoned(n_out)
        ptrs = [
            dev.upload(x),
            dev.upload(raw),
            dev.upload(g) if norm else 0,
            dev.upload(b) if bias else 0,
            dev.upload(r) if epilogue == "residual" else 0,
            y,
        ]
        dev.launch(k.fn, k.grid, k.threads, [("u64", p) for p in ptrs], k.shared)
        got = dev.read(y, n_out)
    finally:
        dev.free()
    return got, want


@pytest.mark.parametrize("name", sorted(GEMVS))
def test_gemv_matches_numpy(gemvs, name):
    wtype = GEMVS[name][0]
    if gemvs.layout != "split" and (wtype not in QUANT or bulk(name)):
        pytest.skip("the layout is that of quantized blocks (bulk copies: split only)")
    got, want = run_gemv(gemvs, name, "int16")
    # quantized: against x as held in int8 hi + lo planes (~16 significant bits; the planes'
    # rounding itself: tests/compiler/test_gpu_prelude_host.py). A bar on x itself failed
    # for draws with outliers (1.3e-4 with the kernel 2e-7 from the held x)
    tol = 1e-4 if wtype in QUANT else 1e-5
    assert rel_err(got, want) <= tol, (name, rel_err(got, want))


@pytest.mark.parametrize("name", sorted(n for n, c in GEMVS.items() if c[0] in QUANT))
def test_gemv_int8_activations_match_numpy(gemvs, name):
    """--activations int8: against float64 NumPy on x rounded as the kernel holds it (one
    int8 plane per 32 values), so only the kernel's own arithmetic is in the bound."""
    if gemvs.layout != "split" and bulk(name):
        pytest.skip("bulk copies read the split layout only")
    got, want = run_gemv(gemvs, name, "int8")
    assert rel_err(got, want) <= 1e-4, (name, rel_err(got, want))


# -- decode attention --------------------------------------------------------------------

# name: (NH, NKV, D, window, qk norm, interleaved pairs, KV storage, compiled context, p)
ATTENTIONS = {
    "smollm2_bf16": (9, 3, 64, 0, False, False, "bfloat16", 2048, 700),
    "llama8b_bf16_loops_chunks": (32, 8, 128, 0, False, False, "bfloat16", 8192, 3000),
    "qknorm_interleaved_f32": (4, 2, 64, 0, True, True, "float32", 512, 300),
    "window_f32": (6, 3, 32, 100, False, False, "float32", 1024, 900),
    "first_token": (4, 1, 64, 0, False, False, "bfloat16", 256, 0),
    "head_dim_12_qknorm": (4, 1, 12, 0, True, False, "bfloat16", 512, 200),
    # Qwen3.5/3-Next: q rows [query | gate] per head, output * sigmoid(gate), RoPE on the
    # first rot dims (the trailing two fields: rot, out_gate)
    "qwen35_gated_partial_bf16": (16, 2, 256, 0, True, False, "bfloat16", 4096, 1500, 64, True),
    "gated_partial_odd_f32": (5, 5, 64, 0, True, False, "float32", 512, 77, 16, True),
    "partial_interleaved_bf16": (6, 2, 64, 0, False, True, "bfloat16", 256, 40, 32, False),
    # OLMoE: q, k and v clamped as read (trailing field: clip)
    "clip_bf16": (16, 16, 128, 0, False, False, "bfloat16", 1024, 333, 0, False, 0.6),
    # the grouped kernel: blocks looping over tiles (ATTENTION_BLOCKS), 8 query heads per KV
    # head, p at tile (32) and cache-block (16) edges
    "tiles_per_block_bf16": (32, 8, 128, 0, False, False, "bfloat16", 8192, 2500),
    "tiles_window_qknorm_f32": (6, 2, 64, 200, True, True, "float32", 1024, 650),
    "qwen3moe_g8_bf16": (32, 4, 128, 0, True, False, "bfloat16", 4096, 777),
    "edge_p31_bf16": (9, 3, 64, 0, False, False, "bfloat16", 2048, 31),
    "edge_p32_bf16": (9, 3, 64, 0, False, False, "bfloat16", 2048, 32),
    "edge_p64_one_block": (9, 3, 64, 0, False, False, "bfloat16", 2048, 64),
}
ATTENTION_BLOCKS = {
    "tiles_per_block_bf16": 40,
    "tiles_window_qknorm_f32": 4,
    "edge_p64_one_block": 3,
}
# every form on every case: per KV head and tile (the default), per query head and tile (h1), per
# query head, per KV head and split; and some tile geometries (4 lanes per score, 128- and
# 16-key tiles, 2-block merge steps, blocks taking 2 and 4 tiles before the context splits, two
# tiles on two blocks (s1: the merge the default's one block skips below 128 positions), 5
# tiles on one block)
ATTENTION_FORMS = [(n, f) for n in ATTENTIONS for f in ("tile", "tile:h1", "head", "gqa")] + [
    ("llama8b_bf16_loops_chunks", "tile:l4"),
    ("smollm2_bf16", "tile:k128"),
    ("tiles_per_block_bf16", "tile:k128:m2"),
    ("qwen35_gated_partial_bf16", "tile:k32"),
    ("window_f32", "tile:k16:w2"),
    ("llama8b_bf16_loops_chunks", "tile:t2"),
    ("edge_p64_one_block", "tile:k16:t4"),
    ("edge_p64_one_block", "tile:s1"),
    ("edge_p64_one_block", "tile:k16:s5"),
    # query heads over several blocks (1 or 2 of the group a block: h1 on every case above),
    # merged over splits
    ("tiles_per_block_bf16", "tile:h2:k128:m2"),
    ("qwen35_gated_partial_bf16", "tile:h2"),
    ("llama8b_bf16_loops_chunks", "tile:h1:v4:l4"),
    ("tiles_per_block_bf16", "tile:h1:v4"),
    # the first tile's arithmetic rehearsed before the wait (q = 0, results dropped)
    ("llama8b_bf16_loops_chunks", "tile:r1"),
    ("tiles_per_block_bf16", "tile:r1"),
    ("qwen35_gated_partial_bf16", "tile:h2:r1"),
    ("edge_p64_one_block", "tile:s1:r1"),
]


def decode_attention_specs(arch: str) -> dict:
    """(case, form) -> the kernel (docs/benchmarks/declat_check.sh builds them ahead too)."""
    specs = {}
    for i, (name, form) in enumerate(ATTENTION_FORMS):
        case = ATTENTIONS[name]
        specs[name, form] = decode_attention(
            f"a{i}", attention_params(case, EPS), GpuTarget(arch), [name], case[7], case[6],
            blocks=ATTENTION_BLOCKS.get(name), form=form,
        )  # fmt: skip
    return specs


@pytest.fixture(scope="module")
def attentions():
    specs = {}

    def build(arch):
        specs.update(decode_attention_specs(arch))
        return [(k.fn, k.template, k.ctx, k.shared) for k in specs.values()]

    dev = DeviceKernels(build)
    dev.specs = specs
    yield dev
    dev.close()


@pytest.mark.parametrize("name,form", sorted(ATTENTION_FORMS))
def test_decode_attention_matches_numpy(attentions, name, form):
    NH, NKV, D, window, norm, interleaved, kv, ctx, p = ATTENTIONS[name][:9]
    rot, gated = attention_switches(ATTENTIONS[name])
    r = rot or D
    rng = np.random.default_rng(100 + sorted(ATTENTIONS).index(name))
    q_in = rng.standard_normal((NH, 2 * D if gated else D)).astype(np.float32)
    q = q_in[:, :D]
    k = rng.standard_normal((NKV, D)).astype(np.float32)
    v = rng.standard_normal((NKV, D)).astype(np.float32)
    qw, kw = (1 + 0.2 * rng.standard_normal((2, D))).astype(np.float32)
    ang = rng.uniform(0, 2 * np.pi, (ctx, r // 2))
    cos_t, sin_t = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    cache = [rng.standard_normal((ctx, NKV, D)).astype(np.float32) for _ in range(2)]
    for c in cache:
        c[p:] = np.nan  # position p is this step's to write; nothing past it may be read
    store = round_bf16 if kv == "bfloat16" else (lambda a: a.astype(np.float32))
    kc, vc = (store(c) for c in cache)
    # the sequence's blocks scattered over a pool twice its size (the rest NaN), in row 1 of
    # the block tables
    B = KV_BLOCK
    mine = -(-(p + 1) // B)
    pool_blocks = 2 * mine + 3
    tables = np.full((2, -(-ctx // B)), -1, np.int32)
    tables[1, :mine] = rng.permutation(pool_blocks)[:mine]
    slots = (tables[1, :mine, None] * B + np.arange(B)).reshape(-1)[: p + 1]
    kp, vp = (np.full((pool_blocks * B, NKV, D), np.nan, np.float32) for _ in range(2))
    kp[slots], vp[slots] = kc[: p + 1], vc[: p + 1]

    def normed(x, w):
        x = x.astype(np.float64)
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * w if norm else x

    def rotated(x):
        x = x.copy()
        x[..., :r] = rope(x[..., :r], cos_t[p], sin_t[p], interleaved)
        return x

    clip = attention_clip(ATTENTIONS[name])
    q_, k_, v_ = (np.clip(x, -clip, clip) if clip else x for x in (q, k, v))
    qr = rotated(normed(q_, qw))
    kn = store(rotated(normed(k_, kw)))
    vn = store(v_)

    spec = attentions.specs[name, form]
    dev = attentions
    as_stored = (
        (lambda a: (a.view(np.uint32) >> 16).astype(np.uint16))
        if kv == "bfloat16"
        else (lambda a: a)
    )
    try:
        kc_d, vc_d = dev.upload(as_stored(kp)), dev.upload(as_stored(vp))
        splits = spec.grid[1]
        partial = dev.poisoned(NH * splits * (D + 2))
        counters = dev.upload(np.zeros(NH, np.uint32))
        out = dev.poisoned(NH * D)
        args = [
            dev.upload(q_in),
            dev.upload(k),
            dev.upload(v),
            dev.upload(np.array([p], np.int32)),
            dev.upload(np.array([1], np.int32)),
            dev.upload(tables),
            dev.upload(qw) if norm else 0,
            dev.upload(kw) if norm else 0,
            dev.upload(cos_t),
            dev.upload(sin_t),
            kc_d,
            vc_d,
            partial,
            counters,
            out,
        ]
        dev.launch(spec.fn, spec.grid, spec.threads, [("u64", a) for a in args], spec.shared)
        got = dev.read(out, (NH, D))
        stored = np.uint16 if kv == "bfloat16" else np.float32
        at = int(slots[p]) * NKV * D * np.dtype(stored).itemsize
        row_k = dev.read(kc_d + at, (NKV, D), stored)
        row_v = dev.read(vc_d + at, (NKV, D), stored)
        left = dev.read(counters, NH, np.uint32)
    finally:
        dev.free()
    widen = (
        (lambda a: (a.astype(np.uint32) << 16).view(np.float32))
        if kv == "bfloat16"
        else (lambda a: a)
    )
    # The new token's key and value are in the cache as stored, for the next steps. The key
    # went through float32 RoPE on the GPU and float64 here: one step of the storage type
    # apart at most (a value next to a bf16 rounding boundary).
    ulp = 2.0**-7 if kv == "bfloat16" else 1e-6
    np.testing.assert_allclose(widen(row_k), kn, rtol=ulp, atol=1e-6)
    np.testing.assert_array_equal(widen(row_v), vn)
    assert not left.any()  # every head's merging block reset its counter

    # attention over the cache below p and the key/value the kernel stored for p
    lo = max(0, p - window + 1) if window else 0
    keys = np.concatenate([kc[lo:p], widen(row_k)[None]]).astype(np.float64)  # [n, NKV, D]
    vals = np.concatenate([vc[lo:p], widen(row_v)[None]]).astype(np.float64)
    group = NH // NKV
    want = np.empty((NH, D))
    for h in range(NH):
        sc = keys[:, h // group] @ qr[h] * D**-0.5
        e = np.exp(sc - sc.max())
        want[h] = e @ vals[:, h // group] / e.sum()
    if gated:
        want = want / (1 + np.exp(-q_in[:, D:].astype(np.float64)))
    assert rel_err(got, want) <= 1e-5, (name, rel_err(got, want))


# -- embedding ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "wtype,layout",
    [
        ("bfloat16", "split"),
        ("float16", "split"),
        ("q8_0", "split"),
        ("q4_1", "split"),
        ("q4_0", "split"),
        ("q4_0", "gguf"),
        ("q8_0", "gguf"),
        ("q6_k", "split"),
        ("q6_k", "gguf"),
        ("q5_0", "split"),
        ("q5_1", "gguf"),
        ("q4_k", "split"),
        ("q5_k", "split"),
        ("q5_k", "gguf"),
        ("iq4_nl", "split"),
        ("iq4_nl", "gguf"),
        ("iq4_xs", "split"),
        ("iq4_xs", "gguf"),
    ],
)
def test_embedding_rows(wtype, layout):
    K = 512 if wtype.endswith("_k") or wtype == "iq4_xs" else 576
    V, ids = 300, np.array([5, 0, 299, 5, 17], np.int64)
    rng = np.random.default_rng(7)
    raw, w = pack(0.1 * rng.standard_normal((V, K)), wtype, layout)

    def build(arch):
        k = embedding_kernel("emb", EmbeddingParams(wtype, K, V), GpuTarget(arch).wave, ["embed"])
        return [(k.fn, k.template, k.ctx, 0)]

    dev = DeviceKernels(build, quant_layout=layout)
    try:
        out = dev.poisoned((len(ids), K))
        args = [dev.upload(ids), dev.upload(raw), out]
        dev.launch("emb", [len(ids)], 256, [("u64", a) for a in args])
        got = dev.read(out, (len(ids), K))
    finally:
        dev.close()
    np.testing.assert_allclose(got, w[ids], rtol=1e-6, atol=1e-7)


# -- quantized weights in the prefill GEMMs -------------------------------------------------

QGEMM_TYPES = ("q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")
# name: (T, N weight rows, K, epilogue, bias)
QGEMM_CASES = {
    "residual": (70, 100, 512, "residual", False),
    "glu_bias": (130, 2 * 72, 768, "glu", True),
}


# variant -> (simt, split): the matrix-instruction GEMM with x rounded to bf16 (the default
# --prefill-precision) and with x as bf16 hi + lo, and the SIMT one
QGEMM_VARIANTS = {"mma": (False, False), "mma_split": (False, True), "simt": (True, False)}


def qgemm_specs(arch: str) -> dict:
    """Each type x case on the matrix-instruction GEMM (where the arch has one) and SIMT."""
    specs = {}
    for ti, wtype in enumerate(QGEMM_TYPES):
        for ci, (case, (_, N, K, epilogue, bias)) in enumerate(QGEMM_CASES.items()):
            p = LinearParams(wtype=wtype, N=N, K=K, norm_eps=0.0, epilogue=epilogue, bias=bias)
            for v, (simt, split) in QGEMM_VARIANTS.items():
                fn = f"qg{ti}_{ci}_{v}"
                specs[wtype, case, v] = prefill_gemm(fn, p, GpuTarget(arch), [case], simt, split)
    return specs


@pytest.fixture(scope="module", params=["split", "gguf"])
def qgemms(request):
    specs = {}

    def build(arch):
        specs.update(qgemm_specs(arch))
        return [(k.fn, k.template, k.ctx, k.shared) for k in specs.values()]

    dev = DeviceKernels(build, quant_layout=request.param)
    dev.specs = specs
    dev.layout = request.param
    yield dev
    dev.close()


@pytest.mark.parametrize("variant", sorted(QGEMM_VARIANTS))
@pytest.mark.parametrize("case", sorted(QGEMM_CASES))
@pytest.mark.parametrize("wtype", QGEMM_TYPES)
def test_quantized_prefill_gemm(qgemms, wtype, case, variant):
    """Against float64 NumPy on gguf-py's dequantized weights: the matrix-instruction kernel
    multiplies the integer quants and scales each 16-deep group in float32 (x rounded to
    bf16 as the kernel does, or exact for the hi + lo split), the SIMT one dequantizes each
    weight."""
    T, N, K, epilogue, bias = QGEMM_CASES[case]
    g = qgemms.specs[wtype, case, variant]
    if variant != "simt" and g.template != "linear_mma":
        pytest.skip(f"no matrix-instruction GEMM for {wtype} on {qgemms.arch}")
    n_out = N // 2 if epilogue == "glu" else N
    rng = np.random.default_rng(11 + QGEMM_TYPES.index(wtype))
    wf = 0.05 * rng.standard_normal((N, K))
    raw, w = pack(wf, wtype, qgemms.layout)
    # activations over four decades, a few outlier channels (the bf16 hi/lo split)
    x = rng.standard_normal((T, K)) * 10.0 ** rng.uniform(-2, 2, (T, 1))
    x[:, rng.integers(0, K, 3)] *= 30
    x = x.astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    r = rng.standard_normal((T, n_out)).astype(np.float32)
    dev = qgemms
    try:
        # the residual is added in place, as the plans bind it; elsewhere y starts as NaN
        y = dev.upload(r) if epilogue == "residual" else dev.poisoned((T, n_out))
        args = [("u64", dev.upload(x)), ("i32", T), ("u64", dev.upload(raw)), ("u64", 0)]
        args += [("u64", 0), ("u64", dev.upload(b) if bias else 0)]
        args += [("u64", y if epilogue == "residual" else 0), ("u64", y)]
        grid = [-(-n_out // g.block_outputs), -(-T // g.block_tokens)]
        dev.launch(g.fn, grid, g.threads, args, g.shared)
        got = dev.read(y, (T, n_out))
    finally:
        dev.free()
    x64 = x.astype(np.float64)
    if variant == "mma":
        # x rounded to bf16 once, for the quants' products and the offsets' group sums alike
        # (linear_mma.hip.j2): the product sees one x. (The offsets once took float32 sums of
        # x; this model and that kernel differed by 1.6e-4..4.2e-3 on the H200 for
        # q4_1/q5_1/q4_k, so the bar tells the two apart.)
        acc = round_bf16(x).astype(np.float64) @ w.T + (b if bias else 0.0)
    else:
        acc = x64 @ w.T + (b if bias else 0.0)
    if epilogue == "glu":
        want = acc[:, :n_out] / (1 + np.exp(-acc[:, :n_out])) * acc[:, n_out:]
    else:
        want = acc + r
    # test_prefill_gemm's bar for the matrix instructions (float32 sums of bf16 products)
    bar = 1e-5 if variant == "simt" else 1e-4
    assert rel_err(got, want) <= bar, (wtype, case, variant, rel_err(got, want))
