"""The GPU prefill/batch attention kernels (templates/hip/rope_kv.hip.j2 then attention.hip.j2)
on the host SIMT harness, against NumPy in float64: one step whose rows belong to several
sequences (a prefill chunk continuing a cached prefix, decode rows, a first token), each
sequence's blocks scattered over a pool through its block table, every slot no sequence owns
NaN, outputs NaN-poisoned. What this checks is the paging: each row writes its key and value
to its own slot and attends to its own sequence's positions only. The attention is the batch
step's forms: the one-block-per-row kernel (batch_group: a block per KV head and its group of 2
or 4 query heads where the case has groups; the one-head form elsewhere) and the split-context
one (attention_batch.hip.j2, batch_attention) at geometries whose tiles are short enough that
these contexts take several tiles and several blocks (the merge by the last block to count,
whose counters are zero again afterwards).
"""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest

from hipc.base.launch_plan import KV_BLOCK
from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.attention import (
    ATTN_WAVES,
    BATCH_WAVES,
    batch_attention,
    batch_group,
    kv_context,
    prefill_signature,
    rope_kv_signature,
)
from hipc.compiler.kernels.base import GPU_INDENT
from hipc.compiler.reference.executor import round_bf16
from hipc.compiler.targets import GpuTarget

from gpu_kernels import attention_params, attention_switches, rope

EPS = 1e-5
WAVE = 32

