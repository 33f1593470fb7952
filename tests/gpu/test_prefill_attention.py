"""The prefill attention kernels alone on a real GPU, against NumPy in float64.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). Each case renders
the matrix-instruction kernel as compiled (on NVIDIA the FA2-style attention_flash_mma, and
also its 8-warp and 32-rows-a-warp forms and the generic attention_flash that the AMD targets
compile, on mma.sync:
the AMD forms are checked in host emulation by tests/compiler/test_gpu_flash_host.py, never yet
on an AMD GPU) and the SIMT one (attention) as
compiler/kernels/attention.py renders them for the device, fills the paged KV pool the way
rope_kv leaves it (keys rotated, in the storage type) at each sequence's positions through its
block table (blocks scattered over the pool; every slot no sequence owns is NaN: nothing there
may be read), and compares every query row's output (NaN-poisoned first) with softmax attention
in float64: causal, sliding window, grouped-query heads, the per-head q norm, both RoPE pair
layouts, both cache types, a prompt after a cached prefix (start > 0), T not a multiple of the
64-row query block, and steps whose rows belong to several sequences (decode rows of other
sequences before, inside and after a prefill chunk: the flash kernel's query blocks then hold
rows of several sequences).

Bars: the SIMT kernel computes in float32 (1e-5); the flash kernel rounds q (after RoPE and the
scale) and the softmax weights P to bf16 for the matrix units, ~2^-9 per value, hence 5e-3.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.kernels.attention import (
    ATTN_WAVES,
    flash_attention,
    kv_context,
    prefill_signature,
)
from hipc.compiler.kernels.base import GPU_INDENT, GpuKernel
from hipc.compiler.targets import GpuTarget

from gpu_kernels import (
    PREFILL_CTX,
    DeviceKernels,
    as_stored,
    attention_params,
    prefill_attention_inputs,
    prefill_attention_reference,
)
from support import rel_err

pytestmark = pytest.mark.gpu

EPS = 1e-6
CTX = PREFILL_CTX  # the compiled context: the block tables' stride
# name: (NH, NKV, D, window, qk norm, interleaved pairs, KV storage, start, T)
CASES = {
    "llama8b_bf16": (32, 8, 128, 0, False, False, "bfloat16", 0, 300),
    "prefix_start_bf16": (9, 3, 64, 0, False, False, "bfloat16", 200, 130),
    "qknorm_interleaved_f32": (4, 2, 64, 0, True, True, "float32", 0, 77),
    "window_bf16": (6, 3, 32, 100, False, False, "bfloat16", 50, 257),
    "window_f32_d128": (8, 8, 128, 64, False, False, "float32", 0, 200),
    "one_token": (4, 1, 64, 0, False, False, "bfloat16", 5, 1),
    # Qwen3.5/3-Next: RoPE on the first 16 of 64 dims (or 32 of 128), q rows [query | gate]
    # per head and the output times sigmoid(gate); odd head counts
    "gated_partial_bf16": (5, 1, 64, 0, True, False, "bfloat16", 30, 150, 16, True),
    "gated_partial_f32_d128": (3, 3, 128, 0, True, False, "float32", 0, 70, 32, True),
    "partial_interleaved_f32": (4, 2, 64, 0, False, True, "float32", 3, 40, 48, False),
    # OLMoE: q clamped as read (rope_kv clamps k and v: the cache here holds them as stored)
    "clip_bf16": (16, 16, 64, 0, False, False, "bfloat16", 0, 130, 0, False, 0.5),
    # Qwen3.5-35B-A3B's full-attention heads: D = 256 (the generic flash form on sm_80/sm_90),
    # RoPE on 64 dims, gated output, after a cached prefix
    "qwen35_d256_bf16": (16, 2, 256, 0, True, False, "bfloat16", 100, 300, 64, True),
}
# cases whose step holds other sequences' rows too: [(sequence, first position, rows)], the
# case's own chunk being sequence 0's
MIXED = {
    "llama8b_bf16": [(1, 40, 1), (0, 0, 0), (2, 0, 1), (3, 517, 1)],
    "window_bf16": [(0, 0, 0), (1, 130, 1), (2, 63, 2)],
    "prefix_start_bf16": [(4, 5, 1), (1, 70, 1), (0, 0, 0), (2, 31, 1), (3, 16, 1)],
    "qknorm_interleaved_f32": [(1, 3, 1), (2, 90, 1), (0, 0, 0)],
    "qwen35_d256_bf16": [(1, 40, 1), (0, 0, 0), (2, 7, 2)],
}


def kernel_specs(arch: str) -> dict:
    """(case, variant) -> the GpuKernel, rendered as compiler/kernels/attention.py does."""
    specs = {}
    for i, (name, case) in enumerate(CASES.items()):
        p, kv = attention_params(case, EPS), case[6]
        target = GpuTarget(arch)
        fk = flash_attention(f"f{i}", p, target, [name], kv, CTX)
        if fk is not None:
            specs[name, "flash"] = fk  # as compiled
            if target.family == "nvidia":
                specs[name, "flash_w8"] = flash_attention(f"w{i}", p, target, [name], kv, CTX,
                                                          waves=8)  # fmt: skip
                specs[name, "flash_r2"] = flash_attention(f"r{i}", p, target, [name], kv, CTX,
                                                          tiles=2)  # fmt: skip
                specs[name, "flash_generic"] = flash_attention(f"g{i}", p, target, [name], kv,
                                                               CTX, "generic")  # fmt: skip
        kv_ctx = kv_context(kv, CTX)
        ctx = dict(
            nodes=[name],
            wave=GpuTarget(arch).wave,
            waves=ATTN_WAVES,
            params=prefill_signature(kv_ctx["kv_type"]).render(GPU_INDENT),
            **kv_ctx,
            **p.context(),
        )
        specs[name, "simt"] = GpuKernel(f"s{i}", "attention", ctx, [], 0)
    return specs


@pytest.fixture(scope="module")
def kernels():
    specs = {}

    def build(arch):
        specs.update(kernel_specs(arch))
        return [(k.fn, k.template, k.ctx, k.shared) for k in specs.values()]

    dev = DeviceKernels(build)
    dev.specs = specs
    yield dev
    dev.close()


@pytest.mark.parametrize("variant", ["flash", "flash_w8", "flash_r2", "flash_generic", "simt"])
@pytest.mark.parametrize("mixed", [False, True], ids=["one", "mixed"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_attention_matches_numpy(kernels, name, variant, mixed):
    NH, _, D, _, norm, _, kv = CASES[name][:7]
    spec = kernels.specs.get((name, variant))
    if spec is None:
        pytest.skip(f"{kernels.arch}: no {variant} prefill attention for this shape")
    if mixed and name not in MIXED:
        pytest.skip("a one-sequence case")
    start, T = CASES[name][7:9]
    segments = (
        [(s, *((start, T) if s == 0 else (a, n))) for s, a, n in MIXED[name]] if mixed else None
    )
    x = prefill_attention_inputs(CASES[name], 300 + sorted(CASES).index(name), segments)
    q, ldq, qw, cos_t, sin_t, T = x["q"], x["ldq"], x["qw"], x["cos_t"], x["sin_t"], x["T"]
    try:
        out = kernels.poisoned((T, NH * D))
        args = [
            ("u64", kernels.upload(q)),
            ("i32", ldq),
            *([("i32", T)] if variant != "simt" else []),
            ("u64", kernels.upload(x["pos"])),
            ("u64", kernels.upload(x["seq"])),
            ("u64", kernels.upload(x["tables"])),
            ("u64", kernels.upload(qw) if norm else 0),
            ("u64", kernels.upload(cos_t)),
            ("u64", kernels.upload(sin_t)),
            ("u64", kernels.upload(as_stored(x["kc"], kv))),
            ("u64", kernels.upload(as_stored(x["vc"], kv))),
            ("u64", out),
        ]
        if variant != "simt":
            grid, threads = (-(-T // spec.ctx["bq"]), NH), spec.threads
        else:
            grid, threads = (T, NH), ATTN_WAVES * GpuTarget(kernels.arch).wave
        kernels.launch(spec.fn, grid, threads, args, spec.shared)
        got = kernels.read(out, (T, NH * D))
    finally:
        kernels.free()

    want = prefill_attention_reference(CASES[name], x, EPS)
    assert not np.isnan(got).any(), (name, variant, "outputs left unwritten")
    # flash: q, K, V and P rounded to bf16 (2^-9 each) against a float64 reference: measured
    # 5.0e-3..8.9e-3 on the H200 for D = 64..128; a wrong mask, fragment or softmax is O(1)
    bar = 1e-5 if variant == "simt" else 1.5e-2
    assert rel_err(got, want) <= bar, (name, variant, rel_err(got, want))
