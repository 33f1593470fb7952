"""The prefill attention kernels alone on a real GPU, against NumPy in float64.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). Each case renders
the matrix-instruction kernel (attention_flash: mma.sync, WMMA or MFMA; on NVIDIA with a bfloat16
cache also its double-buffered cp.async form, which is not compiled into artifacts yet; the AMD
forms are checked in host emulation by tests/compiler/test_gpu_flash_host.py, never yet on an
AMD GPU) and the SIMT one (attention) as
compiler/kernels/attention.py renders them for the device, fills the KV cache below start + T
the way rope_kv leaves it (keys rotated, in the storage type; NaN past the prompt: nothing there
may be read), and compares every query row's output (NaN-poisoned first) with softmax attention
in float64: causal, sliding window, grouped-query heads, the per-head q norm, both RoPE pair
layouts, both cache types, a prompt after a cached prefix (start > 0), T not a multiple of the
64-row query block.

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
    DeviceKernels,
    as_stored,
    attention_params,
    prefill_attention_inputs,
    prefill_attention_reference,
)
from support import rel_err

pytestmark = pytest.mark.gpu

EPS = 1e-6
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
}


def kernel_specs(arch: str) -> dict:
    """(case, variant) -> the GpuKernel, rendered as compiler/kernels/attention.py does."""
    specs = {}
    for i, (name, case) in enumerate(CASES.items()):
        p, kv = attention_params(case, EPS), case[6]
        fk = flash_attention(f"f{i}", p, GpuTarget(arch), [name], kv)
        if fk is not None:
            specs[name, "flash"] = fk  # as compiled: K/V loaded, then used
        if kv == "bfloat16":
            fk = flash_attention(f"g{i}", p, GpuTarget(arch), [name], kv, pipelined=True)
            if fk is not None and fk.ctx["pipelined"]:  # NVIDIA only
                specs[name, "flash_pipelined"] = fk  # double-buffered with cp.async
        kv_ctx = kv_context(kv)
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


@pytest.mark.parametrize("variant", ["flash", "flash_pipelined", "simt"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_attention_matches_numpy(kernels, name, variant):
    NH, _, D, _, norm, _, kv, start, T = CASES[name][:9]
    spec = kernels.specs.get((name, variant))
    if spec is None:
        pytest.skip(f"{kernels.arch}: no {variant} prefill attention for this shape")
    x = prefill_attention_inputs(CASES[name], 300 + sorted(CASES).index(name))
    q, ldq, qw, cos_t, sin_t = x["q"], x["ldq"], x["qw"], x["cos_t"], x["sin_t"]
    try:
        out = kernels.poisoned((T, NH * D))
        args = [
            ("u64", kernels.upload(q)),
            ("i32", ldq),
            *([("i32", T)] if variant != "simt" else []),
            ("u64", kernels.upload(np.array([start], np.int32))),
            ("u64", kernels.upload(qw) if norm else 0),
            ("u64", kernels.upload(cos_t)),
            ("u64", kernels.upload(sin_t)),
            ("u64", kernels.upload(as_stored(x["kc"], kv))),
            ("u64", kernels.upload(as_stored(x["vc"], kv))),
            ("u64", out),
        ]
        if variant != "simt":
            grid, threads = (-(-T // 64), NH), spec.threads
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