# name: (NH, NKV, D, window, qk norm, interleaved pairs, KV storage, compiled context)
CASES = {
    "gqa_bf16_d64": (4, 2, 64, 0, False, False, "bfloat16", 96),
    "gqa4_window_qknorm_bf16_d64": (8, 2, 64, 20, True, False, "bfloat16", 96),
    "window_qknorm_f32_d32": (4, 4, 32, 12, True, True, "float32", 64),
    "gated_partial_f32_d32": (2, 1, 32, 0, False, False, "float32", 64, 0, 16, True),
}
# the step: (sequence's table row, positions of its rows this step); earlier positions are cached
ROWS = [(2, [5, 6, 7]), (0, [37]), (3, [0]), (1, [16])]
# the split kernel's geometries: (splits, waves, batch_attention's other arguments); the
# default's tiles (64+ keys) hold these whole contexts, one wave of 2 loads takes 8-16 keys a
# tile; pipelined (the next pass's loads in flight, the last pass's none, the first pass's before
# q's RoPE) or through a ring of passes in shared memory, a wave of short tiles runs several
SPLIT_FORMS = [
    (1, BATCH_WAVES, {}), (4, 1, dict(unroll=2)), (3, 2, dict(unroll=2)),
    (1, 1, dict(unroll=2, pipe=True)), (3, 2, dict(unroll=2, pipe=True, q_shared=True)),
    (2, BATCH_WAVES, dict(pipe=True)), (1, 1, dict(unroll=2, ring=3)),
    (3, 2, dict(unroll=1, ring=4, q_shared=True)), (2, 1, dict(unroll=4, ring=2)),
]  # fmt: skip


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    code = []
    for i, (name, case) in enumerate(CASES.items()):
        p = attention_params(case, EPS)
        ctx = {**kv_context(case[6], case[7]), **p.context(), "nodes": [name], "wave": WAVE}
        kv = ctx["kv_type"]
        rope_sig, attn_sig = rope_kv_signature(kv), prefill_signature(kv)
        block = max(p.D // 2, WAVE)
        code.append(
            render("hip/rope_kv.hip.j2", fn=f"rope{i}", block=block,
                   params=rope_sig.render(GPU_INDENT), **ctx)
        )  # fmt: skip
        G = batch_group(p)  # the batch step's kernel: a KV head's query heads per block
        code.append(
            render("hip/attention.hip.j2", fn=f"attn{i}", waves=ATTN_WAVES, group=G,
                   params=attn_sig.render(GPU_INDENT), **ctx)
        )  # fmt: skip
        code.append(
            f'extern "C" void run{i}(int T, const float* q, int ldq, const float* k, int ldk, '
            f"const float* v, int ldv, const int* pos, const int* seq, const int* blocks, "
            f"const float* qw, const float* kw, const float* c, const float* s, {kv}* kc, "
            f"{kv}* vc, float* out) {{\n"
            f"  grid(T, {p.NKV}, {block}, [=] {{ rope{i}(k, ldk, v, ldv, pos, seq, blocks, kw, "
            f"c, s, kc, vc); }});\n"
            f"  grid(T, {p.NH // G}, {ATTN_WAVES * WAVE}, [=] {{ attn{i}(q, ldq, pos, seq, blocks, qw, "
            f"c, s, kc, vc, out); }});\n}}"
        )
        # the split form at each geometry: the same rope_kv, then its partials and counters
        for j, (splits, waves, kw) in enumerate(SPLIT_FORMS):
            bk = batch_attention(f"b{i}_{j}", p, GpuTarget("sm_90"), [name], case[7], case[6],
                                 splits, waves=waves, **kw)  # fmt: skip
            assert bk is not None
            code.append(render("hip/attention_batch.hip.j2", fn=bk.fn, **bk.ctx))
            code.append(
                f'extern "C" void split{i}_{j}(int T, const float* q, int ldq, const float* k, '
                f"int ldk, const float* v, int ldv, const int* pos, const int* seq, "
                f"const int* blocks, const float* qw, const float* kw, const float* c, "
                f"const float* s, {kv}* kc, {kv}* vc, float* partial, unsigned* counters, "
                f"float* out) {{\n"
                f"  grid(T, {p.NKV}, {block}, [=] {{ rope{i}(k, ldk, v, ldv, pos, seq, blocks, "
                f"kw, c, s, kc, vc); }});\n"
                f"  grid(T, {p.NKV * splits}, {bk.threads}, [=] {{ {bk.fn}(q, ldq, pos, seq, "
                f"blocks, qw, c, s, kc, vc, partial, counters, out); }});\n}}"
            )
    source = "#define __launch_bounds__(n)\n" + "\n".join(code)
    return host_simt.build(tmp_path_factory.mktemp("paged"), "paged_host", source, WAVE)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rows_of_many_sequences_over_scattered_blocks(lib, name):
    check(lib, name, None)


@pytest.mark.parametrize("form", range(len(SPLIT_FORMS)))
@pytest.mark.parametrize("name", sorted(CASES))
def test_split_batch_attention(lib, name, form):
    check(lib, name, form)


def check(lib, name, form):
    """Runs case `name`'s step (rope_kv, then the one-block-per-row attention, or with `form`
    the split one at SPLIT_FORMS[form]) and compares the cache and the outputs with NumPy."""
    NH, NKV, D, window, norm, interleaved, kv, ctx = CASES[name][:8]
    rot, gated = attention_switches(CASES[name])
    r = rot or D
    rng = np.random.default_rng(list(CASES).index(name))
    table_len = -(-ctx // KV_BLOCK)
    n_seq = 1 + max(s for s, _ in ROWS)
    # each sequence's blocks, scattered over a pool with spare blocks (all NaN)
    need = {s: -(-(max(ps) + 1) // KV_BLOCK) for s, ps in ROWS}
    pool_blocks = sum(need.values()) + 5
    perm = iter(rng.permutation(pool_blocks))
    tables = np.full((n_seq, table_len), -1, np.int32)
    for s, n in need.items():
        tables[s, :n] = [next(perm) for _ in range(n)]

    def slot(s, c):
        return tables[s, c // KV_BLOCK] * KV_BLOCK + c % KV_BLOCK

    pos = np.array([c for _, ps in ROWS for c in ps], np.int32)
    seq = np.array([s for s, ps in ROWS for _ in ps], np.int32)
    T = len(pos)
    ldq = 2 * NH * D if gated else NH * D
    q_in = rng.standard_normal((T, ldq)).astype(np.float32)
    k = rng.standard_normal((T, NKV * D)).astype(np.float32)
    v = rng.standard_normal((T, NKV * D)).astype(np.float32)
    qw, kw = (1 + 0.2 * rng.standard_normal((2, D))).astype(np.float32)
    ang = rng.uniform(0, 2 * np.pi, (ctx, r // 2))
    cos_t, sin_t = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    store = round_bf16 if kv == "bfloat16" else (lambda a: a.astype(np.float32))
    # the cached positions before each sequence's first row this step (already rotated)
    pools = [np.full((pool_blocks * KV_BLOCK, NKV, D), np.nan, np.float32) for _ in range(2)]
    for s, ps in ROWS:
        for c in range(ps[0]):
            for pl in pools:
                pl[slot(s, c)] = store(rng.standard_normal((NKV, D)))
    if kv == "bfloat16":
        kc, vc = ((pl.view(np.uint32) >> 16).astype(np.uint16) for pl in pools)

        def widen(a):
            return (a.astype(np.uint32) << 16).view(np.float32)
    else:
        kc, vc = (pl.copy() for pl in pools)

        def widen(a):
            return a

    out = np.full((T, NH * D), np.nan, np.float32)
    ptr = ctypes.c_void_p
    args = [q_in, ldq, k, NKV * D, v, NKV * D, pos, seq, tables, qw, kw, cos_t, sin_t, kc, vc]
    i = list(CASES).index(name)
    if form is None:
        args, run = [*args, out], f"run{i}"
    else:
        splits = SPLIT_FORMS[form][0]
        partial = np.full((T, NH, splits, D + 2), np.nan, np.float32)
        counters = np.zeros((T, NKV), np.uint32)
        args, run = [*args, partial, counters, out], f"split{i}_{form}"
    getattr(lib, run)(
        ctypes.c_int(T),
        *(ctypes.c_int(a) if isinstance(a, int) else a.ctypes.data_as(ptr) for a in args),
    )
    if form is not None:
        assert not counters.any(), "each row's last block resets its counter"

    def normed(x, w):
        x = x.astype(np.float64)
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * w if norm else x

    def rotated(x, c):
        x = x.copy()
        x[..., :r] = rope(x[..., :r], cos_t[c], sin_t[c], interleaved)
        return x

    # the step's keys and values went to their rows' slots, nothing else changed
    K, Vv = widen(kc).astype(np.float64), widen(vc).astype(np.float64)
    written = set()
    for t in range(T):
        at = slot(seq[t], pos[t])
        written.add(at)
        kn = store(rotated(normed(k[t].reshape(NKV, D), kw), pos[t]))
        np.testing.assert_allclose(K[at], kn, rtol=2.0**-7 if kv == "bfloat16" else 1e-5, atol=1e-6)
        np.testing.assert_array_equal(Vv[at], store(v[t].reshape(NKV, D)))
    untouched = [i for i in range(len(kc)) if i not in written]
    np.testing.assert_array_equal(kc[untouched], kc0_of(pools, kv)[untouched])

    group = NH // NKV
    want = np.empty((T, NH, D))
    for t in range(T):
        s, p = seq[t], pos[t]
        lo = max(0, p - window + 1) if window else 0
        slots = [slot(s, c) for c in range(lo, p + 1)]
        qr = rotated(normed(q_in[t].reshape(NH, -1)[:, :D], qw), p)
        for h in range(NH):
            sc = K[slots, h // group] @ qr[h] * D**-0.5
            e = np.exp(sc - sc.max())
            want[t, h] = e @ Vv[slots, h // group] / e.sum()
        if gated:
            gate = q_in[t].reshape(NH, 2 * D)[:, D:].astype(np.float64)
            want[t] /= 1 + np.exp(-gate)
    want = want.reshape(T, NH * D)
    err = float(np.max(np.abs(out - want)) / np.max(np.abs(want)))
    assert err <= 1e-5, (name, err)


def kc0_of(pools, kv):
    """The key pool as it was before the step, in the kernel's storage type."""
    if kv == "bfloat16":
        return (pools[0].view(np.uint32) >> 16).astype(np.uint16)
    return pools[0]
