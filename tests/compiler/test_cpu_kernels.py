"""Numerical tests of the CPU kernel header templates/cpu/hipc_cpu.h.

A small C++ shim (extern "C" wrappers around the header's functions) is compiled with
g++ for several instruction sets and loaded with ctypes:

  native       -march=native (AVX512-VNNI path on AVX-512 machines)
  scalar       -march=x86-64 (no AVX: the portable fallback, incl. f16 conversion)
  avx2         -march=haswell (vpmaddubsw path)
  avx2-vnni    -march=haswell -mavxvnni (256-bit vpdpbusd path)
  avx512-novbmi  -march=cascadelake (AVX512-VNNI without VBMI: gather-based Q4_0)

Variants the host CPU cannot run are skipped. Weights are quantized with gguf-py
(`gguf.quants.quantize`), the references use `gguf.quants.dequantize`.

Quantized weight types quantize the activations to 8 bits per 32-block inside the
kernel, so two references are used:
  * exact: x quantized in NumPy the same way (d = max|x|/127, q = rint(x * (1/d))),
    then (q*d) @ Wdeq.T in f64. This isolates kernel bugs (tolerance 1e-4; the
    rest is f32 accumulation order).
  * f32:   x @ Wdeq.T, tolerance 1e-2 (error of 8-bit activations, ~5e-3 for Gaussian
    data). A single output element fluctuates too much for a per-case norm ratio, so
    this check is applied per case when the case has >= 64 outputs, and over all
    cases of a weight type combined.
Dense weights (f32/f16/bf16) keep x in f32: tolerance 1e-5 against x @ Wdeq.T.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hipc.base.cpu_features import cpu_features

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

HEADER_DIR = Path(__file__).resolve().parents[2] / "templates" / "cpu"
CXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="g++ not found")

WTYPES = ["q4_0", "q4_1", "q8_0", "f32", "f16", "bf16"]
QUANTIZED = {"q4_0", "q4_1", "q8_0"}
GGML_TYPE = {
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "bf16": gguf.GGMLQuantizationType.BF16,
}

# Q5_0, Q5_1 and the K-quants: tested on random blocks below (test_kquant_*)
KTYPES = ["q5_0", "q5_1", "iq4_nl", "iq4_xs", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
# the types the compiler may store in row lanes (test_lanes_*): linear_lanes.h's, linear_lanes_k.h's
LTYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q3_k", "q4_k", "q5_k", "q6_k"]

# name -> (extra g++ flags, /proc/cpuinfo flags the host needs to run it)
VARIANTS = {
    "native": (["-march=native"], set()),
    "scalar": (["-march=x86-64"], set()),
    "avx2": (["-march=haswell"], {"avx2", "fma", "f16c", "bmi2", "movbe"}),
    "avx2-vnni": (["-march=haswell", "-mavxvnni"], {"avx2", "fma", "f16c", "bmi2", "avx_vnni"}),
    "avx512-novbmi": (
        ["-march=cascadelake"],
        {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512dq", "avx512cd"},
    ),
}
EXPECTED_ISA = {
    "scalar": "scalar",
    "avx2": "avx2",
    "avx2-vnni": "avx2-vnni",
    "avx512-novbmi": "avx512-vnni",
}

SHIM = r"""
#include "hipc_cpu.h"
// G query heads (rows of q and out, D apart) against one KV head: attend_heads<D>(G) at a
// time through AttendG, the positions lo..hi fed in ranges of `chunk`
template <int D, int G>
void attend_group(const float* q, const float* K, const float* V, long long stride, int lo, int hi, float scale,
                  float softcap, int chunk, float* out) {
  constexpr int GT = hipc::attend_heads<D>(G);
  for (int h0 = 0; h0 < G; h0 += GT) {
    const float* qp[GT];
    float* op[GT];
    for (int g = 0; g < GT; ++g) qp[g] = q + (h0 + g) * D, op[g] = out + (h0 + g) * D;
    hipc::AttendG<D, GT> a(qp, scale, softcap);
    for (int c = lo; c <= hi; c += chunk) {
      const int n = hi + 1 - c < chunk ? hi + 1 - c : chunk;
      a.range(K + (size_t)c * stride, V + (size_t)c * stride, (size_t)stride, n);
    }
    a.finish(op);
  }
}
// the same in `parts` consecutive parts of lo..hi, each's partial states merged after (the
// generated attention's long rows at several threads)
template <int D, int G>
void attend_parts(const float* q, const float* K, const float* V, long long stride, int lo, int hi, float scale,
                  float softcap, int parts, float* out) {
  constexpr int GT = hipc::attend_heads<D>(G);
  std::vector<float> state((size_t)G * parts * (D + 2));
  const int len = hi - lo + 1;
  for (int s = 0; s < parts; ++s) {
    const int a = lo + (int)((long long)len * s / parts), e = lo + (int)((long long)len * (s + 1) / parts) - 1;
    for (int h0 = 0; h0 < G; h0 += GT) {
      const float* qp[GT];
      float* dst[GT];
      for (int g = 0; g < GT; ++g) qp[g] = q + (h0 + g) * D, dst[g] = state.data() + ((size_t)(h0 + g) * parts + s) * (D + 2);
      hipc::AttendG<D, GT> at(qp, scale, softcap);
      for (int c = a; c <= e; c += 16) at.range(K + (size_t)c * stride, V + (size_t)c * stride, (size_t)stride, e + 1 - c < 16 ? e + 1 - c : 16);
      at.partial(dst);
    }
  }
  for (int g = 0; g < G; ++g) hipc::merge_parts<D>(state.data() + (size_t)g * parts * (D + 2), parts, out + g * D);
}
extern "C" {
#define HIPC_ATTEND_GROUP(D, G)                                                                               \
  void t_attend_group_##D##x##G(const float* q, const float* K, const float* V, long long stride, int lo, int hi, \
                                float scale, float softcap, int chunk, float* out) {                          \
    attend_group<D, G>(q, K, V, stride, lo, hi, scale, softcap, chunk, out);                                  \
  }                                                                                                           \
  int t_attend_heads_##D##x##G() { return hipc::attend_heads<D>(G); }                                    \
  void t_attend_parts_##D##x##G(const float* q, const float* K, const float* V, long long stride, int lo, int hi, \
                                float scale, float softcap, int parts, float* out) {                          \
    attend_parts<D, G>(q, K, V, stride, lo, hi, scale, softcap, parts, out);                                  \
  }
HIPC_ATTEND_GROUP(64, 3) HIPC_ATTEND_GROUP(128, 4) HIPC_ATTEND_GROUP(64, 1) HIPC_ATTEND_GROUP(256, 2)
#define HIPC_WRAP(w)                                                                          \
  void t_matmul_##w(const float* x, int T, int K, const void* W, int N, float* y, int ldy) { \
    hipc::matmul_##w(x, T, K, W, N, y, ldy);                                                  \
  }                                                                                           \
  void t_embed_row_##w(const void* W, int K, long long row, float* out) {                    \
    hipc::embed_row_##w(W, K, (int64_t)row, out);                                             \
  }
