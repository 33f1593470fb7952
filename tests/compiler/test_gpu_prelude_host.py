"""The GPU prelude's quantized-weight code, compiled for the host (HIPC_HOST) and checked
against gguf-py on a machine with no GPU: each type's one-weight decoder (hipc_w_*: the
SIMT GEMM and the embedding) and its GEMV unit (hipc_load_unit + hipc_dot_unit: the
integer dot products against x staged as int8 hi + lo planes, or one int8 plane with
--activations int8), in both block layouts; and the GEMV prologue that stages x
(hipc_stage_xq) with a block's threads run in step as host threads (HIPC_HOST_SIMT).
tests/gpu runs the same code inside the kernels on a GPU.
"""

from __future__ import annotations

import ctypes
import subprocess

import host_simt
import numpy as np
import pytest

from hipc.compiler.codegen.environment import template_text
from hipc.compiler.kernels.linear import QUANT_TYPES
from hipc.compiler.passes.repack import split_quant_blocks

gguf = pytest.importorskip("gguf")

TYPES = (
    "q4_0", "q4_1", "q8_0", "q6_k", "q5_0", "q5_1", "q4_k", "q5_k", "iq4_nl", "iq4_xs", "q3_k",
    "q2_k",
)  # fmt: skip
# block bytes of the types gguf-py cannot quantize (random blocks), where their f16 scales
# sit and how many bytes they take
RANDOM_BLOCKS = {
    "q6_k": (210, 208, 2),
    "q3_k": (110, 108, 2),
    "q2_k": (84, 80, 4),
    "q4_k": (144, 0, 4),
    "q5_k": (176, 0, 4),
    "iq4_nl": (18, 0, 2),
    "iq4_xs": (136, 0, 2),
}

WRAPPERS = """
#define TYPE(T)                                                                               \\
  extern "C" void w_##T(const void* W, int N, int K, float* out) {                           \\
    for (int n = 0; n < N; ++n)                                                               \\
      for (int k = 0; k < K; ++k) out[(size_t)n * K + k] = hipc_w_##T(W, N, K, n, k);        \\
  }                                                                                           \\
  extern "C" void chunk_##T(const void* W, int N, int K, int bv, float* out) {                 \\
    const hipc_qmat_##T m{(const char*)W, (size_t)N * (K / bv)};                              \\
    for (int n = 0; n < N; ++n)                                                               \\
      for (int k = 0; k < K; k += 8) {                                                        \\
        uint4 q;                                                                              \\
        float s, o;                                                                           \\
        hipc_qchunk8(m, K, n, k, q, s, o);                                                    \\
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};                                           \\
        for (int i = 0; i < 8; ++i) {                                                         \\
          const float v = hipc_bf16_to_f32((uint16_t)(w[i / 2] >> (16 * (i % 2))));           \\
          out[(size_t)n * K + k + i] = s * v + o;                                             \\
        }                                                                                     \\
      }                                                                                       \\
  }                                                                                           \\
  ROW(T, int16, true)                                                                         \\
  ROW(T, int8, false)
#define ROW(T, A, LO)                                                                           \\
  extern "C" float row_##T##_##A(const void* W, int N, int K, int n, const int* xq, int uv, int bv) { \\
    const hipc_qmat_##T m{(const char*)W, (size_t)N * (K / bv)};                              \\
    const int units = K / uv;                                                                 \\
    float acc = 0.f;                                                                          \\
    for (int u = 0; u < units; ++u) {                                                         \\
      hipc_unit_##T v;                                                                        \\
      hipc_load_unit(v, m, (size_t)n * units + u);                                            \\
      acc += hipc_dot_unit<LO>(v, xq, u);                                                     \\
    }                                                                                         \\
    return acc;                                                                               \\
  }
TYPE(q4_0)
TYPE(q4_1)
TYPE(q8_0)
TYPE(q6_k)
TYPE(q5_0)
TYPE(q5_1)
TYPE(q4_k)
TYPE(q5_k)
TYPE(iq4_nl)
TYPE(iq4_xs)
TYPE(q3_k)
TYPE(q2_k)
"""


STAGE_CODE = """
template <bool LO, int R>
void stage_run(const float* x, const float* g, int K, int threads, int* xq, float* ss_out) {
  static float red[32];
  grid(1, 1, threads, [=] {
    const float ss = hipc_stage_xq<LO, R>(x, g, K, xq, red);
    if (t_id == 0) *ss_out = ss;
  });
}
#define STAGE(K, T)                                                                   \\
  extern "C" void stage_##K##_##T##_int16(const float* x, const float* g, int* xq, float* ss) { \\
    stage_run<true, (K / 4 + T - 1) / T>(x, g, K, T, xq, ss);                              \\
  }                                                                                 \\
  extern "C" void stage_##K##_##T##_int8(const float* x, const float* g, int* xq, float* ss) { \\
    stage_run<false, (K / 4 + T - 1) / T>(x, g, K, T, xq, ss);                             \\
  }
STAGE(576, 256)
STAGE(1024, 64)
STAGE(4096, 64)
STAGE(14336, 512)
"""
# (K, threads) pairs the harness instantiates: 1, 4 (one chunk), 16 and 7 rounds per thread
STAGE_SHAPES = [(576, 256), (1024, 64), (4096, 64), (14336, 512)]


