// row_ops.h -- the small row operations the linear and attention kernels share:
// scratch buffers, row passes, RMSNorm, RoPE. Apart because they are plain loops, not matmuls.
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

inline int32_t* scratch_i32(size_t n) {
  thread_local std::vector<int32_t> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// f(t) for the rows t < T of a pass over a step's activations (a linear's norm, its
// epilogue): split over the threads from kRowsParallel rows on (a prefill), else run on the
// calling thread without entering OpenMP: an `omp parallel if (false)` region still costs
// ~0.3 us (a team of one), and a decode layer had six (2% of a SmolLM2 step at 2 threads).
constexpr int kRowsParallel = 8;
template <class F>
inline void for_rows(int T, F&& f) {
  if (T >= kRowsParallel) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; ++t) f(t);
  } else {
    for (int t = 0; t < T; ++t) f(t);
  }
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

#if defined(HIPC_ISA_AVX2)
// exp_ps_nonpos's polynomial on 8 lanes; 2^n by the exponent bits, so lanes below -87.3
// come out as e^-87.3 (~1e-38, where AVX512's are 0 or denormals); NaN stays NaN.
inline __m256 exp256_nonpos(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);  // NaN: max returns its second operand
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  // ln2 split: exact n*hi
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 q = _mm256_set1_ps(1.f / 720);
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f / 120));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f / 24));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f / 6));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.5f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(q, _mm256_castsi256_ps(e));
}

// r[j] = the sum of v[j]'s 8 lanes, for 8 vectors (pairs added in a tree, then the halves)
inline __m256 hsum8(const __m256 (&v)[8]) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // lanes: v0..v3 | v0..v3 (halves)
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

// y[j] = silu(g[j]) * u[j] = g / (1 + e^-g) * u for j < n (the gated MLP's epilogue). On
// AVX512 one vector exp of -|g| per 16 (e^-|g| / (1 + e^-|g|) is the sigmoid of a negative g),
// within a few ulp of std::exp's; a SmolLM2 decode step spent ~7% of its serial time here. AVX2
// the same per 8 (a 128-token SmolLM2 prefill spent 6% in the scalar form).
inline void silu_mul_row(const float* g, const float* u, float* y, int n) {
  int j = 0;
#if defined(HIPC_ISA_AVX512)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; j + 16 <= n; j += 16) {
    const __m512 gv = _mm512_loadu_ps(g + j);
    const __m512 e = exp_ps_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
    const __mmask16 neg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
    _mm512_storeu_ps(y + j, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + j)));
  }
#elif defined(HIPC_ISA_AVX2)
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; j + 8 <= n; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    const __m256 e = exp256_nonpos(_mm256_or_ps(gv, sign));  // e^-|g|
    const __m256 neg = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + j)));
  }
#endif
  for (; j < n; ++j) y[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
}

// One query row's attention, fed the cached positions range by range (a KV block's
// positions are consecutive rows K + j * stride): out[D] = sum_c softmax_c(scale * q.k_c) v_c,
// scores soft-capped first when softcap > 0. Online softmax over blocks of 16 positions:
// no buffer of ctx length. AVX512 (D a multiple of 16, <= 256): the output in registers,
// the block's 16 weights by one vector exp; AVX2 (D a multiple of 8, <= 128) the same in
// blocks of 8 (scalar, a SmolLM2 decode after 512 positions spent 18% in attention);
// elsewhere one position at a time.
template <int D>
struct Attend {
  static constexpr bool kVec =
#if defined(HIPC_ISA_AVX512)
      D % 16 == 0 && D <= 256;
#elif defined(HIPC_ISA_AVX2)
      D % 8 == 0 && D <= 128;
#else
      false;
#endif
  const float* q;
  float scale, softcap, m = -INFINITY, l = 0.f;
  float acc[D];
#if defined(HIPC_ISA_AVX512)
  static constexpr int NV = D / 16;
  __m512 qv[NV > 0 ? NV : 1], av[NV > 0 ? NV : 1], lsum = _mm512_setzero_ps();
#elif defined(HIPC_ISA_AVX2)
  static constexpr int NV = D / 8;
  __m256 qv[NV > 0 && kVec ? NV : 1], av[NV > 0 && kVec ? NV : 1], lsum = _mm256_setzero_ps();
#endif