HIPC_WRAP(q4_0) HIPC_WRAP(q4_1) HIPC_WRAP(q8_0) HIPC_WRAP(f32) HIPC_WRAP(f16) HIPC_WRAP(bf16)
// int16 activations: the default kernels and matmul_deq (the vpmaddwd kernel they replace
// on AVX512-VNNI, still the fallback elsewhere)
#define HIPC_WRAP16(w)                                                                          \
  void t_matmul_a16_##w(const float* x, int T, int K, const void* W, int N, float* y, int ldy) { \
    hipc::matmul_a16_##w(x, T, K, W, N, y, ldy);                                                \
  }                                                                                             \
  void t_matmul_deq_##w(const float* x, int T, int K, const void* W, int N, float* y, int ldy) { \
    hipc::matmul_deq<hipc::block_##w>(x, T, K, W, N, y, ldy);                                  \
  }
HIPC_WRAP16(q4_0) HIPC_WRAP16(q4_1) HIPC_WRAP16(q8_0)
// Q5_0, Q5_1 and the K-quants (linear_kquant.h): int8 and int16 activations, embedding
#define HIPC_WRAPK(w)                                                                           \
  HIPC_WRAP(w)                                                                                  \
  void t_matmul_a16_##w(const float* x, int T, int K, const void* W, int N, float* y, int ldy) { \
    hipc::matmul_a16_##w(x, T, K, W, N, y, ldy);                                                \
  }
HIPC_WRAPK(q5_0) HIPC_WRAPK(q5_1) HIPC_WRAPK(iq4_nl) HIPC_WRAPK(iq4_xs) HIPC_WRAPK(q2_k) HIPC_WRAPK(q3_k)
HIPC_WRAPK(q4_k)
HIPC_WRAPK(q5_k) HIPC_WRAPK(q6_k)
// the row-lanes layout: every type on AVX512 (linear_lanes.h, linear_lanes_k.h) and on AVX2
// (linear_lanes_avx2.h); 2, 1 and 0 say which
#define HIPC_WRAPL(w) HIPC_WRAPK(lanes_##w)
#if defined(HIPC_ISA_AVX512) || defined(HIPC_ISA_AVX2)
HIPC_WRAPL(q4_0) HIPC_WRAPL(q4_1) HIPC_WRAPL(q5_0) HIPC_WRAPL(q5_1) HIPC_WRAPL(q8_0)
HIPC_WRAPL(q3_k) HIPC_WRAPL(q4_k) HIPC_WRAPL(q5_k) HIPC_WRAPL(q6_k)
#endif
int t_lane_fifth_bytes() { return hipc::detail::kLaneFifthBytes; }
#if defined(HIPC_ISA_AVX512)
int t_has_lanes() { return 2; }
#elif defined(HIPC_ISA_AVX2)
int t_has_lanes() { return 1; }
#else
int t_has_lanes() { return 0; }
#endif
// positions lo..hi fed in ranges of `chunk` (a paged KV cache's blocks)
void t_attend_row64(const float* q, const float* K, const float* V, long long stride, int lo, int hi, float scale,
                    float softcap, int chunk, float* out) {
  hipc::Attend<64> a(q, scale, softcap);
  for (int c = lo; c <= hi; c += chunk) {
    const int n = hi + 1 - c < chunk ? hi + 1 - c : chunk;
    a.range(K + (size_t)c * stride, V + (size_t)c * stride, (size_t)stride, n);
  }
  a.finish(out);
}
const char* t_isa() { return hipc::cpu_isa(); }
void t_silu_mul_row(const float* g, const float* u, float* y, int n) { hipc::silu_mul_row(g, u, y, n); }
void t_quantize_row_q8a(const float* x, int K, void* out) {
  hipc::quantize_row_q8a(x, K, (hipc::block_q8a*)out);
}
void t_f32_to_f16(const float* x, unsigned short* y, int n) { for (int i = 0; i < n; ++i) y[i] = hipc::fp32_to_fp16(x[i]); }
void t_f16_to_f32(const unsigned short* x, float* y, int n) { for (int i = 0; i < n; ++i) y[i] = hipc::fp16_to_fp32(x[i]); }
void t_f32_to_bf16(const float* x, unsigned short* y, int n) { for (int i = 0; i < n; ++i) y[i] = hipc::fp32_to_bf16(x[i]); }
void t_bf16_to_f32(const unsigned short* x, float* y, int n) { for (int i = 0; i < n; ++i) y[i] = hipc::bf16_to_fp32(x[i]); }
int t_set_threads(int n) {
#ifdef _OPENMP
  const int old = omp_get_max_threads();
  omp_set_num_threads(n);
  return old;
#else
  (void)n;
  return 1;
#endif
}
}
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, ctypes.CDLL | str]:
    """Compile every runnable variant in parallel; name -> CDLL (or a skip reason)."""
    d = tmp_path_factory.mktemp("hipc_cpu_shim")
    src = d / "shim.cpp"
    src.write_text(SHIM)
    flags = cpu_features()
    procs = {}
    out: dict[str, ctypes.CDLL | str] = {}
    for name, (march, need) in VARIANTS.items():
        if need - flags:
            out[name] = f"host CPU lacks {sorted(need - flags)}"
            continue
        so = d / f"shim_{name}.so"
        cmd = [
            CXX,
            "-std=c++17",
            "-O2",
            *march,
            "-fopenmp",
            "-shared",
            "-fPIC",
            "-Wall",
            "-Wextra",
            "-Werror",
            # scratch starts as garbage on every call: a read of scratch the call did not
            # write fails here rather than in whatever ran before it
            "-DHIPC_POISON_SCRATCH",
        ]
        cmd += [f"-I{HEADER_DIR}", str(src), "-o", str(so)]
        procs[name] = (
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
            so,
        )
    for name, (proc, so) in procs.items():
        log, _ = proc.communicate()
        assert proc.returncode == 0, f"{name}: compile failed\n{log}"
        out[name] = _load(so)
    return out


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    P, Int = ctypes.c_void_p, ctypes.c_int
    for w in WTYPES:
        getattr(lib, f"t_matmul_{w}").argtypes = [P, Int, Int, P, Int, P, Int]
        getattr(lib, f"t_matmul_{w}").restype = None
        getattr(lib, f"t_embed_row_{w}").argtypes = [P, Int, ctypes.c_longlong, P]
        getattr(lib, f"t_embed_row_{w}").restype = None
    for w in sorted(QUANTIZED):
        for kind in ("a16", "deq"):
            getattr(lib, f"t_matmul_{kind}_{w}").argtypes = [P, Int, Int, P, Int, P, Int]
            getattr(lib, f"t_matmul_{kind}_{w}").restype = None
    for w in KTYPES:
        for kind in ("", "a16_"):
            getattr(lib, f"t_matmul_{kind}{w}").argtypes = [P, Int, Int, P, Int, P, Int]
            getattr(lib, f"t_matmul_{kind}{w}").restype = None
        getattr(lib, f"t_embed_row_{w}").argtypes = [P, Int, ctypes.c_longlong, P]
        getattr(lib, f"t_embed_row_{w}").restype = None
    lib.t_has_lanes.restype = Int
    lib.t_lane_fifth_bytes.restype = Int
    if lib.t_has_lanes():
        for w in LTYPES:
            for kind in ("", "a16_"):
                getattr(lib, f"t_matmul_{kind}lanes_{w}").argtypes = [P, Int, Int, P, Int, P, Int]
            getattr(lib, f"t_embed_row_lanes_{w}").argtypes = [P, Int, ctypes.c_longlong, P]
    F = ctypes.c_float
    attend = [P, P, P, ctypes.c_longlong, Int, Int, F, F, Int, P]
    lib.t_attend_row64.argtypes = attend
    lib.t_attend_row64.restype = None
    for dg in ATTEND_GROUPS:
        getattr(lib, f"t_attend_group_{dg[0]}x{dg[1]}").argtypes = attend
        getattr(lib, f"t_attend_heads_{dg[0]}x{dg[1]}").restype = Int
        getattr(lib, f"t_attend_parts_{dg[0]}x{dg[1]}").argtypes = attend
    lib.t_isa.restype = ctypes.c_char_p
    lib.t_silu_mul_row.argtypes = [P, P, P, Int]
    lib.t_quantize_row_q8a.argtypes = [P, Int, P]
    for f in ("t_f32_to_f16", "t_f16_to_f32", "t_f32_to_bf16", "t_bf16_to_f32"):
        getattr(lib, f).argtypes = [P, P, Int]
    lib.t_set_threads.argtypes = [Int]
    lib.t_set_threads.restype = Int
    return lib