@pytest.fixture(scope="module")
def simt(tmp_path_factory):
    return host_simt.build(tmp_path_factory.mktemp("simt"), "stage_host", STAGE_CODE)


@pytest.mark.parametrize("activations", ["int16", "int8"])
@pytest.mark.parametrize("K,threads", STAGE_SHAPES)
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_stage_xq_matches_numpy(simt, K, threads, activations, norm):
    """The GEMV prologue run by `threads` host threads in step: x (times g) staged exactly
    as the NumPy model (stage_x) rounds it, every block written, and sum(x^2) returned."""
    rng = np.random.default_rng(K + threads)
    x = (rng.standard_normal(K) * 3).astype(np.float32)
    x[rng.integers(0, K, 4)] *= 30
    g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    want, _ = stage_x(x * g if norm else x, activations)
    got = np.full(want.shape, -(2**31), np.int32)  # poison: every int of a block is written
    ss = np.zeros(1, np.float32)
    fn = getattr(simt, f"stage_{K}_{threads}_{activations}")
    ptr = ctypes.c_void_p
    fn(x.ctypes.data_as(ptr), g.ctypes.data_as(ptr) if norm else None,
       got.ctypes.data_as(ptr), ss.ctypes.data_as(ptr))  # fmt: skip
    meta = 8 if activations == "int8" else 16
    written = np.r_[0:meta, meta : meta + 3]  # the meta int4's last int is padding
    np.testing.assert_array_equal(got[:, written], want[:, written])
    assert ss[0] == pytest.approx(float(np.sum(x.astype(np.float64) ** 2)), rel=1e-5)


