"""The decode kernels alone on a real GPU, against NumPy in float64.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). Each kernel is
rendered as codegen/hip.py renders it (compiler/kernels: decode_gemv, decode_attention,
the embedding's gpu_kernel), for
the device's arch, with random inputs and outputs poisoned with NaN, so a value a kernel
forgot to write, or a row it should not have read, shows. Weights of every storage type
are packed here the way GGUF / safetensors store them.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.kernels.attention import AttentionParams, decode_attention
from hipc.compiler.kernels.embedding import EmbeddingParams
from hipc.compiler.kernels.embedding import gpu_kernel as embedding_kernel
from hipc.compiler.kernels.linear import LinearParams, decode_gemv
from hipc.compiler.reference.executor import round_bf16
from hipc.compiler.targets import GpuTarget

from gpu_kernels import DeviceKernels
from support import rel_err

pytestmark = pytest.mark.gpu
EPS = 1e-5

# -- weights in their storage types -----------------------------------------------------


def pack(w: np.ndarray, wtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(bytes as stored, the exact values they hold) for a float matrix [N, K]."""
    N, K = w.shape
    if wtype == "float32":
        return w.astype(np.float32), w.astype(np.float32).astype(np.float64)
    if wtype == "float16":
        h = w.astype(np.float16)
        return h, h.astype(np.float64)
    if wtype == "bfloat16":
        bits = (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    blocks = w.reshape(N, K // 32, 32)
    if wtype == "q8_0":
        d = (np.abs(blocks).max(-1) / 127).astype(np.float16)
        q = np.round(blocks / np.maximum(d[..., None].astype(np.float64), 1e-12)).astype(np.int8)
        raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
        return raw.reshape(N, -1), (d[..., None].astype(np.float64) * q).reshape(N, K)
    lo, hi = blocks.min(-1), blocks.max(-1)
    if wtype == "q4_0":
        d = (np.maximum(-lo, hi) / 7.5).astype(np.float16)
        q = np.clip(
            np.round(blocks / np.maximum(d[..., None].astype(np.float64), 1e-12)) + 8, 0, 15
        )
        vals = d[..., None].astype(np.float64) * (q - 8)
        head = d[..., None].view(np.uint8)
    else:  # q4_1: d * q + m
        d = ((hi - lo) / 15).astype(np.float16)
        m = lo.astype(np.float16)
        q = np.clip(
            np.round((blocks - m[..., None]) / np.maximum(d[..., None].astype(np.float64), 1e-12)),
            0,
            15,
        )
        vals = d[..., None].astype(np.float64) * q + m[..., None].astype(np.float64)
        head = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8)], -1)
    q = q.astype(np.uint8)
    nib = q[..., :16] | (q[..., 16:] << 4)  # element j < 16: low nibble; j >= 16: high
    raw = np.concatenate([head, nib], axis=-1)
    return raw.reshape(N, -1), vals.reshape(N, K)


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
    "q4_0_glu_norm": ("q4_0", 2 * 64, 1536, "glu", True, False),
    "q4_1_norm_bias": ("q4_1", 96, 576, "none", True, True),
}


def gemv_params(case) -> LinearParams:
    wtype, N, K, epilogue, norm, bias = case
    return LinearParams(
        wtype=wtype, N=N, K=K, norm_eps=EPS if norm else 0.0, epilogue=epilogue, bias=bias
    )


@pytest.fixture(scope="module")
def gemvs():
    specs = {}

    def build(arch):
        for i, (name, case) in enumerate(GEMVS.items()):
            specs[name] = decode_gemv(f"g{i}", gemv_params(case), GpuTarget(arch), [name])
        return [(k.fn, k.template, k.ctx, k.shared) for k in specs.values()]

    dev = DeviceKernels(build)
    dev.specs = specs
    yield dev
    dev.close()


@pytest.mark.parametrize("name", sorted(GEMVS))
def test_gemv_matches_numpy(gemvs, name):
    wtype, N, K, epilogue, norm, bias = GEMVS[name]
    n_out = N // 2 if epilogue == "glu" else N
    rng = np.random.default_rng(sorted(GEMVS).index(name))
    raw, w = pack(0.05 * rng.standard_normal((N, K)), wtype)
    x = (rng.standard_normal(K) * 3).astype(np.float32)
    g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    r = rng.standard_normal(n_out).astype(np.float32)
    xn = x.astype(np.float64)
    if norm:
        xn = xn / np.sqrt(np.mean(xn * xn) + EPS) * g
    acc = w @ xn + (b if bias else 0.0)
    if epilogue == "glu":
        want = acc[:n_out] / (1 + np.exp(-acc[:n_out])) * acc[n_out:]
    else:
        want = acc + (r if epilogue == "residual" else 0.0)

    k = gemvs.specs[name]
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
    assert rel_err(got, want) <= 1e-5, (name, rel_err(got, want))


# -- decode attention --------------------------------------------------------------------

