// row_ops.h -- the small row operations the linear and attention kernels share:
// scratch buffers, RMSNorm, RoPE. Apart because they are plain loops, not matmuls.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace hipc {

// Per-thread scratch, grown on demand and kept: kernels run every step, so
// allocating once and reusing keeps malloc out of the decode loop.
inline float* scratch_f32(int slot, size_t n) {
  thread_local std::vector<float> buf[4];
  std::vector<float>& v = buf[slot];
  if (v.size() < n + 16) v.resize(n + 16);
  return v.data();
}

// y = x / sqrt(mean(x^2) + eps) * w over one row of n.
inline void rmsnorm_row(const float* x, const float* w, int n, float eps, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / n + eps);
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

// RoPE on one head of D values at one position; cs/sn hold D/2 angles' cos/sin.
// "half": pairs (i, i + D/2) as in HF Llama. "interleaved": pairs (2i, 2i+1), the
// layout GGUF llama files are permuted for.
inline void rope_half(float* x, int D, const float* cs, const float* sn) {
  const int h = D / 2;
  for (int i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    x[i] = a * cs[i] - b * sn[i];
    x[i + h] = b * cs[i] + a * sn[i];
  }
}

inline void rope_interleaved(float* x, int D, const float* cs, const float* sn) {
  for (int i = 0; i < D / 2; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * cs[i] - b * sn[i];
    x[2 * i + 1] = b * cs[i] + a * sn[i];
  }
}

#if defined(HIPC_ISA_AVX512)
// e^x on 16 lanes for x <= 0 (softmax weights): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
// p the degree-6 Taylor polynomial (truncation < 2e-8 relative, ~2 ulp in all). Lanes
// below -87.3 come out as 0 or denormals; NaN stays NaN.
inline __m512 exp_ps_nonpos(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);  // NaN: max returns its second operand
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2 split: exact n*hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 q = _mm512_set1_ps(1.f / 720);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f / 120));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f / 24));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f / 6));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.5f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(q, n);
}
#endif

// One query row's attention over cached positions lo..hi of one KV head (row c of K / V at
// K + c * stride): out[D] = sum_c softmax_c(scale * q.k_c) v_c, scores soft-capped first
// when softcap > 0. Online softmax over blocks of 16 positions: no buffer of ctx length.
// AVX512 (D a multiple of 16, <= 256): the output in registers, the block's 16 weights by
// one vector exp.
template <int D>
inline void attend_row(const float* q, const float* K, const float* V, size_t stride, int lo, int hi, float scale,
                       float softcap, float* out) {
#if defined(HIPC_ISA_AVX512)
  if constexpr (D % 16 == 0 && D <= 256) {
    constexpr int NV = D / 16;
    __m512 qv[NV], acc[NV];
    for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i), acc[i] = _mm512_setzero_ps();
    float m = -INFINITY;
    __m512 lsum = _mm512_setzero_ps();
    alignas(64) float sc[16];
    for (int c0 = lo; c0 <= hi; c0 += 16) {
      const int n = std::min(16, hi + 1 - c0);
      for (int j = 0; j < n; ++j) {
        const float* kr = K + (size_t)(c0 + j) * stride;
        __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
        for (int i = 1; i < NV; ++i) d = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kr + 16 * i), d);
        float sj = _mm512_reduce_add_ps(d) * scale;
        if (softcap > 0.f) sj = softcap * std::tanh(sj / softcap);
        sc[j] = sj;
      }
      const __mmask16 valid = (__mmask16)((1u << n) - 1);
      const __m512 s = _mm512_maskz_load_ps(valid, sc);
      const float bm = _mm512_mask_reduce_max_ps(valid, s);
      if (bm > m) {  // the running max moves: rescale what is summed so far
        const float r = m == -INFINITY ? 0.f : std::exp(m - bm);
        for (int i = 0; i < NV; ++i) acc[i] = _mm512_mul_ps(acc[i], _mm512_set1_ps(r));
        lsum = _mm512_mul_ps(lsum, _mm512_set1_ps(r));
        m = bm;
      }
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_ps_nonpos(_mm512_sub_ps(s, _mm512_set1_ps(m))));
      lsum = _mm512_add_ps(lsum, e);
      _mm512_store_ps(sc, e);
      for (int j = 0; j < n; ++j) {
        const float* vr = V + (size_t)(c0 + j) * stride;
        const __m512 ej = _mm512_set1_ps(sc[j]);
        for (int i = 0; i < NV; ++i) acc[i] = _mm512_fmadd_ps(ej, _mm512_loadu_ps(vr + 16 * i), acc[i]);
      }
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(lsum));
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(acc[i], inv));
    return;
  }
#endif
  float acc[D];
  for (int d = 0; d < D; ++d) acc[d] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int c = lo; c <= hi; ++c) {
    const float* kr = K + (size_t)c * stride;
    const float* vr = V + (size_t)c * stride;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < D; ++d) s += q[d] * kr[d];
    s *= scale;
    if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
    if (s > m) {
      const float r = std::exp(m - s);
      l *= r;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[d] *= r;
      m = s;
    }
    const float e = std::exp(s - m);
    l += e;
#pragma omp simd
    for (int d = 0; d < D; ++d) acc[d] += e * vr[d];
  }
  const float inv = 1.f / l;
  for (int d = 0; d < D; ++d) out[d] = acc[d] * inv;
}

}  // namespace hipc