@pytest.fixture(scope="module", params=["split", "gguf"])
def lib(request, tmp_path_factory):
    if host_simt.CXX is None:
        pytest.skip("no C++ compiler")
    root = tmp_path_factory.mktemp(request.param)
    src = root / "prelude_host.cpp"
    qsplit = int(request.param == "split")
    prelude = template_text("hip/prelude.h").replace("#pragma once", "")
    src.write_text(f"#define HIPC_WAVE 32\n#define HIPC_QSPLIT {qsplit}\n{prelude}\n{WRAPPERS}")
    so = root / "prelude_host.so"
    cmd = [
        host_simt.CXX,
        "-std=c++20",
        "-O1",
        "-DHIPC_HOST",
        "-shared",
        "-fPIC",
        str(src),
        "-o",
        str(so),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    handle = ctypes.CDLL(str(so))
    handle.layout = request.param
    return handle


def blocks(wtype: str, N: int, K: int, rng) -> np.ndarray:
    """[N, row bytes] GGUF blocks: quantized by gguf-py, or random (the K-quants, IQ4_NL:
    gguf-py has no quantizer; every quant and scale byte is valid)."""
    qt = getattr(gguf.GGMLQuantizationType, wtype.upper())
    if wtype not in RANDOM_BLOCKS:
        w = rng.standard_normal((N, K)).astype(np.float32) * rng.uniform(0.01, 10, (N, 1))
        return gguf.quants.quantize(w.astype(np.float32), qt)
    size, at, n = RANDOM_BLOCKS[wtype]
    raw = rng.integers(0, 256, (N * K // QUANT_TYPES[wtype].block_values, size), dtype=np.uint8)
    # sane f16 scales (d, and dmin after it for Q4_K/Q5_K): random bytes may be inf/nan
    d = rng.uniform(1e-5, 4e-5, (len(raw), n // 2)).astype(np.float16)
    raw[:, at : at + n] = d.view(np.uint8).reshape(-1, n)
    return raw.reshape(N, -1)


def aligned(a: np.ndarray) -> tuple[np.ndarray, int]:
    """A copy of `a` at a 16-byte aligned address (the split layout's wide loads)."""
    buf = np.zeros(a.nbytes + 16, np.uint8)
    off = (-buf.ctypes.data) % 16
    view = buf[off : off + a.nbytes]
    view[:] = a.reshape(-1).view(np.uint8)
    return buf, view.ctypes.data


def stage_x(x: np.ndarray, activations: str = "int16") -> tuple[np.ndarray, np.ndarray]:
    """x as the GEMV stages it (prelude: hipc_stage_xq): per 32 values int8 hi and lo planes,
    dq, the sum of 254 hi + lo and that sum over the first 16 (int16 activations), or the hi
    plane alone, d and the sums of hi (int8). Returns (ints, x as held)."""
    xb = x.astype(np.float32).reshape(-1, 32)
    am = np.abs(xb).max(1, keepdims=True)
    d = am / np.float32(127)
    inv = np.where(am > 0, np.float32(127) / np.where(am > 0, am, 1), 0).astype(np.float32)
    hi = np.rint(xb * inv)
    lo = np.clip(np.rint((xb - hi * d) * inv * np.float32(254)), -127, 127)
    if activations == "int8":
        q, dq = hi.astype(np.int64), d.astype(np.float32)
        ints = np.zeros((len(xb), 12), np.int32)
        meta = 8
    else:
        q = (254 * hi + lo).astype(np.int64)
        dq = (d / np.float32(254)).astype(np.float32)
        ints = np.zeros((len(xb), 20), np.int32)
        ints[:, 8:16] = lo.astype(np.int8).view(np.int32)
        meta = 16
    ints[:, 0:8] = hi.astype(np.int8).view(np.int32)
    ints[:, meta] = dq[:, 0].view(np.int32)
    ints[:, meta + 1] = q.sum(1)
    ints[:, meta + 2] = q[:, :16].sum(1)
    return ints, (dq.astype(np.float64) * q).reshape(-1)


@pytest.mark.parametrize("wtype", TYPES)
def test_one_weight_decoder_matches_gguf(lib, wtype):
    N, K = 5, 512
    raw = blocks(wtype, N, K, np.random.default_rng(TYPES.index(wtype)))
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, wtype.upper()))
    stored = split_quant_blocks(raw, wtype) if lib.layout == "split" else raw
    _buf, ptr = aligned(stored)  # _buf keeps the memory alive
    out = np.full((N, K), np.nan, np.float32)
    getattr(lib, f"w_{wtype}")(ctypes.c_void_p(ptr), N, K, out.ctypes.data_as(ctypes.c_void_p))
    np.testing.assert_array_equal(out, want.astype(np.float32))


@pytest.mark.parametrize("wtype", TYPES)
def test_mma_chunks_match_gguf(lib, wtype):
    """hipc_qchunk8 (the matrix-instruction GEMM's weight tiles): integer quants exact in bf16
    and their group's scale and offset give gguf-py's dequantized weights."""
    N, K = 5, 512
    raw = blocks(wtype, N, K, np.random.default_rng(20 + TYPES.index(wtype)))
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, wtype.upper()))
    stored = split_quant_blocks(raw, wtype) if lib.layout == "split" else raw
    _buf, ptr = aligned(stored)  # _buf keeps the memory alive
    out = np.full((N, K), np.nan, np.float32)
    bv = QUANT_TYPES[wtype].block_values
    lib[f"chunk_{wtype}"](ctypes.c_void_p(ptr), N, K, bv, out.ctypes.data_as(ctypes.c_void_p))
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("activations", ["int16", "int8"])
@pytest.mark.parametrize("wtype", TYPES)
def test_gemv_unit_dot_matches_numpy(lib, wtype, activations):
    N, K = 6, 1024
    rng = np.random.default_rng(10 + TYPES.index(wtype))
    raw = blocks(wtype, N, K, rng)
    w = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, wtype.upper()))
    x = rng.standard_normal(K) * 3
    x[rng.integers(0, K, 4)] *= 30
    xq, held = stage_x(x, activations)
    stored = split_quant_blocks(raw, wtype) if lib.layout == "split" else raw
    _buf, ptr = aligned(stored)  # _buf keeps the memory alive
    qt = QUANT_TYPES[wtype]
    fn = getattr(lib, f"row_{wtype}_{activations}")
    fn.restype = ctypes.c_float
    args = (qt.unit_values, qt.block_values)
    xp = xq.ctypes.data_as(ctypes.c_void_p)
    got = np.array([fn(ctypes.c_void_p(ptr), N, K, n, xp, *args) for n in range(N)])
    want = w.astype(np.float64) @ held
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # and against x itself: x as held is within max|x| / 64516 (int16) or / 254 (int8) of
    # each value of its block (the prelude's rounding bound), so each sum is within that
    # times sum |w|
    amax = np.repeat(np.abs(x.reshape(-1, 32)).max(1), 32)
    step = amax / (64516 if activations == "int16" else 254)
    bound = np.abs(w.astype(np.float64)) @ step
    assert np.all(
        np.abs(got - w.astype(np.float64) @ x) <= bound * 1.001 + 1e-5 * np.abs(want).max()
    )
