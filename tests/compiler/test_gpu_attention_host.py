"""The decode attention kernel (templates/hip/attention_decode.hip.j2) run on the host: the
rendered kernel compiled by a plain C++ compiler with HIPC_HOST_SIMT, each block's threads
run in step as host threads (shuffles and barriers through a sleeping barrier), the blocks of
the grid one after another (any order is one the GPU may take), against NumPy in float64.
tests/gpu runs the same kernel on a GPU; this checks its indexing and merging on a machine
with none. The caches are paged pools: the sequence's blocks are scattered over a larger pool
(through a block table that is not the identity), every slot it does not own is NaN.
"""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest

from hipc.base.launch_plan import KV_BLOCK
from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.attention import decode_attention
from hipc.compiler.reference.executor import round_bf16
from hipc.compiler.targets import GpuTarget

from gpu_kernels import attention_params, attention_switches, rope

EPS = 1e-5


# name: (NH, NKV, D, window, qk norm, interleaved pairs, KV storage, compiled context, p)
CASES = {
    "llama_bf16_d128": (4, 2, 128, 0, False, False, "bfloat16", 512, 300),
    "f32_d64_chunks": (6, 3, 64, 0, False, False, "float32", 1024, 700),
    "window_f32_d32": (6, 3, 32, 100, False, False, "float32", 1024, 900),
    "qknorm_d12_bf16": (4, 1, 12, 0, True, False, "bfloat16", 256, 100),
    "first_token": (4, 1, 64, 0, False, True, "bfloat16", 256, 0),
    # Qwen3.5/3-Next: q rows [query | gate] per head, output * sigmoid(gate), RoPE on the
    # first rot dims (the trailing two fields: rot, out_gate)
    "gated_partial_d64_f32": (5, 5, 64, 0, True, False, "float32", 512, 77, 16, True),
    "partial_interleaved_bf16": (6, 2, 64, 0, False, True, "bfloat16", 256, 40, 32, False),
}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    kernels, wrappers = [], []
    specs = {}
    for i, (name, case) in enumerate(CASES.items()):
        k = decode_attention(
            f"att{i}", attention_params(case, EPS), GpuTarget("sm_90"), [name], case[7], case[6]
        )
        specs[name] = k
        kernels.append(render(f"hip/{k.template}.hip.j2", fn=k.fn, **k.ctx))
        kv = "uint16_t" if case[6] == "bfloat16" else "float"
        wrappers.append(
            f'extern "C" void run_{k.fn}(const float* q, const float* k, const float* v, '
            f"const int* pos, const int* seq, const int* blocks, const float* qw, const float* kw, "
            f"const float* c, const float* s, {kv}* kc, {kv}* vc, float* part, unsigned* cnt, "
            f"float* out) {{\n"
            f"  grid({k.grid[0]}, {k.grid[1]}, {k.threads}, [=] {{ {k.fn}(q, k, v, pos, seq, "
            f"blocks, qw, kw, c, s, kc, vc, part, cnt, out); }});\n}}"
        )
    code = "\n".join(kernels) + "\n" + "\n".join(wrappers)
    handle = host_simt.build(tmp_path_factory.mktemp("attention"), "attention_host", code)
    handle.specs = specs
    return handle


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_attention_on_the_host(lib, name):
    NH, NKV, D, window, norm, interleaved, kv, ctx, p = CASES[name][:9]
    rot, gated = attention_switches(CASES[name])
    r = rot or D
    spec = lib.specs[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    q_in = rng.standard_normal((NH, 2 * D if gated else D)).astype(np.float32)
    q = q_in[:, :D]
    k = rng.standard_normal((NKV, D)).astype(np.float32)
    v = rng.standard_normal((NKV, D)).astype(np.float32)
    qw, kw = (1 + 0.2 * rng.standard_normal((2, D))).astype(np.float32)
    ang = rng.uniform(0, 2 * np.pi, (ctx, r // 2))
    cos_t, sin_t = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    logical = [rng.standard_normal((ctx, NKV, D)).astype(np.float32) for _ in range(2)]
    for c in logical:
        c[p:] = np.nan  # position p is this step's to write; nothing past it may be used
    # the sequence's blocks scattered over a pool three times its size, in the table's row 1
    B, table_len = KV_BLOCK, -(-ctx // KV_BLOCK)
    mine = -(-(p + 1) // B)
    pool_blocks = 3 * mine + 2
    owned = rng.permutation(pool_blocks)[:mine]
    tables = np.full((3, table_len), -1, np.int32)  # -1: a block id no row may read
    tables[1, :mine] = owned
    slots = (owned[:, None] * B + np.arange(B)).reshape(-1)[: p + 1]
    cache = [np.full((pool_blocks * B, NKV, D), np.nan, np.float32) for _ in range(2)]
    for c, lg in zip(cache, logical, strict=True):
        c[slots] = lg[: p + 1]
    if kv == "bfloat16":
        kc, vc = ((round_bf16(c).view(np.uint32) >> 16).astype(np.uint16) for c in cache)

        def widen(a):
            return (a.astype(np.uint32) << 16).view(np.float32)
    else:
        kc, vc = (c.copy() for c in cache)

        def widen(a):
            return a

    kc0 = kc.copy()
    splits = spec.grid[1]
    partial = np.full(NH * splits * (D + 2), np.nan, np.float32)
    counters = np.zeros(NH, np.uint32)
    out = np.full((NH, D), np.nan, np.float32)
    ptr = ctypes.c_void_p
    step = [np.array([p], np.int32), np.array([1], np.int32), tables]
    args = [q_in, k, v, *step, qw, kw, cos_t, sin_t, kc, vc, partial, counters]
    getattr(lib, f"run_{spec.fn}")(*(a.ctypes.data_as(ptr) for a in [*args, out]))

    def normed(x, w):
        x = x.astype(np.float64)
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * w if norm else x

    store = round_bf16 if kv == "bfloat16" else (lambda a: a.astype(np.float32))

    def rotated(x):
        x = x.copy()
        x[..., :r] = rope(x[..., :r], cos_t[p], sin_t[p], interleaved)
        return x

    qr = rotated(normed(q, qw))
    kn = store(rotated(normed(k, kw)))
    vn = store(v)
    ulp = 2.0**-7 if kv == "bfloat16" else 1e-6
    at = slots[p]
    np.testing.assert_allclose(widen(kc[at]), kn, rtol=ulp, atol=1e-6)
    np.testing.assert_array_equal(widen(vc[at]), vn)
    # nothing else of the pool was written
    others = np.setdiff1d(np.arange(len(kc)), [at])
    np.testing.assert_array_equal(kc[others], kc0[others])
    assert not counters.any()  # every head's merging block reset its counter
    lo = max(0, p - window + 1) if window else 0
    keys = widen(kc[slots[lo : p + 1]]).astype(np.float64)
    vals = widen(vc[slots[lo : p + 1]]).astype(np.float64)
    group = NH // NKV
    want = np.empty((NH, D))
    for h in range(NH):
        sc = keys[:, h // group] @ qr[h] * D**-0.5
        e = np.exp(sc - sc.max())
        want[h] = e @ vals[:, h // group] / e.sum()
    if gated:
        want = want / (1 + np.exp(-q_in[:, D:].astype(np.float64)))
    err = float(np.max(np.abs(out - want)) / np.max(np.abs(want)))
    assert err <= 1e-5, (name, err)
