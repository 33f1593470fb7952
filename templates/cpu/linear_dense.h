// linear_dense.h -- matmuls against f32/f16/bf16 weights (x stays f32).
// No quantization: a plain FMA tile, shared by every ISA through the D* loaders.
#pragma once

namespace hipc {

// ====================================================================================
// Dense weights (f32 / f16 / bf16, row-major [N, K]); x stays f32, f32 accumulation.
//   y[t, n] = sum_k x[t, k] * float(W[n, k])
// Tile = R rows x C tokens: per step of V elements, R weight vectors are loaded and
// converted once and used for C tokens (R*C FMA accumulators). Any K is allowed.
// ====================================================================================
namespace detail {

struct DF32 {
  using T = float;
  static float get(const T* p) { return *p; }
#if defined(HIPC_ISA_AVX512)
  static __m512 load(const T* p) { return _mm512_loadu_ps(p); }
  static __m512 loadm(const T* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
#elif defined(HIPC_ISA_AVX2)
  static __m256 load(const T* p) { return _mm256_loadu_ps(p); }
#endif
};
struct DF16 {
  using T = uint16_t;
  static float get(const T* p) { return fp16_to_fp32(*p); }
#if defined(HIPC_ISA_AVX512)
  static __m512 load(const T* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static __m512 loadm(const T* p, __mmask16 k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }
#elif defined(HIPC_ISA_AVX2)
  static __m256 load(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif
};
struct DBF16 {
  using T = uint16_t;
  static float get(const T* p) { return bf16_to_fp32(*p); }
#if defined(HIPC_ISA_AVX512)
  static __m512 load(const T* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static __m512 loadm(const T* p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
  }
#elif defined(HIPC_ISA_AVX2)
  static __m256 load(const T* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
#endif
};

template <class D, int R, int C>
inline void d_tile(const float* x, int K, const typename D::T* W, int n0, int t0, float* y, int ldy) {
  const typename D::T* w[R];
  for (int r = 0; r < R; ++r) w[r] = W + (size_t)(n0 + r) * K;
  const float* xs[C];
  for (int c = 0; c < C; ++c) xs[c] = x + (size_t)(t0 + c) * K;
  int k = 0;
  float tail[R][C] = {};
#if defined(HIPC_ISA_AVX512)
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = D::load(w[r] + k);
    for (int c = 0; c < C; ++c) {
      const __m512 xv = _mm512_loadu_ps(xs[c] + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  if (k < K) {
    const __mmask16 m = mask16(K - k);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = D::loadm(w[r] + k, m);
    for (int c = 0; c < C; ++c) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, xs[c] + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
    k = K;
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) tail[r][c] = _mm512_reduce_add_ps(acc[r][c]);
#elif defined(HIPC_ISA_AVX2)
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = D::load(w[r] + k);
    for (int c = 0; c < C; ++c) {
      const __m256 xv = _mm256_loadu_ps(xs[c] + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) tail[r][c] = hsum256(acc[r][c]);
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      const float wk = D::get(w[r] + k);
      for (int c = 0; c < C; ++c) tail[r][c] += wk * xs[c][k];
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(size_t)(t0 + c) * ldy + n0 + r] = tail[r][c];
}

template <class D, int R, int C>
inline void d_rows(const float* x, int T, int K, const typename D::T* W, int n0, float* y, int ldy) {
  int t = 0;
  for (; t + C <= T; t += C) d_tile<D, R, C>(x, K, W, n0, t, y, ldy);
  for (; t < T; ++t) d_tile<D, R, 1>(x, K, W, n0, t, y, ldy);
}

// Dense matmul driver: omp for schedule(static) over tiles of R rows; each tile sweeps
// all T tokens in steps of C.
template <class D>
inline void d_matmul(const float* x, int T, int K, const void* Wv, int N, float* y, int ldy) {
  if (T <= 0 || N <= 0) return;
  const typename D::T* W = (const typename D::T*)Wv;
#if defined(HIPC_ISA_AVX512)
  constexpr int R = 4, C = 6;
#elif defined(HIPC_ISA_AVX2)
  constexpr int R = 2, C = 4;
#else
  constexpr int R = 2, C = 2;
#endif
  const int ntiles = (N + R - 1) / R;
  const bool par = (long long)T * N * K >= kParallelMinWork;
#pragma omp parallel for schedule(static) if (par)
  for (int i = 0; i < ntiles; ++i) {
    const int n0 = i * R;
    if (n0 + R <= N) {
      d_rows<D, R, C>(x, T, K, W, n0, y, ldy);
    } else {
      for (int n = n0; n < N; ++n) d_rows<D, 1, C>(x, T, K, W, n, y, ldy);
    }
  }
}

}  // namespace detail

}  // namespace hipc