  Attend(const float* q_, float scale_, float softcap_) : q(q_), scale(scale_), softcap(softcap_) {
#if defined(HIPC_ISA_AVX512)
    if constexpr (kVec) {
      for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i), av[i] = _mm512_setzero_ps();
      return;
    }
#elif defined(HIPC_ISA_AVX2)
    if constexpr (kVec) {
      for (int i = 0; i < NV; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i), av[i] = _mm256_setzero_ps();
      return;
    }
#endif
    for (int d = 0; d < D; ++d) acc[d] = 0.f;
  }

  // positions K + j * stride, V + j * stride for j < n, in order
  void range(const float* K, const float* V, size_t stride, int n) {
#if defined(HIPC_ISA_AVX512)
    if constexpr (kVec) {
      alignas(64) float sc[16];
      for (int j0 = 0; j0 < n; j0 += 16) {
        const int nb = std::min(16, n - j0);
        for (int j = 0; j < nb; ++j) {
          const float* kr = K + (size_t)(j0 + j) * stride;
          __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
          for (int i = 1; i < NV; ++i) d = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kr + 16 * i), d);
          float sj = _mm512_reduce_add_ps(d) * scale;
          if (softcap > 0.f) sj = softcap * std::tanh(sj / softcap);
          sc[j] = sj;
        }
        const __mmask16 valid = (__mmask16)((1u << nb) - 1);
        const __m512 s = _mm512_maskz_load_ps(valid, sc);
        const float bm = _mm512_mask_reduce_max_ps(valid, s);
        if (bm > m) {  // the running max moves: rescale what is summed so far
          const __m512 r = _mm512_set1_ps(m == -INFINITY ? 0.f : std::exp(m - bm));
          for (int i = 0; i < NV; ++i) av[i] = _mm512_mul_ps(av[i], r);
          lsum = _mm512_mul_ps(lsum, r);
          m = bm;
        }
        const __m512 e = _mm512_maskz_mov_ps(valid, exp_ps_nonpos(_mm512_sub_ps(s, _mm512_set1_ps(m))));
        lsum = _mm512_add_ps(lsum, e);
        _mm512_store_ps(sc, e);
        for (int j = 0; j < nb; ++j) {
          const float* vr = V + (size_t)(j0 + j) * stride;
          const __m512 ej = _mm512_set1_ps(sc[j]);
          for (int i = 0; i < NV; ++i) av[i] = _mm512_fmadd_ps(ej, _mm512_loadu_ps(vr + 16 * i), av[i]);
        }
      }
      return;
    }
#elif defined(HIPC_ISA_AVX2)
    if constexpr (kVec) {
      alignas(32) float sc[8];
      const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
      for (int j0 = 0; j0 < n; j0 += 8) {
        const int nb = std::min(8, n - j0);
        __m256 d[8];
        for (int j = 0; j < 8; ++j) {
          d[j] = _mm256_setzero_ps();
          if (j < nb) {
            const float* kr = K + (size_t)(j0 + j) * stride;
            for (int i = 0; i < NV; ++i) d[j] = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(kr + 8 * i), d[j]);
          }
        }
        __m256 s = _mm256_mul_ps(hsum8(d), _mm256_set1_ps(scale));
        if (softcap > 0.f) {
          _mm256_store_ps(sc, s);
          for (int j = 0; j < nb; ++j) sc[j] = softcap * std::tanh(sc[j] / softcap);
          s = _mm256_load_ps(sc);
        }
        const __m256 valid = _mm256_cmp_ps(iota, _mm256_set1_ps((float)nb), _CMP_LT_OQ);
        s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, valid);
        const float bm = hmax8(s);
        if (bm > m) {  // the running max moves: rescale what is summed so far
          const __m256 r = _mm256_set1_ps(m == -INFINITY ? 0.f : std::exp(m - bm));
          for (int i = 0; i < NV; ++i) av[i] = _mm256_mul_ps(av[i], r);
          lsum = _mm256_mul_ps(lsum, r);
          m = bm;
        }
        const __m256 e = _mm256_and_ps(valid, exp256_nonpos(_mm256_sub_ps(s, _mm256_set1_ps(m))));
        lsum = _mm256_add_ps(lsum, e);
        _mm256_store_ps(sc, e);
        if (nb == 8) {  // output vector outer, one live at a time: q and D = 64's outputs
                        // alone fill AVX2's 16 registers (the other order spilled each FMA's)
          __m256 ej[8];
          for (int j = 0; j < 8; ++j) ej[j] = _mm256_set1_ps(sc[j]);
          for (int i = 0; i < NV; ++i) {
            __m256 acc = av[i];
            for (int j = 0; j < 8; ++j) acc = _mm256_fmadd_ps(ej[j], _mm256_loadu_ps(V + (size_t)(j0 + j) * stride + 8 * i), acc);
            av[i] = acc;
          }
          continue;
        }
        for (int j = 0; j < nb; ++j) {
          const float* vr = V + (size_t)(j0 + j) * stride;
          const __m256 ej = _mm256_set1_ps(sc[j]);
          for (int i = 0; i < NV; ++i) av[i] = _mm256_fmadd_ps(ej, _mm256_loadu_ps(vr + 8 * i), av[i]);
        }
      }
      return;
    }