def _get(libs, variant: str) -> ctypes.CDLL:
    lib = libs[variant]
    if isinstance(lib, str):
        pytest.skip(lib)
    return lib


@functools.cache
def _weights(wtype: str, N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """(bytes/array in the kernel's layout, dequantized f64 [N, K])."""
    rng = np.random.default_rng(1000 * N + K + WTYPES.index(wtype))
    w = rng.standard_normal((N, K), dtype=np.float32)
    if wtype == "f32":
        return w, w.astype(np.float64)
    if wtype == "f16":
        h = w.astype(np.float16)
        return h, h.astype(np.float64)
    q = np.ascontiguousarray(quants.quantize(w, GGML_TYPE[wtype]))
    deq = quants.dequantize(q, GGML_TYPE[wtype]).reshape(N, K)
    return q, deq.astype(np.float64)


def _quantize_act_ref(x: np.ndarray) -> np.ndarray:
    """What the kernel does to x: per 32-block d = max|x|/127, q = rint(x * (1/d))."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32)
    d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(T, K)


def _rel(a: np.ndarray, b: np.ndarray, scale: float = 0.0) -> float:
    """||a - b|| / max(||b||, scale)."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), scale))


def _typical_norm(x: np.ndarray, w: np.ndarray) -> float:
    """Norm y would have if the K products of every output added with random signs:
    sqrt(sum_{t,n,k} x[t,k]^2 w[n,k]^2). Half of it floors the denominators, so an output
    that cancels to ~0 by chance does not turn f32 rounding into a huge relative error."""
    return 0.5 * float(np.sqrt(np.sum((x.astype(np.float64) ** 2) @ (w**2).T)))


def _run_matmul(lib, wtype, x, wq, N, ldy):
    T, K = x.shape
    y = np.full((T, ldy), np.nan, np.float32)
    getattr(lib, f"t_matmul_{wtype}")(x.ctypes.data, T, K, wq.ctypes.data, N, y.ctypes.data, ldy)
    assert np.isnan(y[:, N:]).all(), "kernel wrote past column N"
    return y[:, :N]


FULL_SHAPES = [(T, K, N) for T in (1, 3, 17, 64) for K in (64, 576, 1536) for N in (1, 7, 192, 576)]
# odd K tails (K/32 % 16 = 1, 3, 4, 5, 9, 12) and small row counts, on the native build
TAIL_SHAPES = [
    (T, K, N) for T in (1, 2, 5) for K in (32, 96, 128, 160, 288, 544, 896) for N in (3, 5, 9)
]
# the other ISA builds run a lighter set (the scalar one is slow at large shapes)
LIGHT_SHAPES = [(T, K, N) for T in (1, 3, 17) for K in (64, 576, 800) for N in (1, 7, 66)]


def _check_matmul(lib, wtype: str, shapes) -> None:
    rng = np.random.default_rng(7)
    tot_err, tot_ref = 0.0, 0.0
    for i, (T, K, N) in enumerate(shapes):
        wq, wd = _weights(wtype, N, K)
        x = rng.standard_normal((T, K), dtype=np.float32)
        ldy = N + 5 if (T == 3 or i % 5 == 0) else N
        y = _run_matmul(lib, wtype, x, wq, N, ldy).astype(np.float64)
        assert np.isfinite(y).all(), f"{wtype} T={T} K={K} N={N}: non-finite output"
        ref = x.astype(np.float64) @ wd.T
        floor = _typical_norm(x, wd)
        where = f"{wtype} T={T} K={K} N={N}"
        if wtype in QUANTIZED:
            exact = _quantize_act_ref(x) @ wd.T
            err = _rel(y, exact, floor)
            assert err <= 1e-4, f"{where}: vs exact-emulation ref {err:.3g}"
            if T * N >= 64:
                err = _rel(y, ref)
                assert err <= 1e-2, f"{where}: vs f32 ref {err:.3g}"
            tot_err += float(np.sum((y - ref) ** 2))
            tot_ref += float(np.sum(ref**2))
        else:
            err = _rel(y, ref, floor)
            assert err <= 1e-5, f"{where}: vs f32 ref {err:.3g}"
    if wtype in QUANTIZED:
        assert np.sqrt(tot_err / tot_ref) <= 1e-2


@pytest.mark.parametrize("wtype", WTYPES)
def test_matmul_native(libs, wtype):
    _check_matmul(_get(libs, "native"), wtype, FULL_SHAPES + TAIL_SHAPES)


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", ["scalar", "avx2", "avx2-vnni", "avx512-novbmi"])
def test_matmul_other_isas(libs, variant, wtype):
    lib = _get(libs, variant)
    assert lib.t_isa().decode().startswith(EXPECTED_ISA[variant])
    _check_matmul(lib, wtype, LIGHT_SHAPES)


@pytest.mark.parametrize("variant", ["native", "scalar"])
def test_matmul_large_T_scalar_and_native(libs, variant):
    """Prefill-sized T on both the vector path and the portable fallback."""
    lib = _get(libs, variant)
    for wtype in ("q4_1", "q8_0", "bf16"):
        _check_matmul(lib, wtype, [(64, 1536, 576), (130, 576, 37)])


@pytest.mark.parametrize("variant", ["native", "scalar"])
@pytest.mark.parametrize("wtype", WTYPES)
def test_embed_row(libs, variant, wtype):
    lib = _get(libs, variant)
    N, K = 33, 576
    wq, wd = _weights(wtype, N, K)
    for row in (0, 17, N - 1):
        out = np.full(K, np.nan, np.float32)
        getattr(lib, f"t_embed_row_{wtype}")(wq.ctypes.data, K, row, out.ctypes.data)
        np.testing.assert_allclose(out, wd[row], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("variant", ["native", "scalar"])
def test_quantize_row_q8a(libs, variant):
    lib = _get(libs, variant)
    rng = np.random.default_rng(3)
    K = 256
    x = rng.standard_normal(K, dtype=np.float32) * 3
    x[32:64] = 0.0  # an all-zero block: d = 0, q = 0
    dt = np.dtype([("d", "<f4"), ("s", "<f4"), ("qs", "i1", 32)])
    out = np.zeros(K // 32, dt)
    lib.t_quantize_row_q8a(x.ctypes.data, K, out.ctypes.data)
    xb = x.reshape(-1, 32)
    d = np.abs(xb).max(axis=1) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[:, None]).astype(np.int8)
    np.testing.assert_array_equal(out["d"], d)
    np.testing.assert_array_equal(out["qs"], q)
    np.testing.assert_allclose(out["s"], d * q.sum(axis=1, dtype=np.int32), rtol=1e-6)
    np.testing.assert_allclose(out["qs"] * out["d"][:, None], xb, atol=float(d.max()) / 2 + 1e-7)


@pytest.mark.parametrize("variant", ["native", "scalar"])
def test_half_conversions(libs, variant):
    lib = _get(libs, variant)
    rng = np.random.default_rng(5)
    special = np.array(
        [
            0.0,
            -0.0,
            1.0,
            -2.5,
            65504.0,
            65520.0,
            1e6,
            -1e6,
            6.1e-5,
            5.96e-8,
            2.98e-8,
            1e-9,
            np.inf,
            -np.inf,
        ],
        np.float32,
    )
    x = np.concatenate(
        [special, rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-8, 5, 4000)]
    )
    x = x.astype(np.float32)
    n = x.size
    h = np.empty(n, np.uint16)
    lib.t_f32_to_f16(x.ctypes.data, h.ctypes.data, n)
    with np.errstate(over="ignore"):
        ref_h = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(h, ref_h)
    all_h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    back = np.empty(65536, np.float32)
    lib.t_f16_to_f32(all_h.ctypes.data, back.ctypes.data, 65536)
    ref = all_h.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(back), np.isnan(ref))
    ok = ~np.isnan(ref)
    np.testing.assert_array_equal(back[ok].view(np.uint32), ref[ok].view(np.uint32))
    # NaN stays NaN in f32 -> f16
    nan_in = np.array([np.nan], np.float32)
    lib.t_f32_to_f16(nan_in.ctypes.data, h.ctypes.data, 1)
    assert np.isnan(h[:1].view(np.float16)[0])

    b = np.empty(n, np.uint16)
    lib.t_f32_to_bf16(x.ctypes.data, b.ctypes.data, n)
    ref_b = (
        quants.quantize(x.reshape(1, -1), gguf.GGMLQuantizationType.BF16)
        .view(np.uint16)
        .reshape(-1)
    )
    np.testing.assert_array_equal(b, ref_b)
    fb = np.empty(n, np.float32)
    lib.t_bf16_to_f32(b.ctypes.data, fb.ctypes.data, n)
    np.testing.assert_array_equal(fb.view(np.uint32), b.astype(np.uint32) << 16)


