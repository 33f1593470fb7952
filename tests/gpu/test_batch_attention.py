"""The batch step's split-context attention (templates/hip/attention_batch.hip.j2,
compiler/kernels/attention.py batch_attention) alone on a real GPU, against NumPy in float64.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). One step's rows each
belong to another sequence, at contexts of 1, 17, 300 and 2048 positions and a dozen more between,
every sequence's cached rows in blocks scattered over a paged pool through its block table as
the runtime lays them out (gpu_kernels.prefill_attention_inputs: every slot no sequence owns is
NaN, so a row read past its context shows). Shapes: Llama-3-8B's heads (32 / 8 x 128, also with
the bf16 output the sm_90a o projection reads), SmolLM2's (9 / 3 x 64), a one-query-head group
(G = 1) with the per-head q norm, interleaved pairs and a float32 cache, and a sliding window
with partial rotary and the output gate. Each at the splits count the step's rows select
(batch_splits), one split (the block alone on its row) and the most splits (short rows' spare
blocks leave at once; long rows merge 16 partials). Outputs start as NaN; the counters must
be zero again after the launch (the next layer's launch relies on it).

Bars: the kernel computes in float32 (1e-5 relative to the largest output); the bf16 output is
rounded once (2^-8).
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.kernels.attention import BATCH_SPLITS_MAX, batch_attention, batch_splits
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
CTX = 2048  # the compiled context: the block tables' stride, the RoPE tables' rows
# name: (NH, NKV, D, window, qk norm, interleaved pairs, KV storage, start, T[, rot, out_gate])
CASES = {
    "llama8b_bf16": (32, 8, 128, 0, False, False, "bfloat16", 0, 0),
    "smollm2_bf16": (9, 3, 64, 0, False, False, "bfloat16", 0, 0),
    "g1_qknorm_interleaved_f32": (8, 8, 128, 0, True, True, "float32", 0, 0),
    "window_gated_partial_bf16": (8, 2, 64, 100, True, False, "bfloat16", 0, 0, 16, True),
}
# the step's rows: (sequence, position); the contexts the brief names first, then others
ROWS = [(3, 0), (0, 16), (2, 299), (1, 2047)] + [(4 + i, 37 * i * i % 1900) for i in range(13)]
SPLITS = ("selected", 1, BATCH_SPLITS_MAX)
# the kernel's forms: its loads a pass at a time (session 10's: the default's unroll), pipelined
# (the next pass's loads in flight during this one's math) at 2 and 4 loads a lane, or through a
# ring of passes in shared memory (cp.async) at 4 passes of 2 loads and 2 of 4 (attention.py
# BATCH_LOADS' forms; a float32 cache or a shape whose shared arrays leave no room for a ring:
# its loads a pass at a time)
FORMS = {
    "loads": {},
    "pipe_u2": dict(pipe=True, unroll=2),
    "pipe_u4": dict(pipe=True, unroll=4),
    "ring4_u2": dict(unroll=2, ring=4),
    "ring2_u4": dict(unroll=4, ring=2),
}


def variants(arch: str) -> dict:
    """(case, splits, bf16 out, form) -> its kernel."""
    target, specs = GpuTarget(arch), {}
    for i, (name, case) in enumerate(CASES.items()):
        p = attention_params(case, EPS)
        for s in SPLITS:
            splits = batch_splits(len(ROWS), p.NKV) if s == "selected" else s
            for ob in (False, True) if name == "llama8b_bf16" else (False,):
                for form, kw in FORMS.items():
                    k = batch_attention(f"c{i}_{s}{'_ob' * ob}_{form}", p, target, [name], CTX,
                                        case[6], splits, out_bf16=ob, **kw)  # fmt: skip
                    assert k is not None, (name, arch)
                    specs[name, s, ob, form] = (k, splits)
    return specs


@pytest.fixture(scope="module")
def kernels():
    specs = {}

    def build(arch):
        specs.update(variants(arch))
        return [(k.fn, k.template, k.ctx, k.shared) for k, _ in specs.values()]

    dev = DeviceKernels(build)
    dev.specs = specs
    yield dev
    dev.close()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("ob", [False, True], ids=["f32_out", "bf16_out"])
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_attention_matches_numpy(kernels, name, splits, ob, form):
    if (name, splits, ob, form) not in kernels.specs:
        pytest.skip("the bf16 output is the 8B's (the sm_90a o projection reads it)")
    k, S = kernels.specs[name, splits, ob, form]
    NH, NKV, D, _, norm, _, kv = CASES[name][:7]
    case = CASES[name]
    x = prefill_attention_inputs(case, 500 + sorted(CASES).index(name),
                                 [(s, c, 1) for s, c in ROWS], ctx=CTX)  # fmt: skip
    T = x["T"]
    try:
        out = (
            kernels.upload(np.full(T * NH * D, 0xFFFF, np.uint16))
            if ob
            else kernels.poisoned((T, NH * D))
        )
        counters = kernels.upload(np.zeros(T * NKV, np.uint32))
        args = [
            ("u64", kernels.upload(x["q"])),
            ("i32", x["ldq"]),
            ("u64", kernels.upload(x["pos"])),
            ("u64", kernels.upload(x["seq"])),
            ("u64", kernels.upload(x["tables"])),
            ("u64", kernels.upload(x["qw"]) if norm else 0),
            ("u64", kernels.upload(x["cos_t"])),
            ("u64", kernels.upload(x["sin_t"])),
            ("u64", kernels.upload(as_stored(x["kc"], kv))),
            ("u64", kernels.upload(as_stored(x["vc"], kv))),
            ("u64", kernels.poisoned(T * NH * S * (D + 2))),
            ("u64", counters),
            ("u64", out),
        ]
        kernels.launch(k.fn, (T, NKV * S), k.threads, args)
        if ob:
            bits = kernels.read(out, (T, NH * D), np.uint16)
            got = (bits.astype(np.uint32) << 16).view(np.float32)
        else:
            got = kernels.read(out, (T, NH * D))
        left = kernels.read(counters, T * NKV, np.uint32)
    finally:
        kernels.free()
    want = prefill_attention_reference(case, x, EPS)
    assert not np.isnan(got).any(), (name, splits, form, "outputs left unwritten")
    assert not left.any(), (name, splits, form, "counters not reset")
    bar = 2.0**-8 if ob else 1e-5
    assert rel_err(got, want) <= bar, (name, splits, form, rel_err(got, want))