#endif
    for (int j = 0; j < n; ++j) {
      const float* kr = K + (size_t)j * stride;
      const float* vr = V + (size_t)j * stride;
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
  }

  // The weights' sum so far (the vector forms' lanes added in a fixed order)
  float weight_sum() const {
#if defined(HIPC_ISA_AVX512)
    if constexpr (kVec) return _mm512_reduce_add_ps(lsum);
#elif defined(HIPC_ISA_AVX2)
    if constexpr (kVec) {
      alignas(32) float ls[8];
      _mm256_store_ps(ls, lsum);
      return ((ls[0] + ls[1]) + (ls[2] + ls[3])) + ((ls[4] + ls[5]) + (ls[6] + ls[7]));
    }
#endif
    return l;
  }

  void finish(float* out) {
    const float inv = 1.f / weight_sum();
#if defined(HIPC_ISA_AVX512)
    if constexpr (kVec) {
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(av[i], _mm512_set1_ps(inv)));
      return;
    }
#elif defined(HIPC_ISA_AVX2)
    if constexpr (kVec) {
      for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(av[i], _mm256_set1_ps(inv)));
      return;
    }
#endif
    for (int d = 0; d < D; ++d) out[d] = acc[d] * inv;
  }

  // What finish() would divide, for merge_parts: dst = [running max, sum of weights, the
  // D weighted value sums]
  void partial(float* dst) {
    dst[0] = m, dst[1] = weight_sum();
#if defined(HIPC_ISA_AVX512)
    if constexpr (kVec) {
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(dst + 2 + 16 * i, av[i]);
      return;
    }
#elif defined(HIPC_ISA_AVX2)
    if constexpr (kVec) {
      for (int i = 0; i < NV; ++i) _mm256_storeu_ps(dst + 2 + 8 * i, av[i]);
      return;
    }
#endif
    for (int d = 0; d < D; ++d) dst[2 + d] = acc[d];
  }
};

// One query row's attention from the partials (Attend::partial) of S consecutive parts of
// its positions: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M the largest m_s.
template <int D>
inline void merge_parts(const float* parts, int S, float* out) {
  float M = -INFINITY;
  for (int s = 0; s < S; ++s) M = std::max(M, parts[(size_t)s * (D + 2)]);
  float l = 0.f, acc[D] = {};
  for (int s = 0; s < S; ++s) {
    const float* p = parts + (size_t)s * (D + 2);
    const float w = p[0] == -INFINITY ? 0.f : std::exp(p[0] - M);
    l += w * p[1];
#pragma omp simd
    for (int d = 0; d < D; ++d) acc[d] += w * p[2 + d];
  }
  const float inv = 1.f / l;
#pragma omp simd
  for (int d = 0; d < D; ++d) out[d] = acc[d] * inv;
}

#if defined(HIPC_ISA_AVX512)
// r[j] = the sum of v[j]'s 16 lanes, for 16 vectors: halves, quarters, pairs and lanes added
// in a tree (~3 instructions a vector where one horizontal sum takes ~8), then put in order
// (the tree leaves the sum of v[l + 4i] at lane 4l + i).
inline __m512 hsum16(__m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
  for (int k = 0; k < 8; ++k)
    a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88), _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    c[k] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0x44), _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0xEE));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}
#endif

// Heads a decode attention item takes at once (AttendG): G query heads share a KV head, so
// GT of them read each cached key and value row once; GT divides G and GT * D / 16
// accumulator vectors stay in registers (D 64: up to 4 heads, 128: 2).
template <int D>
constexpr int attend_heads(int G) {
#if defined(HIPC_ISA_AVX512)
  if constexpr (D % 16 == 0 && D <= 256) {
    for (int gt = 16 / (D / 16) < G ? 16 / (D / 16) : G; gt > 1; --gt)
      if (G % gt == 0) return gt;
  }
#endif
  (void)G;
  return 1;
}