@pytest.mark.parametrize("wtype", ["q4_1", "q8_0", "f16"])
def test_threads_do_not_change_results(libs, wtype):
    """Bit-identical output with 1, 2 and 3 OpenMP threads (rows are split, never sums)."""
    lib = _get(libs, "native")
    rng = np.random.default_rng(11)
    wq, _ = _weights(wtype, 576, 576)
    old = lib.t_set_threads(1)
    try:
        for T in (1, 5):
            x = rng.standard_normal((T, 576), dtype=np.float32)
            lib.t_set_threads(1)
            y1 = _run_matmul(lib, wtype, x, wq, 576, 576)
            for n in (2, 3):
                lib.t_set_threads(n)
                np.testing.assert_array_equal(_run_matmul(lib, wtype, x, wq, 576, 576), y1)
    finally:
        lib.t_set_threads(old)


# (lo, hi, scale, softcap, chunk): context lengths around the block size, a window start,
# wide score ranges (weights underflowing to 0), soft-capping, ranges whose max moves. The
# kernels sum in float32 over up to 201 weighted rows (2.3e-6 relative the worst seen)
ATTEND_TOL = 4e-6
ATTEND_CASES = [
    (0, 0, 0.125, 0.0, 1000),
    (0, 14, 0.125, 0.0, 1000),
    (0, 15, 0.125, 0.0, 1000),
    (0, 16, 0.125, 0.0, 1000),
    (5, 100, 0.125, 0.0, 1000),
    (5, 100, 0.125, 0.0, 7),
    (0, 200, 2.0, 0.0, 1000),
    (0, 200, 2.0, 0.0, 32),
    (0, 40, 40.0, 0.0, 1000),
    (3, 57, 0.5, 30.0, 1000),
]


def _attend_ref(K: np.ndarray, V: np.ndarray, q: np.ndarray, scale: float, cap: float):
    """softmax(scale * K q, soft-capped) V in float64."""
    s = (K.astype(np.float64) @ q) * scale
    if cap:
        s = cap * np.tanh(s / cap)
    w = np.exp(s - s.max())
    return (w / w.sum()) @ V.astype(np.float64)


@pytest.mark.parametrize("variant", ["native", "avx2", "scalar"])
def test_attend_row(libs, variant):
    """One query row's attention (blocks of 16 positions, a vector exp on AVX512) against
    NumPy's softmax in f64 over ATTEND_CASES, the positions fed in ranges (a paged cache's
    blocks)."""
    lib = _get(libs, variant)
    rng = np.random.default_rng(41)
    D, NKV = 64, 3
    for lo, hi, scale, cap, chunk in ATTEND_CASES:
        kv = rng.standard_normal((2, hi + 1, NKV, D), dtype=np.float32)
        q = rng.standard_normal(D, dtype=np.float32)
        out = np.full(D, np.nan, np.float32)
        h = 1  # the middle KV head: rows interleave with the other heads
        K, V = kv[0].ctypes.data + 4 * h * D, kv[1].ctypes.data + 4 * h * D
        lib.t_attend_row64(q.ctypes.data, K, V, NKV * D, lo, hi, scale, cap, chunk, out.ctypes.data)
        ref = _attend_ref(kv[0, lo : hi + 1, h], kv[1, lo : hi + 1, h], q, scale, cap)
        err = _rel(out.astype(np.float64), ref)
        assert err <= ATTEND_TOL, (
            f"lo={lo} hi={hi} scale={scale} cap={cap} chunk={chunk}: {err:.3g}"
        )


# (D, G) of the shim's AttendG wrappers, and the heads a pass takes on AVX512
ATTEND_GROUPS = {(64, 3): 3, (128, 4): 2, (64, 1): 1, (256, 2): 1}


