// linear_avx2.h -- quantized matmuls on AVX2 (and AVX-VNNI) and in portable C++.
// One block at a time in natural order: simple enough that the scalar fallback is
// the same loop with the vector dot replaced.
#pragma once

namespace hipc {

// ====================================================================================
// AVX2 / scalar quantized kernels: one block at a time, natural element order
//
// unpack() turns one weight block into 32 bytes w (natural order) + dw + mw, with
//   Q4_1: w = nibble (unsigned),  y += dw*dx*dot(w, q) + m*s
//   Q4_0: w = nibble (unsigned),  y += dw*dx*dot(w, q) - 8*dw*s
//   Q8_0: w = q (signed),         y += dw*dx*dot(w, q)
// AVX2 dot: vpmaddubsw needs an unsigned first operand, so Q8_0 uses
// dot(|w|, sign(q, w)) (no i16 overflow: 2*128*127 < 32768); AVX-VNNI uses vpdpbusd.
// The tile kernel processes R rows x C tokens, reusing each unpacked block C times.
// ====================================================================================
#if !defined(HIPC_ISA_AVX512)
namespace detail {

#if defined(HIPC_ISA_AVX2)
// int32x8 partial sums of u8 x s8 products (each lane: 4 adjacent products)
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
using WVec = __m256i;
inline WVec unpack_nibbles(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128((const __m128i*)qs);
  const __m128i m4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}
#else
struct WVec {
  uint8_t v[32];
};
inline WVec unpack_nibbles(const uint8_t* qs) {
  WVec w;
  for (int j = 0; j < 16; ++j) {
    w.v[j] = qs[j] & 15;
    w.v[j + 16] = qs[j] >> 4;
  }
  return w;
}
#endif

struct BQ4_1 {
  static constexpr size_t kBlockBytes = 20;
  static constexpr bool kSigned = false;
  static constexpr bool kHasMin = true;
  static inline WVec unpack(const uint8_t* b, float& dw, float& mw) {
    uint16_t h[2];
    std::memcpy(h, b, 4);
    dw = fp16_to_fp32(h[0]);
    mw = fp16_to_fp32(h[1]);
    return unpack_nibbles(b + 4);
  }
};
struct BQ4_0 {
  static constexpr size_t kBlockBytes = 18;
  static constexpr bool kSigned = false;
  static constexpr bool kHasMin = true;
  static inline WVec unpack(const uint8_t* b, float& dw, float& mw) {
    uint16_t h;
    std::memcpy(&h, b, 2);
    dw = fp16_to_fp32(h);
    mw = -8.0f * dw;
    return unpack_nibbles(b + 2);
  }
};
struct BQ8_0 {
  static constexpr size_t kBlockBytes = 34;
  static constexpr bool kSigned = true;
  static constexpr bool kHasMin = false;
  static inline WVec unpack(const uint8_t* b, float& dw, float& mw) {
    uint16_t h;
    std::memcpy(&h, b, 2);
    dw = fp16_to_fp32(h);
    mw = 0.0f;
#if defined(HIPC_ISA_AVX2)
    return _mm256_loadu_si256((const __m256i*)(b + 2));
#else
    WVec w;
    std::memcpy(w.v, b + 2, 32);
    return w;
#endif
  }
};

// Tile: rows n0..n0+R-1 x tokens t0..t0+C-1; y[t, n] = sum_b dw*dx*dot + mw*s.
template <class Q, int R, int C>
inline void b_tile(const uint8_t* W, size_t rb, int nb, int n0, const QAct& a, int t0, float* y, int ldy) {
  const size_t xstride = (size_t)a.nbp * 32;
#if defined(HIPC_ISA_AVX2)
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
#else
  float acc[R][C] = {};
#endif
  float macc[R][C] = {};
  for (int b = 0; b < nb; ++b) {
    WVec w[R];
    float dw[R], mw[R];
    for (int r = 0; r < R; ++r) w[r] = Q::unpack(W + (size_t)(n0 + r) * rb + (size_t)b * Q::kBlockBytes, dw[r], mw[r]);
#if defined(HIPC_ISA_AVX2)
    __m256i wa[R];
    if (Q::kSigned)
      for (int r = 0; r < R; ++r) wa[r] = _mm256_sign_epi8(w[r], w[r]);  // |w|
#endif
    for (int c = 0; c < C; ++c) {
      const size_t xo = (size_t)(t0 + c) * a.nbp + b;
      const int8_t* xq = a.q + (size_t)(t0 + c) * xstride + 32 * (size_t)b;
      const float dx = a.d[xo];
#if defined(HIPC_ISA_AVX2)
      const __m256i xv = _mm256_loadu_si256((const __m256i*)xq);
      for (int r = 0; r < R; ++r) {
        const __m256i p = Q::kSigned ? dot_u8s8(wa[r], _mm256_sign_epi8(xv, w[r])) : dot_u8s8(w[r], xv);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw[r] * dx), acc[r][c]);
      }
#else
      for (int r = 0; r < R; ++r) {
        int32_t s = 0;
        if (Q::kSigned) {
          for (int j = 0; j < 32; ++j) s += (int32_t)(int8_t)w[r].v[j] * xq[j];
        } else {
          for (int j = 0; j < 32; ++j) s += (int32_t)w[r].v[j] * xq[j];
        }
        acc[r][c] += (float)s * (dw[r] * dx);
      }
#endif
      if (Q::kHasMin) {
        const float sx = a.s[xo];
        for (int r = 0; r < R; ++r) macc[r][c] += mw[r] * sx;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
#if defined(HIPC_ISA_AVX2)
      const float v = hsum256(acc[r][c]);
#else
      const float v = acc[r][c];
#endif
      y[(size_t)(t0 + c) * ldy + n0 + r] = v + macc[r][c];
    }
}

template <class Q, int R, int C>
inline void b_rows(const uint8_t* W, size_t rb, int nb, int n0, const QAct& a, float* y, int ldy) {
  int t = 0;
  for (; t + C <= a.T; t += C) b_tile<Q, R, C>(W, rb, nb, n0, a, t, y, ldy);
  for (; t < a.T; ++t) b_tile<Q, R, 1>(W, rb, nb, n0, a, t, y, ldy);
}

// Quantized matmul driver (AVX2 / scalar). Same parallel mapping as the AVX512 one:
// quantize x (omp for over tokens), then omp for schedule(static) over row tiles.
template <class Q>
inline void q_matmul(const float* x, int T, int K, const void* Wv, int N, float* y, int ldy) {
  if (T <= 0 || N <= 0) return;
  const uint8_t* W = (const uint8_t*)Wv;
  const int nb = K / 32;
  const size_t rb = (size_t)nb * Q::kBlockBytes;
  const QAct a = alloc_qact(T, K, 0);
  const bool par = (long long)T * N * K >= kParallelMinWork;
  constexpr int R = 2, C = 4;
  const int ntiles = (N + R - 1) / R;
#pragma omp parallel if (par)
  {
#pragma omp for schedule(static)
    for (int t = 0; t < T; ++t) quantize_act_row(x, K, a, t);
#pragma omp for schedule(static)
    for (int i = 0; i < ntiles; ++i) {
      const int n0 = i * R;
      if (n0 + R <= N) {
        b_rows<Q, R, C>(W, rb, nb, n0, a, y, ldy);
      } else {
        for (int n = n0; n < N; ++n) b_rows<Q, 1, C>(W, rb, nb, n, a, y, ldy);
      }
    }
  }
}

}  // namespace detail
#endif  // !HIPC_ISA_AVX512

}  // namespace hipc