// GT query rows against the same cached keys and values (grouped-query heads), as Attend
// each: q[g] their rows, out[g] theirs. One head (GT = 1) is Attend itself; several are the
// AVX512 form below (attend_heads picks GT > 1 only there).
template <int D, int GT>
struct AttendG;

template <int D>
struct AttendG<D, 1> : Attend<D> {
  AttendG(const float* const* q_, float scale_, float softcap_) : Attend<D>(q_[0], scale_, softcap_) {}
  void finish(float* const* out) { Attend<D>::finish(out[0]); }
  void partial(float* const* dst) { Attend<D>::partial(dst[0]); }
};

#if defined(HIPC_ISA_AVX512)
// Per block of 16 positions each head's 16 scores as one vector (hsum16 over 16 dot-product
// vectors; the keys of the block stay in L1 for the next head), then each value row read once
// for all GT heads. Not for one head: this form of one head read up to 1.9x slower than Attend
// with the cache in L2 (SmolLM2's shape, 1,024 positions).
template <int D, int GT>
struct AttendG {
  static_assert(GT > 1 && D % 16 == 0 && D <= 256, "the grouped form: several heads, D a multiple of 16 up to 256");
  static constexpr int NV = D / 16;
  float scale, softcap;
  const float* q[GT];
  float m[GT];
  __m512 av[GT][NV], lsum[GT];

  AttendG(const float* const* q_, float scale_, float softcap_) : scale(scale_), softcap(softcap_) {
    for (int g = 0; g < GT; ++g) {
      q[g] = q_[g], m[g] = -INFINITY, lsum[g] = _mm512_setzero_ps();
      for (int i = 0; i < NV; ++i) av[g][i] = _mm512_setzero_ps();
    }
  }

  void range(const float* K, const float* V, size_t stride, int n) {
    alignas(64) float e[GT][16];
    for (int j0 = 0; j0 < n; j0 += 16) {
      const int nb = std::min(16, n - j0);
      const __mmask16 valid = (__mmask16)((1u << nb) - 1);
      for (int g = 0; g < GT; ++g) {
        __m512 qv[NV], d[16];
        for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q[g] + 16 * i);
        // unrolled: GCC kept it a loop storing each d[j] to the stack for hsum16 to reload
        // (SmolLM2's 1,024 positions with the rows in cache, one thread: 69-70 -> 54 us)
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          d[j] = _mm512_setzero_ps();
          if (j < nb) {
            const float* kr = K + (size_t)(j0 + j) * stride;
            for (int i = 0; i < NV; ++i) d[j] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kr + 16 * i), d[j]);
          }
        }
        __m512 s = _mm512_mul_ps(hsum16(d), _mm512_set1_ps(scale));
        if (softcap > 0.f) {
          alignas(64) float sc[16];
          _mm512_store_ps(sc, s);
          for (int j = 0; j < nb; ++j) sc[j] = softcap * std::tanh(sc[j] / softcap);
          s = _mm512_load_ps(sc);
        }
        const float bm = _mm512_mask_reduce_max_ps(valid, s);
        if (bm > m[g]) {  // the running max moves: rescale what is summed so far
          const __m512 r = _mm512_set1_ps(m[g] == -INFINITY ? 0.f : std::exp(m[g] - bm));
          for (int i = 0; i < NV; ++i) av[g][i] = _mm512_mul_ps(av[g][i], r);
          lsum[g] = _mm512_mul_ps(lsum[g], r);
          m[g] = bm;
        }
        const __m512 w = _mm512_maskz_mov_ps(valid, exp_ps_nonpos(_mm512_sub_ps(s, _mm512_set1_ps(m[g]))));
        lsum[g] = _mm512_add_ps(lsum[g], w);
        _mm512_store_ps(e[g], w);
      }
      for (int j = 0; j < nb; ++j) {
        const float* vr = V + (size_t)(j0 + j) * stride;
        for (int i = 0; i < NV; ++i) {
          const __m512 v = _mm512_loadu_ps(vr + 16 * i);
          for (int g = 0; g < GT; ++g) av[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(e[g][j]), v, av[g][i]);
        }
      }
    }
  }

  void finish(float* const* out) {
    for (int g = 0; g < GT; ++g) {
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(lsum[g]));
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out[g] + 16 * i, _mm512_mul_ps(av[g][i], inv));
    }
  }

  void partial(float* const* dst) {
    for (int g = 0; g < GT; ++g) {
      dst[g][0] = m[g], dst[g][1] = _mm512_reduce_add_ps(lsum[g]);
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(dst[g] + 2 + 16 * i, av[g][i]);
    }
  }
};
#endif

}  // namespace hipc