@pytest.mark.parametrize("variant", ["native", "avx2", "scalar"])
def test_attend_group(libs, variant):
    """Grouped-query heads sharing a KV head, GT at a time (AttendG: the scores of 16
    positions as one vector, each value row read once for GT heads) against NumPy's softmax
    in f64 over ATTEND_CASES, every head; D 64, 128 and 256."""
    lib = _get(libs, variant)
    rng = np.random.default_rng(43)
    for (D, G), gt in ATTEND_GROUPS.items():
        heads = getattr(lib, f"t_attend_heads_{D}x{G}")()
        assert heads == (gt if lib.t_isa().decode().startswith("avx512") else 1)
        NKV = 2
        for lo, hi, scale, cap, chunk in ATTEND_CASES:
            kv = rng.standard_normal((2, hi + 1, NKV, D), dtype=np.float32)
            q = rng.standard_normal((G, D), dtype=np.float32)
            out = np.full((G, D), np.nan, np.float32)
            h = 1  # the second KV head: rows interleave with the other's
            K, V = kv[0].ctypes.data + 4 * h * D, kv[1].ctypes.data + 4 * h * D
            attend = getattr(lib, f"t_attend_group_{D}x{G}")
            attend(q.ctypes.data, K, V, NKV * D, lo, hi, scale, cap, chunk, out.ctypes.data)
            for g in range(G):
                ref = _attend_ref(kv[0, lo : hi + 1, h], kv[1, lo : hi + 1, h], q[g], scale, cap)
                err = _rel(out[g].astype(np.float64), ref)
                assert err <= ATTEND_TOL, (
                    f"D={D} G={G} head {g} lo={lo} hi={hi} chunk={chunk}: {err:.3g}"
                )


@pytest.mark.parametrize("variant", ["native", "avx2", "scalar"])
def test_attend_in_parts(libs, variant):
    """A row's positions in 2-8 consecutive parts, each part's partial states (running max,
    weight sum, weighted values: Attend/AttendG.partial) merged after (merge_parts), as the
    generated attention does for long rows at several threads: NumPy's softmax in f64 over
    every head, parts as short as one position."""
    lib = _get(libs, variant)
    rng = np.random.default_rng(47)
    for (D, G), _ in ATTEND_GROUPS.items():
        NKV = 2
        for lo, hi, scale, cap, parts in (
            (0, 1, 0.125, 0.0, 2),
            (0, 7, 0.125, 0.0, 8),
            (5, 300, 0.125, 0.0, 3),
            (0, 1023, 0.5, 0.0, 8),
            (17, 200, 2.0, 30.0, 5),
        ):
            kv = rng.standard_normal((2, hi + 1, NKV, D), dtype=np.float32)
            q = rng.standard_normal((G, D), dtype=np.float32)
            out = np.full((G, D), np.nan, np.float32)
            K, V = kv[0].ctypes.data + 4 * D, kv[1].ctypes.data + 4 * D  # KV head 1
            attend = getattr(lib, f"t_attend_parts_{D}x{G}")
            attend(q.ctypes.data, K, V, NKV * D, lo, hi, scale, cap, parts, out.ctypes.data)
            for g in range(G):
                ref = _attend_ref(kv[0, lo : hi + 1, 1], kv[1, lo : hi + 1, 1], q[g], scale, cap)
                err = _rel(out[g].astype(np.float64), ref)
                assert err <= ATTEND_TOL, f"D={D} G={G} head {g} {lo}..{hi} in {parts}: {err:.3g}"


TWO_VERSIONS_SHIM = r"""
#include "hipc_cpu.h"
extern "C" void t_matmul_q4_0(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  hipc::matmul_q4_0(x, T, K, W, N, y, ldy);
}
"""


def test_two_header_versions_in_one_process(tmp_path):
    """Two programs built from different versions of the header, loaded in one process
    (as a server holding two artifacts does), each compute with their own tables. The
    other version here is the header with PrepTables' layout changed. Before the header
    hid its symbols, GCC made kPrep STB_GNU_UNIQUE and the second library loaded read the
    first one's tables: Q4_0 T=1 K=64 N=1 came out at 2.27 relative error."""
    other = tmp_path / "other"
    shutil.copytree(HEADER_DIR, other)
    vnni = other / "linear_vnni.h"
    text = vnni.read_text()
    assert "struct PrepTables {\n" in text
    vnni.write_text(
        text.replace("struct PrepTables {\n", "struct PrepTables {\n  int32_t skew[29];\n")
    )
    src = tmp_path / "shim.cpp"
    src.write_text(TWO_VERSIONS_SHIM)
    libs = []
    for name, inc in (("other", other), ("this", HEADER_DIR)):
        so = tmp_path / f"{name}.so"
        cmd = [CXX, "-std=c++17", "-O1", "-march=native", "-fopenmp", "-shared", "-fPIC"]
        subprocess.run([*cmd, f"-I{inc}", str(src), "-o", str(so)], check=True)
        lib = ctypes.CDLL(str(so))
        P, Int = ctypes.c_void_p, ctypes.c_int
        lib.t_matmul_q4_0.argtypes = [P, Int, Int, P, Int, P, Int]
        libs.append((name, lib))
    rng = np.random.default_rng(29)
    for T, K, N in ((1, 64, 1), (1, 576, 9), (5, 160, 7)):
        wq, wd = _weights("q4_0", N, K)
        x = rng.standard_normal((T, K), dtype=np.float32)
        exact = _quantize_act_ref(x) @ wd.T
        for name, lib in libs:
            y = _run_matmul(lib, "q4_0", x, wq, N, N).astype(np.float64)
            err = _rel(y, exact, _typical_norm(x, wd))
            assert err <= 1e-4, f"{name} header, T={T} K={K} N={N}: {err:.3g}"


# ---- int16 activations (matmul_a16_*) ------------------------------------------------
#
# The int16 path must give the integer block sums sum_e w[e] * q[e] exactly (q: x rounded
# to int16 per 32-block), whatever instructions compute them; only the f32 scaling and
# summation may round. matmul_deq (vpmaddwd) and the byte-plane VNNI kernels are both
# checked against NumPy.

BLOCK_DTYPE = {
    "q4_0": np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    "q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    "q8_0": np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
}
# K = 32 * nb: nb below, at and past a 16-block group, tails of 1..9 blocks (4-row tail,
# natural windows, partial transposed groups); T = 1 is the GEMV, T > 1 the prefill GEMM
# with token tails.
A16_SHAPES = [
    (T, 32 * nb, N) for T in (1, 2, 5, 17) for nb in (1, 3, 9, 16, 20, 25, 37) for N in (5, 66)
]


def _block_ints(wtype: str, blocks: np.ndarray):
    """GGUF blocks [N, nb] -> integer weights [N, nb, 32], d, m with value = d * int + m."""
    d = blocks["d"].astype(np.float64)
    if wtype == "q8_0":
        return blocks["qs"].astype(np.int64), d, np.zeros_like(d)
    qs = blocks["qs"].astype(np.int64)
    nib = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if wtype == "q4_0":
        return nib - 8, d, np.zeros_like(d)
    return nib, d, blocks["m"].astype(np.float64)