# name: (NH, NKV, D, window, qk norm, interleaved pairs, KV storage, compiled context, p)
ATTENTIONS = {
    "smollm2_bf16": (9, 3, 64, 0, False, False, "bfloat16", 2048, 700),
    "llama8b_bf16_loops_chunks": (32, 8, 128, 0, False, False, "bfloat16", 8192, 3000),
    "qknorm_interleaved_f32": (4, 2, 64, 0, True, True, "float32", 512, 300),
    "window_f32": (6, 3, 32, 100, False, False, "float32", 1024, 900),
    "first_token": (4, 1, 64, 0, False, False, "bfloat16", 256, 0),
    "head_dim_12_qknorm": (4, 1, 12, 0, True, False, "bfloat16", 512, 200),
}


def attention_params(case) -> AttentionParams:
    NH, NKV, D, window, norm, interleaved, *_ = case
    return AttentionParams(
        NH=NH,
        NKV=NKV,
        D=D,
        scale=float(D) ** -0.5,
        window=window,
        interleaved=interleaved,
        norm_eps=EPS if norm else 0.0,
    )


@pytest.fixture(scope="module")
def attentions():
    specs = {}

    def build(arch):
        for i, (name, case) in enumerate(ATTENTIONS.items()):
            ctx, kv = case[7], case[6]
            specs[name] = decode_attention(
                f"a{i}", attention_params(case), GpuTarget(arch), [name], ctx, kv
            )
        return [(k.fn, k.template, k.ctx, k.shared) for k in specs.values()]

    dev = DeviceKernels(build)
    dev.specs = specs
    yield dev
    dev.close()


def rope(x: np.ndarray, c: np.ndarray, s: np.ndarray, interleaved: bool) -> np.ndarray:
    h = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :h], x[..., h:])
    ra, rb = a * c - b * s, b * c + a * s
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., :h], out[..., h:] = ra, rb
    return out


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_decode_attention_matches_numpy(attentions, name):
    NH, NKV, D, window, norm, interleaved, kv, ctx, p = ATTENTIONS[name]
    rng = np.random.default_rng(100 + sorted(ATTENTIONS).index(name))
    q = rng.standard_normal((NH, D)).astype(np.float32)
    k = rng.standard_normal((NKV, D)).astype(np.float32)
    v = rng.standard_normal((NKV, D)).astype(np.float32)
    qw, kw = (1 + 0.2 * rng.standard_normal((2, D))).astype(np.float32)
    ang = rng.uniform(0, 2 * np.pi, (ctx, D // 2))
    cos_t, sin_t = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    cache = [rng.standard_normal((ctx, NKV, D)).astype(np.float32) for _ in range(2)]
    for c in cache:
        c[p:] = np.nan  # position p is this step's to write; nothing past it may be read
    store = round_bf16 if kv == "bfloat16" else (lambda a: a.astype(np.float32))
    kc, vc = (store(c) for c in cache)

    def normed(x, w):
        x = x.astype(np.float64)
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * w if norm else x

    qr = rope(normed(q, qw), cos_t[p], sin_t[p], interleaved)
    kn = store(rope(normed(k, kw), cos_t[p], sin_t[p], interleaved))
    vn = store(v)

    spec = attentions.specs[name]
    dev = attentions
    as_stored = (
        (lambda a: (a.view(np.uint32) >> 16).astype(np.uint16))
        if kv == "bfloat16"
        else (lambda a: a)
    )
    try:
        kc_d, vc_d = dev.upload(as_stored(kc)), dev.upload(as_stored(vc))
        splits = spec.grid[1]
        partial = dev.poisoned(NH * splits * (D + 2))
        counters = dev.upload(np.zeros(NH, np.uint32))
        out = dev.poisoned(NH * D)
        args = [
            dev.upload(q),
            dev.upload(k),
            dev.upload(v),
            dev.upload(np.array([p], np.int32)),
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
        row_k = dev.read(kc_d + p * NKV * D * np.dtype(stored).itemsize, (NKV, D), stored)
        row_v = dev.read(vc_d + p * NKV * D * np.dtype(stored).itemsize, (NKV, D), stored)
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
    assert rel_err(got, want) <= 1e-5, (name, rel_err(got, want))


# -- embedding ---------------------------------------------------------------------------


@pytest.mark.parametrize("wtype", ["bfloat16", "float16", "q8_0", "q4_1"])
def test_embedding_rows(wtype):
    V, K, ids = 300, 576, np.array([5, 0, 299, 5, 17], np.int64)
    rng = np.random.default_rng(7)
    raw, w = pack(0.1 * rng.standard_normal((V, K)), wtype)

    def build(arch):
        k = embedding_kernel("emb", EmbeddingParams(wtype, K), GpuTarget(arch).wave, ["embed"])
        return [(k.fn, k.template, k.ctx, 0)]

    dev = DeviceKernels(build)
    try:
        out = dev.poisoned((len(ids), K))
        args = [dev.upload(ids), dev.upload(raw), out]
        dev.launch("emb", [len(ids)], 256, [("u64", a) for a in args])
        got = dev.read(out, (len(ids), K))
    finally:
        dev.close()
    np.testing.assert_allclose(got, w[ids], rtol=1e-6, atol=1e-7)
