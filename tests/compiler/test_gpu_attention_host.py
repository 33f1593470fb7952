"""The decode attention kernel (templates/hip/attention_decode.hip.j2), and prefill's rope_kv
and SIMT attention kernels (rope_kv.hip.j2, attention.hip.j2), run on the host: the
rendered kernels compiled by a plain C++ compiler with HIPC_HOST_SIMT, each block's threads
run in step as fibers of one host thread (tests/host_simt.py), the blocks of
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
from hipc.compiler.kernels.attention import (
    ATTN_WAVES,
    decode_attention,
    kv_context,
    prefill_signature,
    rope_kv_signature,
)
from hipc.compiler.kernels.base import GPU_INDENT
from hipc.compiler.reference.executor import round_bf16
from hipc.compiler.targets import GpuTarget

from gpu_kernels import attention_clip, attention_params, attention_switches, rope

EPS = 1e-5


# name: (NH, NKV, D, window, qk norm, interleaved pairs, KV storage, compiled context, p)
DECODE = {
    "llama_bf16_d128": (4, 2, 128, 0, False, False, "bfloat16", 512, 300),
    "f32_d64_chunks": (6, 3, 64, 0, False, False, "float32", 1024, 700),
    "window_f32_d32": (6, 3, 32, 100, False, False, "float32", 1024, 900),
    "qknorm_d12_bf16": (4, 1, 12, 0, True, False, "bfloat16", 256, 100),
    "first_token": (4, 1, 64, 0, False, True, "bfloat16", 256, 0),
    # Qwen3.5/3-Next: q rows [query | gate] per head, output * sigmoid(gate), RoPE on the
    # first rot dims (the trailing two fields: rot, out_gate)
    "gated_partial_d64_f32": (5, 5, 64, 0, True, False, "float32", 512, 77, 16, True),
    "partial_interleaved_bf16": (6, 2, 64, 0, False, True, "bfloat16", 256, 40, 32, False),
    # OLMoE: q, k and v clamped to [-clip, clip] as read (then the per-head norm where fused)
    "clip_bf16": (4, 2, 64, 0, False, False, "bfloat16", 256, 50, 0, False, 0.4),
    "clip_qknorm_f32": (4, 1, 32, 0, True, True, "float32", 256, 70, 0, False, 0.7),
    # several tiles per block (BLOCKS below), the tile of p not the owner's first
    "tiles_per_block_bf16": (4, 2, 128, 0, False, False, "bfloat16", 1024, 700),
    "tiles_window_qknorm_f32": (6, 2, 64, 200, True, True, "float32", 1024, 650),
    # 8 query heads per KV head (two per wave), head dim 256 (16-key tiles), Qwen3.5's gate
    "g8_d128_bf16": (16, 2, 128, 0, False, False, "bfloat16", 512, 333),
    "d256_gated_partial_bf16": (16, 2, 256, 0, True, False, "bfloat16", 1024, 400, 64, True),
    # p at the edges of a tile (32 keys) and of a cache block (16 positions)
    "edge_p31": (9, 3, 64, 0, False, False, "bfloat16", 256, 31),
    "edge_p32": (9, 3, 64, 0, False, False, "bfloat16", 256, 32),
    "edge_p47_window": (9, 3, 64, 16, False, False, "bfloat16", 256, 47),
    "edge_p64_one_split": (9, 3, 64, 0, False, False, "bfloat16", 256, 64),
}
# decode blocks in all (decode_attention's `blocks`), where not the default: few splits, so a
# block loops over tiles
BLOCKS = {
    "tiles_per_block_bf16": 6,
    "tiles_window_qknorm_f32": 4,
    "d256_gated_partial_bf16": 8,
    "edge_p64_one_split": 3,
}


# tile form geometries: 4 and 2 lanes per score, 32-key tiles of 4 waves, 128-key tiles in
# dynamic shared memory, merges of 2 blocks a step, 16-key tiles of 2 waves, several tiles a
# block before the context splits
TILE_GEOMETRIES = (
    ("llama_bf16_d128", "l4"), ("f32_d64_chunks", "k32:w4:m2"), ("tiles_per_block_bf16", "k128"),
    ("qknorm_d12_bf16", "l2:k16"), ("window_f32_d32", "l4:k32:b256"),
    ("d256_gated_partial_bf16", "k32:m2"), ("edge_p47_window", "k16:w2"),
    # one wave: 6 outputs a thread, two heads' (an m, l per output), 5 blocks merged 2 a step
    ("edge_p64_one_split", "w1:k16:m2:b48"),
    # blocks taking 2 / 3 tiles before another gets one (5 tiles on 3 blocks, p's tile not a
    # block's first; 7 tiles of a window on 3), and one block taking 22 tiles (no merge)
    ("llama_bf16_d128", "t2"), ("window_f32_d32", "k16:t3"), ("f32_d64_chunks", "k32:t32"),
    # one block alone up to 5 / 30 tiles (p's 5th: one block; 22 tiles: one block), then a tile each
    ("llama_bf16_d128", "s5"), ("f32_d64_chunks", "k32:s30"), ("tiles_per_block_bf16", "k32:s4"),
    # two tiles on two blocks and their merge (the default takes them in one block)
    ("gated_partial_d64_f32", "s1"),
    # a KV head's query heads over several blocks: one a block (each writing the new row into
    # its tile, the first alone to the cache), merged over splits (a counter per block column);
    # two a block of 8, with q/k norms and Qwen3.5's gate, split; 3 of 9 on a 4-wave block
    # (one a block: h1 on every case above)
    ("tiles_per_block_bf16", "h1:s1"), ("g8_d128_bf16", "h2:s1"),
    ("d256_gated_partial_bf16", "h2:k32"), ("edge_p64_one_split", "h1:w4:k16:m2"),
    # and the value sums' keys split over 4 / 2 groups of threads (summed at the end)
    ("llama_bf16_d128", "h1:v4:l4"), ("tiles_per_block_bf16", "h1:v4:s1"),
    ("tiles_window_qknorm_f32", "h1:v2"), ("edge_p64_one_split", "h1:v2:k16:w2"),
    # the first tile's arithmetic rehearsed before the wait (q = 0, dropped): alone on one tile,
    # the first token, a window with q/k norms, one head a block with key groups, split and
    # merged, Qwen3.5's gate on 256-dim heads
    ("llama_bf16_d128", "r1"), ("first_token", "r1"), ("tiles_window_qknorm_f32", "r1"),
    ("edge_p64_one_split", "h1:v2:k16:w2:r1"), ("f32_d64_chunks", "k32:s1:r1"),
    ("d256_gated_partial_bf16", "h2:k32:r1"),
)  # fmt: skip
# the grouped kernel (one block per KV head and split) on every case; the per-query-head one
# (the fallback where the grouped ones' tiles would not fit) on most; the grouped one with AMD
# CDNA's 64-lane waves (gfx942: lanes past a tile's 32 keys idle) on a few
HEAD_CASES = (
    "llama_bf16_d128", "window_f32_d32", "gated_partial_d64_f32", "first_token",
    "qknorm_d12_bf16", "clip_bf16", "f32_d64_chunks", "edge_p31", "tiles_per_block_bf16",
)  # fmt: skip
FORMS = (
    {(n, "gqa"): c for n, c in DECODE.items()}
    | {(n, "head"): DECODE[n] for n in HEAD_CASES}
    | {
        (n, "gqa-wave64"): DECODE[n]
        for n in ("tiles_per_block_bf16", "tiles_window_qknorm_f32", "d256_gated_partial_bf16")
    }
    # the tile form (attention_decode_tile, the default: a KV head's whole group a block, its
    # tiles read once a step) on every case, and some of its geometries; the tile and grouped
    # forms with AMD CDNA's 64-lane waves on a few
    | {(n, "tile"): c for n, c in DECODE.items()}
    # and with a query head a block (the group's blocks each reading the tiles)
    | {(n, "tile:h1"): c for n, c in DECODE.items()}
    | {(n, f"tile:{o}"): DECODE[n] for n, o in TILE_GEOMETRIES}
    | {
        (n, "tile-wave64"): DECODE[n]
        for n in ("tiles_per_block_bf16", "tiles_window_qknorm_f32", "gated_partial_d64_f32")
    }
)


@pytest.fixture(scope="module")
def lib32(tmp_path_factory):
    return _build(tmp_path_factory, 32)


@pytest.fixture(scope="module")
def lib64(tmp_path_factory):
    return _build(tmp_path_factory, 64)


def _build(tmp_path_factory, wave: int):
    """The kernels of one wave width (sm_90's 32 or gfx942's 64), built as one library."""
    kernels, wrappers = [], []
    specs = {}
    for i, (key, case) in enumerate(FORMS.items()):
        name, form = key
        if form.endswith("-wave64") != (wave == 64):
            continue
        k = decode_attention(
            f"att{i}",
            attention_params(case, EPS),
            GpuTarget("gfx942" if wave == 64 else "sm_90"),
            [name],
            case[7],
            case[6],
            blocks=BLOCKS.get(name),
            form=form.split("-")[0],
        )
        want = {"head": "", "gqa": "_gqa", "tile": "_tile"}[form.split("-")[0].split(":")[0]]
        assert k.template == f"attention_decode{want}"
        specs[key] = k
        kernels.append(render(f"hip/{k.template}.hip.j2", fn=k.fn, **k.ctx))
        kv = "uint16_t" if case[6] == "bfloat16" else "float"
        wrappers.append(
            f'extern "C" void run_{k.fn}(const float* q, const float* k, const float* v, '
            f"const int* pos, const int* seq, const int* blocks, const float* qw, const float* kw, "
            f"const float* c, const float* s, {kv}* kc, {kv}* vc, float* part, unsigned* cnt, "
            f"float* out) {{\n"
            f"  grid({k.grid[0]}, {k.grid[1]}, {k.threads}, [=] {{ {k.fn}(q, k, v, pos, seq, "
            f"blocks, qw, kw, c, s, kc, vc, part, cnt, out); }}, {k.shared});\n}}"
        )
    code = "\n".join(kernels) + "\n" + "\n".join(wrappers)
    handle = host_simt.build(
        tmp_path_factory.mktemp("attention"), f"attention_host{wave}", code, wave=wave
    )
    handle.specs = specs
    return handle


@pytest.mark.parametrize("name,form", sorted(FORMS))
def test_decode_attention_on_the_host(request, name, form):
    lib = request.getfixturevalue("lib64" if form.endswith("-wave64") else "lib32")
    NH, NKV, D, window, norm, interleaved, kv, ctx, p = DECODE[name][:9]
    rot, gated = attention_switches(DECODE[name])
    r = rot or D
    spec = lib.specs[name, form]
    rng = np.random.default_rng(sorted(DECODE).index(name))
    q_in = rng.standard_normal((NH, 2 * D if gated else D)).astype(np.float32)
    k = rng.standard_normal((NKV, D)).astype(np.float32)
    v = rng.standard_normal((NKV, D)).astype(np.float32)
    clip = attention_clip(DECODE[name])
    q, k_read, v_read = q_in[:, :D], k, v
    if clip:
        q, k_read, v_read = (np.clip(x, -clip, clip) for x in (q, k, v))
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
    kn = store(rotated(normed(k_read, kw)))
    vn = store(v_read)
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


# name: (NH, NKV, D, window, qk norm, interleaved pairs, KV storage, start, T, rot, gate, clip)
PREFILL = {
    "clip_bf16_prefix": (4, 2, 32, 0, False, False, "bfloat16", 9, 6, 0, False, 0.5),
    "clip_qknorm_window_f32": (3, 1, 32, 5, True, True, "float32", 0, 7, 0, False, 0.8),
    "plain_f32": (2, 2, 32, 0, False, False, "float32", 3, 4),
    # the output in bf16 (for the o projection's sm_90a GEMM: Attention.bf16_reader)
    "plain_f32_out_bf16": (2, 2, 32, 0, False, False, "float32", 3, 4),
}


def prefill_ctx(case) -> int:
    return case[7] + case[8] + 5


@pytest.fixture(scope="module")
def prefill_lib(tmp_path_factory):
    code, specs = [], {}
    for i, (name, case) in enumerate(PREFILL.items()):
        p, kv = attention_params(case, EPS), kv_context(case[6], prefill_ctx(case))
        kt, block = kv["kv_type"], max(case[2] // 2, 32)
        code.append(
            render(
                "hip/rope_kv.hip.j2",
                fn=f"rk{i}",
                nodes=[name],
                block=block,
                params=rope_kv_signature(kt).render(GPU_INDENT),
                **kv,
                **p.context(),
            )
        )
        code.append(render("hip/attention.hip.j2", fn=f"at{i}", nodes=[name], wave=32,
                           waves=ATTN_WAVES, params=prefill_signature(kt).render(GPU_INDENT),
                           out_bf16=name.endswith("_out_bf16"), **kv, **p.context()))  # fmt: skip
        NH, NKV, T = case[0], case[1], case[8]
        code.append(
            f'extern "C" void run_{i}(const float* q, int ldq, const float* k, int ldk, '
            f"const float* v, int ldv, const int* pos, const int* seq, const int* blocks, "
            f"const float* qw, const float* kw, const float* c, const float* s, {kt}* kc, "
            f"{kt}* vc, float* out) {{\n"
            f"  grid({T}, {NKV}, {block}, [=] {{ rk{i}(k, ldk, v, ldv, pos, seq, blocks, kw, c, s, kc, vc); }});\n"
            f"  grid({T}, {NH}, {ATTN_WAVES * 32}, [=] {{ at{i}(q, ldq, pos, seq, blocks, qw, c, s, kc, vc, out); }});\n}}"
        )
        specs[name] = (i, kv["kv_block"], kv["kv_table"])
    handle = host_simt.build(tmp_path_factory.mktemp("prefill"), "prefill_host", "\n".join(code))
    handle.specs = specs
    return handle


@pytest.mark.parametrize("name", sorted(PREFILL))
def test_prefill_attention_on_the_host(prefill_lib, name):
    """rope_kv writes the prompt's keys and values (clamped, normed, rotated) at start..start+T-1
    of one sequence whose blocks are scattered over the paged pool, then the SIMT attention
    reads them with the cached prefix; NaN in every other slot and in the output beforehand:
    neither may survive."""
    case = PREFILL[name]
    NH, NKV, D, window, norm, interleaved, kv, start, T = case[:9]
    clip = attention_clip(case)
    i, B, n_blocks = prefill_lib.specs[name]
    rng = np.random.default_rng(50 + sorted(PREFILL).index(name))
    ctx = prefill_ctx(case)
    table = rng.permutation(n_blocks).astype(np.int32)  # sequence 0's blocks, scattered
    slots = (table[:, None] * B + np.arange(B)).reshape(-1)[:ctx]
    ld = NH * D + 2 * NKV * D + 3  # q, k, v: column views of one projection's output
    qkv = (rng.standard_normal((T, ld)) * 1.5).astype(np.float32)
    q, k, v = (
        qkv[:, a : a + n] for a, n in ((0, NH * D), (NH * D, NKV * D), (NH * D + NKV * D, NKV * D))
    )
    qw, kw = (1 + 0.2 * rng.standard_normal((2, D))).astype(np.float32)
    ang = rng.uniform(0, 2 * np.pi, (ctx, D // 2))
    cos_t, sin_t = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    store = round_bf16 if kv == "bfloat16" else (lambda a: a.astype(np.float32))
    cache = [np.full((n_blocks * B, NKV, D), np.nan, np.float32) for _ in range(2)]
    for c in cache:
        c[slots[:start]] = store(rng.standard_normal((start, NKV, D)).astype(np.float32))
    if kv == "bfloat16":
        kc, vc = ((c.view(np.uint32) >> 16).astype(np.uint16) for c in cache)

        def widen(a):
            return (a.astype(np.uint32) << 16).view(np.float32)
    else:
        kc, vc = (c.copy() for c in cache)

        def widen(a):
            return a

    out = np.full((T, NH * D), np.nan, np.float32)
    pos = np.arange(start, start + T, dtype=np.int32)
    seq = np.zeros(T, np.int32)
    ptr = ctypes.c_void_p
    getattr(prefill_lib, f"run_{i}")(
        qkv.ctypes.data_as(ptr), ld, qkv[:, NH * D :].ctypes.data_as(ptr), ld,
        qkv[:, NH * D + NKV * D :].ctypes.data_as(ptr), ld,
        *(a.ctypes.data_as(ptr) for a in (pos, seq, table, qw, kw, cos_t, sin_t, kc, vc, out)),
    )  # fmt: skip

    def read(x, heads, w):
        x = x.reshape(T, heads, D).astype(np.float64)
        if clip:
            x = np.clip(x, -clip, clip)
        if norm:
            x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * w
        return rope(x, cos_t[start : start + T, None], sin_t[start : start + T, None], interleaved)

    kn = store(read(k, NKV, kw).astype(np.float32))
    vn = store(np.clip(v, -clip, clip) if clip else v).reshape(T, NKV, D)
    ulp = 2.0**-7 if kv == "bfloat16" else 1e-6
    mine = slots[start : start + T]
    np.testing.assert_allclose(widen(kc[mine]), kn, rtol=ulp, atol=1e-6)
    np.testing.assert_array_equal(widen(vc[mine]), vn)
    keys = widen(kc[slots[: start + T]]).astype(np.float64)
    vals = widen(vc[slots[: start + T]]).astype(np.float64)
    qr = read(q, NH, qw)
    want = np.empty((T, NH, D))
    for t in range(T):
        p = start + t
        lo = max(0, p - window + 1) if window else 0
        for h in range(NH):
            kvh = h // (NH // NKV)
            sc = keys[lo : p + 1, kvh] @ qr[t, h] * D**-0.5
            e = np.exp(sc - sc.max())
            want[t, h] = e @ vals[lo : p + 1, kvh] / e.sum()
    bar = 1e-5
    if name.endswith("_out_bf16"):  # bf16 rows from the buffer's start: 2^-9 of each value more
        out = (out.view(np.uint16).reshape(-1)[: out.size].astype(np.uint32) << 16).view(np.float32)
        bar += 2.0**-9
    err = float(np.max(np.abs(out.reshape(T, NH, D) - want)) / np.max(np.abs(want)))
    assert err <= bar, (name, err)


def test_grouped_decode_attention_falls_back_where_its_tiles_do_not_fit():
    """The grouped kernel's shared arrays hold a tile, the group's q rows and the merge's
    weights; 64 query heads of 256 dims per KV head do not fit in 48 KiB, so the per-head
    kernel serves them (and any shape asked for it). At most DECODE_GQA_SPLITS blocks per
    KV head."""
    from hipc.compiler.kernels.attention import AttentionParams

    def kernel(NH, NKV, D, kv, form="gqa"):
        p = AttentionParams(NH=NH, NKV=NKV, D=D, scale=D**-0.5, window=0, interleaved=False,
                            norm_eps=0.0)  # fmt: skip
        return decode_attention("a", p, GpuTarget("sm_90"), ["a"], 8192, kv, form=form)

    llama = kernel(32, 8, 128, "bfloat16")
    assert llama.template == "attention_decode_gqa" and llama.grid == [8, 32]
    assert kernel(9, 3, 64, "bfloat16").grid == [3, 32]  # SmolLM2: 256 / 3, capped
    assert kernel(64, 1, 256, "float32").template == "attention_decode"
    assert kernel(32, 8, 128, "bfloat16", form="head").template == "attention_decode"
    # 16-key tiles where a cached row is over 256 bytes
    assert kernel(16, 2, 256, "bfloat16").ctx["tk"] == 16
    # the tile form: its tiles past 48 KiB in dynamic shared memory on NVIDIA; on AMD, whose
    # 64 KiB of LDS they would overflow, the per-head kernel
    assert kernel(16, 2, 256, "bfloat16", form="tile").shared > 48 << 10
    p = AttentionParams(NH=16, NKV=2, D=256, scale=0.0625, window=0, interleaved=False,
                        norm_eps=0.0)  # fmt: skip
    amd = decode_attention("a", p, GpuTarget("gfx942"), ["a"], 8192, "bfloat16", form="tile")
    assert amd.template == "attention_decode"


def test_tile_form_defaults_and_refusals():
    """The KV head's whole group a block by default (grid KV heads x splits); with hN, N query
    heads a block, lanes per score and value key groups filling it. A form the model cannot
    take is one line naming HIPC_DECODE_FORM (HipcError), not a traceback."""
    from hipc.base.errors import HipcError
    from hipc.compiler.kernels.attention import AttentionParams

    def kernel(NH, NKV, D, form="tile"):
        p = AttentionParams(NH=NH, NKV=NKV, D=D, scale=D**-0.5, window=0, interleaved=False,
                            norm_eps=0.0)  # fmt: skip
        return decode_attention("a", p, GpuTarget("sm_90"), ["a"], 8192, "bfloat16", form=form)

    def geometry(k):  # grid, heads a block, lanes per score, value key groups
        return k.grid, k.ctx["hb"], k.ctx["lpk"], k.ctx["vs"]

    assert geometry(kernel(32, 8, 128)) == ([8, 32], 4, 1, 1)
    assert geometry(kernel(32, 8, 128, "tile:h1")) == ([32, 8], 1, 4, 4)
    assert geometry(kernel(32, 8, 128, "tile:h2")) == ([16, 16], 2, 2, 2)
    assert kernel(16, 2, 256, "tile:h1").ctx["vs"] == 2  # 128 pairs a head: 2 groups of 256
    assert not kernel(32, 8, 128).ctx["rehearse"] and kernel(32, 8, 128, "tile:r1").ctx["rehearse"]
    for form, says in [
        ("tile:h2", "2 heads a block do not divide 3"),
        ("tile:q3", "unknown option 'q3'"),
        ("tile:h1:v3", "key groups are 1, 2 or 4"),
        ("tile:h0:v4", "4 key groups need more threads"),
        ("tile:r2", "the rehearsal is r0 or r1"),
    ]:
        with pytest.raises(HipcError, match=f"HIPC_DECODE_FORM='{form}': {says}"):
            kernel(9, 3, 64, form)