def _act16_ref(x: np.ndarray):
    """quantize_act16: q = rint(x * (32767 / max|x|)) in f32 per 32-block, scale max|x|/32767,
    plus the block sums of x."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32)
    amax = np.abs(xb).max(axis=-1)
    inv = (np.float32(32767) / np.where(amax > 0, amax, np.float32(1))).astype(np.float32)
    inv = np.where(amax > 0, inv, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    return q, (amax / np.float32(32767)).astype(np.float64), xb.astype(np.float64).sum(-1)


def _a16_ref(wtype: str, x: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y in f64 from the exact integer block sums, the block sums I[t, n, b])."""
    q, sx, xsum = _act16_ref(x)
    w, d, m = _block_ints(wtype, blocks)
    dots = np.einsum("tbe,nbe->tnb", q, w)
    return np.einsum("tnb,nb,tb->tn", dots, d, sx) + xsum @ m.T, dots


def _blocks(wtype: str, wq: np.ndarray, N: int, K: int) -> np.ndarray:
    return np.frombuffer(wq.tobytes(), BLOCK_DTYPE[wtype]).reshape(N, K // 32)


@pytest.mark.parametrize("variant", ["native", "avx512-novbmi", "scalar"])
@pytest.mark.parametrize("wtype", sorted(QUANTIZED))
def test_matmul_a16(libs, variant, wtype):
    """Gaussian data: both int16 kernels within f32 rounding of the int16 math."""
    lib = _get(libs, variant)
    rng = np.random.default_rng(17)
    for T, K, N in A16_SHAPES:
        wq, wd = _weights(wtype, N, K)
        x = rng.standard_normal((T, K), dtype=np.float32) * np.float32(3)
        x[0, 32:64] = 0.0  # an all-zero block (scale 0) where there is a second one
        ref, _ = _a16_ref(wtype, x, _blocks(wtype, wq, N, K))
        floor = _typical_norm(x, wd)
        for kind in ("a16", "deq"):
            y = _run_matmul(lib, f"{kind}_{wtype}", x, wq, N, N + 3).astype(np.float64)
            err = _rel(y, ref, floor)
            assert err <= 2e-6, f"{kind} {wtype} T={T} K={K} N={N}: {err:.3g}"


SMALL_BATCH_SHAPES = [(T, K, N) for T in range(2, 8) for K in (64, 576, 800, 1536) for N in (5, 66)]


@pytest.mark.parametrize("variant", ["native", "avx512-novbmi", "scalar"])
@pytest.mark.parametrize("wtype", sorted(QUANTIZED))
def test_matmul_small_batch(libs, variant, wtype):
    """T = 2..7, a batch's decode step (AVX512: the GEMV layouts over all T tokens), with
    int8 and int16 activations, against NumPy: every row of the batch as its own math."""
    lib = _get(libs, variant)
    _check_matmul(lib, wtype, SMALL_BATCH_SHAPES)
    rng = np.random.default_rng(19)
    for T, K, N in SMALL_BATCH_SHAPES:
        wq, wd = _weights(wtype, N, K)
        x = rng.standard_normal((T, K), dtype=np.float32) * np.float32(3)
        x[T - 1, :32] = 0.0  # an all-zero block in the last token only
        ref, _ = _a16_ref(wtype, x, _blocks(wtype, wq, N, K))
        y = _run_matmul(lib, f"a16_{wtype}", x, wq, N, N + 3).astype(np.float64)
        err = _rel(y, ref, _typical_norm(x, wd))
        assert err <= 2e-6, f"a16 {wtype} T={T} K={K} N={N}: {err:.3g}"


def _exact_case(
    wtype: str, T: int, nb: int, N: int, rng
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, weight blocks, expected y) where every output is one integer block sum, exact
    in f32: row n has d = 1 in block n % nb and d = 0 elsewhere (m = 0), and every x block
    holds +-32767, so its scale is 1 and q = x. Extremes of both operands are included:
    hi/lo byte edges of q, nibbles 0 and 15, Q8_0 weights -128 and 127."""
    blocks = np.zeros((N, nb), BLOCK_DTYPE[wtype])
    if wtype == "q8_0":
        qs = rng.integers(-128, 128, (N, nb, 32))
        qs[..., :2] = (-128, 127)
        lim = 2000  # keeps sum |w * q| < 2^24 with two +-32767 entries
    else:
        qs = rng.integers(0, 256, (N, nb, 16))
        qs[..., :4] = (0xFF, 0x00, 0x0F, 0xF0)
        lim = 32767
    blocks["qs"] = rng.permuted(qs, axis=-1)
    blocks["d"][np.arange(N), np.arange(N) % nb] = 1.0
    x = rng.integers(-lim, lim + 1, (T, nb, 32))
    special = (-32767, 32767, -256, -257, 255, 256, -255, -1, 0, 1, -128, 128)
    x[..., : len(special)] = special
    x = rng.permuted(x, axis=-1).reshape(T, nb * 32).astype(np.float32)
    _, dots = _a16_ref(wtype, x, blocks)
    y = dots[:, np.arange(N), np.arange(N) % nb]
    assert np.abs(y).max() < 2**24
    return x, blocks, y.astype(np.float32)


@pytest.mark.parametrize("variant", ["native", "avx512-novbmi"])
@pytest.mark.parametrize("wtype", sorted(QUANTIZED))
def test_matmul_a16_integer_sums_exact(libs, variant, wtype):
    """The byte-plane kernels' block sums equal sum(w * q) to the last integer, as do
    matmul_deq's, on every code path (groups, windows, tails, prefill tiles)."""
    lib = _get(libs, variant)
    rng = np.random.default_rng(23)
    for T in (1, 3, 6, 9):
        for nb in (1, 4, 9, 16, 20, 25, 37):
            N = nb + 3
            x, blocks, want = _exact_case(wtype, T, nb, N, rng)
            wq = np.frombuffer(blocks.tobytes(), np.uint8)
            for kind in ("a16", "deq"):
                y = _run_matmul(lib, f"{kind}_{wtype}", x, wq, N, N)
                np.testing.assert_array_equal(y, want, err_msg=f"{kind} {wtype} T={T} nb={nb}")


# ---- Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q4_K, Q5_K, Q6_K (linear_kquant.h) -------------------
#
# Random block bytes (every bit pattern of values, packed scales and high bits), with
# float16 scales drawn over a wide range and some blocks at the extremes (f16 max and
# subnormal scales, 6-bit scales 0 and 63, int8 scales -128 and 127). The weights the
# kernels must multiply by are gguf-py's `quants.dequantize` of those bytes; the offsets
# (Q5_1's m, the K-quants' -dmin * mn) are read from the bytes with gguf-py's own field
# layout so the reference can apply them to x's exact sum, as the kernels do.

KBLOCK = {
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q8_0": (32, 34),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "iq4_nl": (32, 18),
    "iq4_xs": (256, 136),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    "q3_k": (256, 110),
    "q2_k": (256, 84),
}


def _f16(rng, n: int, extreme: bool) -> np.ndarray:
    v = (rng.random(n) * 2.0 ** rng.integers(-14, 4, n)).astype(np.float16)
    if extreme:
        v[::3] = np.float16(65504.0)
        v[1::3] = np.float16(6e-8)  # subnormal
    return v


def _kblocks(wtype: str, N: int, K: int, seed: int, extreme: bool = False) -> np.ndarray:
    """Random blocks [N, K/QK * bytes] of `wtype` as uint8."""
    qk, nbytes = KBLOCK[wtype]
    rng = np.random.default_rng(seed)
    n = N * K // qk
    raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    if extreme:
        raw[::4, :] = 0xFF  # all values and scales at their top
        raw[1::4, :] = 0x00
    if wtype == "q6_k":
        raw[:, 208:210] = _f16(rng, n, extreme).reshape(-1, 1).view(np.uint8)
        if extreme:
            raw[2::4, 192:208] = np.array([0x80, 0x7F] * 8, np.uint8)  # int8 -128 / 127
    elif wtype == "q3_k":
        raw[:, 108:110] = _f16(rng, n, extreme).reshape(-1, 1).view(np.uint8)
        if extreme:  # 6-bit scales 0 and 63 alternating (sc - 32: -32 and 31)
            raw[2::4, 96:104] = np.array([0x0F, 0xF0] * 4, np.uint8)
            raw[2::4, 104:108] = np.array([0x33, 0xCC] * 2, np.uint8)
    elif wtype == "q2_k":  # d, dmin
        for f in range(2):
            raw[:, 80 + 2 * f : 82 + 2 * f] = _f16(rng, n, extreme).reshape(-1, 1).view(np.uint8)
    else:
        nf = 2 if wtype in ("q4_1", "q5_1", "q4_k", "q5_k") else 1
        for f in range(nf):
            raw[:, 2 * f : 2 * f + 2] = _f16(rng, n, extreme).reshape(-1, 1).view(np.uint8)
        if wtype == "q5_1":
            raw[::2, 2:4] = (-_f16(rng, (n + 1) // 2, False)).reshape(-1, 1).view(np.uint8)
    return np.ascontiguousarray(raw.reshape(N, -1))


def _koffsets(wtype: str, blocks: np.ndarray, N: int, K: int) -> np.ndarray:
    """Per 32-unit offset m of w = (integer part) + m, [N, K/32] f64 (0 for Q5_0/Q6_K; 0 for
    Q2_K too: its offsets per 16 multiply x as rounded, so they stay in the dequantized w)."""
    nbytes = KBLOCK[wtype][1]
    b = blocks.reshape(-1, nbytes)
    if wtype in ("q4_0", "q8_0", "q5_0", "iq4_nl", "iq4_xs", "q2_k", "q3_k", "q6_k"):
        return np.zeros((N, K // 32))
    if wtype in ("q4_1", "q5_1"):
        return b[:, 2:4].copy().view(np.float16).astype(np.float64).reshape(N, K // 32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float64)
    _, mn = quants.Q4_K.get_scale_min(b[:, 4:16].copy())
    return (-(dmin * mn.astype(np.float64))).reshape(N, K // 32)


def _act_ref(x: np.ndarray, qmax: float):
    """quantize_act16 with qmax (32767 or 127): rounded x, and x's exact block sums."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32)
    amax = np.abs(xb).max(axis=-1)
    inv = (np.float32(qmax) / np.where(amax > 0, amax, np.float32(1))).astype(np.float32)
    inv = np.where(amax > 0, inv, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None])
    scale = (amax / np.float32(qmax)).astype(np.float64)
    xq = (q * scale[..., None]).reshape(T, K)
    return xq, xb.astype(np.float64).sum(-1)


def _kref(wtype: str, x: np.ndarray, blocks: np.ndarray, N: int, K: int, qmax: float):
    """(the kernel's math in f64, x @ W.T in f64, a norm floor for relative errors)."""
    qt = getattr(gguf.GGMLQuantizationType, wtype.upper())
    wd = quants.dequantize(blocks, qt).reshape(N, K).astype(np.float64)
    m = _koffsets(wtype, blocks, N, K)
    xq, xsum = _act_ref(x, qmax)
    exact = xq @ (wd - np.repeat(m, 32, axis=1)).T + xsum @ m.T
    return exact, x.astype(np.float64) @ wd.T, _typical_norm(x, wd)


# T < 8: integer activations (int16 or int8); T >= 8 (kDequantMinT): the prefill paths,
# f32 against dequantized rows (x unrounded), or the same integer math (Q5_0/Q5_1, AVX512)
KQ_DEQUANT_MIN_T = 8
# K = 608 (Q5_0/Q5_1 only): 19 blocks, a natural window then a 3-block tail (the VNNI
# GEMV's 4-row tail)
K_SHAPES = [(T, K, N) for T in (1, 2, 5, 8, 17) for K in (256, 608, 768) for N in (1, 6, 9)]
# rows of 14 and 25 blocks of 32: a decode GEMV's transposed group of 16 blocks cut short
# (the 32-block types; the K-quants skip them)
K_SHAPES += [(1, 448, 6), (1, 800, 9), (3, 800, 5), (6, 448, 4)]


def _check_kquant(lib, wtype: str, shapes, extreme: bool) -> None:
    rng = np.random.default_rng(31)
    for T, K, N in shapes:
        if K % KBLOCK[wtype][0]:
            continue
        blocks = _kblocks(wtype, N, K, seed=T * 1000 + K + N, extreme=extreme)
        x = rng.standard_normal((T, K), dtype=np.float32) * np.float32(3)
        x[0, :32] = 0.0  # an all-zero activation block
        for kind, qmax, tol in (("a16_", 32767.0, 2e-6), ("", 127.0, 1e-5)):
            exact, ref, floor = _kref(wtype, x, blocks, N, K, qmax)
            y = _run_matmul(lib, f"{kind}{wtype}", x, blocks, N, N + 2).astype(np.float64)
            where = f"{kind}{wtype} T={T} K={K} N={N} extreme={extreme}"
            assert np.isfinite(y).all(), where
            if T >= KQ_DEQUANT_MIN_T:  # prefill: f32 against the dequantized rows, or
                # (Q5_0/Q5_1 on AVX512) the integer math with all rows at once
                err = min(_rel(y, ref, floor) / 1e-5, _rel(y, exact, floor) / tol)
                assert err <= 1, f"{where}: vs f32 and integer refs {err:.3g} x tolerance"
                continue
            err = _rel(y, exact, floor)
            assert err <= tol, f"{where}: vs its integer math {err:.3g}"
            if not extreme:  # then also near the float matmul (int8: random offsets cancel)
                err = _rel(y, ref, floor)
                assert err <= (1e-4 if kind else 5e-2), f"{where}: vs f32 ref {err:.3g}"


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("wtype", KTYPES)
@pytest.mark.parametrize("variant", ["native", "avx512-novbmi", "avx2", "scalar"])
def test_kquant_matmul(libs, variant, wtype, extreme):
    lib = _get(libs, variant)
    shapes = K_SHAPES if variant == "native" else K_SHAPES[::3]
    _check_kquant(lib, wtype, shapes, extreme)


@pytest.mark.parametrize("wtype", KTYPES)
@pytest.mark.parametrize("variant", ["native", "avx512-novbmi", "scalar"])
def test_kquant_matmul_small_batch(libs, variant, wtype):
    """T = 2..7 (a batch's decode step; on AVX512 the GEMV over all T tokens)."""
    shapes = [(T, K, N) for T in range(2, 8) for K in (256, 768) for N in (5, 10)]
    _check_kquant(_get(libs, variant), wtype, shapes, extreme=False)


@pytest.mark.parametrize("variant", ["native", "scalar"])
@pytest.mark.parametrize("wtype", KTYPES)
def test_kquant_embed_row(libs, variant, wtype):
    lib = _get(libs, variant)
    N, K = 9, 512
    blocks = _kblocks(wtype, N, K, seed=5, extreme=True)
    qt = getattr(gguf.GGMLQuantizationType, wtype.upper())
    wd = quants.dequantize(blocks, qt).reshape(N, K)
    for row in (0, 4, N - 1):
        out = np.full(K, np.nan, np.float32)
        getattr(lib, f"t_embed_row_{wtype}")(blocks.ctypes.data, K, row, out.ctypes.data)
        np.testing.assert_allclose(out, wd[row], rtol=2e-7, atol=0)


def _lanes_lib(libs, variant, wtype):
    lib = _get(libs, variant)
    if not lib.t_has_lanes():
        pytest.skip(f"{variant}: no AVX2 or AVX512-VNNI, no row-lanes kernels")
    return lib


def _lanes_of(lib, blocks: np.ndarray, wtype: str) -> np.ndarray:
    """The blocks in row lanes as the library's build reads them (its fifth-bit arrangement;
    passes/lanes.py fifth_form must name the same one for that ISA)."""
    from hipc.compiler.passes.lanes import AVX2, AVX512_VNNI, fifth_form
    from hipc.compiler.passes.repack import lane_quant_blocks

    fifth = "bytes" if lib.t_lane_fifth_bytes() else "masks"
    flags = [min(alts) for alts in (AVX512_VNNI if lib.t_has_lanes() == 2 else AVX2)]
    assert fifth_form(tuple(flags)) == fifth
    return np.ascontiguousarray(lane_quant_blocks(blocks, wtype, fifth))


# nb = K / 32 of 1, 3 (a last block without a pair), 18 (SmolLM2's rows), 25; row counts
# around the 16-row groups
LANE_SHAPES = [(T, K, N) for T in (1, 2, 7, 9) for K in (32, 96, 576, 800) for N in (1, 17, 40)]
# the K-quants': 1 and 3 super-blocks, prefills of one tile and of several with a tail
LANE_K_SHAPES = [(T, K, N) for T in (1, 2, 7, 9, 20) for K in (256, 768) for N in (1, 17, 40)]


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("wtype", LTYPES)
@pytest.mark.parametrize("variant", ["native", "avx512-novbmi", "avx2"])
def test_lanes_matmul(libs, variant, wtype, extreme):
    """The row-lanes kernels on lane_quant_blocks' layout against the integer math on gguf-py's
    dequantized blocks: the GEMV's balanced int16 split (|q| <= 32639) for T <= 7 (AVX2: every
    T), the AVX512 slab GEMM's quantize_act16 (32767) for prefills, int8 (127) for both. int16 takes a Q4_1/Q5_1 offset
    times the float sum of x, int8 times the rounded sum (int8's rounding errors then meet
    the centred weights, not their all-positive integer parts: linear_vnni.h's choice)."""
    lib = _lanes_lib(libs, variant, wtype)
    split_only = lib.t_has_lanes() == 1  # AVX2: the GEMV's kernel for prefills too
    rng = np.random.default_rng(11)
    shapes = LANE_K_SHAPES if wtype.endswith("_k") else LANE_SHAPES
    for T, K, N in shapes if variant == "native" else shapes[::4]:
        blocks = _kblocks(wtype, N, K, seed=T * 1000 + K + N, extreme=extreme)
        lanes = _lanes_of(lib, blocks, wtype)
        assert lanes.shape == (-(-N // 16) * 16, blocks.shape[1])
        x = rng.standard_normal((T, K), dtype=np.float32) * np.float32(3)
        x[0, 32:64] = 0.0  # an all-zero activation block (none where K is one block)
        a16_qmax = 32639.0 if T <= 7 or split_only else 32767.0
        for kind, qmax, tol in (("a16_", a16_qmax, 2e-6), ("", 127.0, 1e-5)):
            exact, ref, floor = _kref(wtype, x, blocks, N, K, qmax)
            if not kind:  # int8: the offsets' sums too of the rounded x (x_q @ W, as Q4_1's)
                qt = getattr(gguf.GGMLQuantizationType, wtype.upper())
                exact = _act_ref(x, qmax)[0] @ quants.dequantize(blocks, qt).reshape(N, K).T
            y = _run_matmul(lib, f"{kind}lanes_{wtype}", x, lanes, N, N + 2).astype(np.float64)
            where = f"{kind}lanes_{wtype} T={T} K={K} N={N} extreme={extreme}"
            assert np.isfinite(y).all(), where
            err = _rel(y, exact, floor)
            assert err <= tol, f"{where}: vs its integer math {err:.3g}"
            if not extreme:  # (a K-quant's one 256-wide row: int16's rounding shows, 1.1e-4)
                err = _rel(y, ref, floor)
                near = 2e-4 if wtype.endswith("_k") else 1e-4
                assert err <= (near if kind else 5e-2), f"{where}: vs f32 ref {err:.3g}"


@pytest.mark.parametrize("wtype", LTYPES)
def test_lanes_embed_row(libs, wtype):
    lib = _lanes_lib(libs, "native", wtype)
    N, K = 40, 512 if wtype.endswith("_k") else 96
    blocks = _kblocks(wtype, N, K, seed=6, extreme=True)
    lanes = _lanes_of(lib, blocks, wtype)
    qt = getattr(gguf.GGMLQuantizationType, wtype.upper())
    wd = quants.dequantize(blocks, qt).reshape(N, K)
    for row in (0, 5, 15, 16, 33, N - 1):
        out = np.full(K, np.nan, np.float32)
        getattr(lib, f"t_embed_row_lanes_{wtype}")(lanes.ctypes.data, K, row, out.ctypes.data)
        np.testing.assert_allclose(out, wd[row], rtol=2e-7, atol=0)


@pytest.mark.parametrize("variant", ["native", "avx2", "scalar"])
def test_silu_mul_row(libs, variant):
    """The GLU epilogue's silu(g) * u (a vector exp on AVX512 and AVX2) against float64, over the range
    where either branch of the sigmoid matters, a tail of 5, infinities and zeros."""
    lib = _get(libs, variant)
    g = np.concatenate([np.linspace(-90, 90, 4001), [0.0, -0.0, np.inf, -1e-30, 1e-30]])
    g = g.astype(np.float32)
    u = np.random.default_rng(2).standard_normal(g.size).astype(np.float32)
    y = np.full(g.size, np.nan, np.float32)
    lib.t_silu_mul_row(g.ctypes.data, u.ctypes.data, y.ctypes.data, g.size)
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore"):
        want = g64 / (1 + np.exp(-g64)) * u
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-30)  # e^-87 and below: 0 or denormal
