// hipc_cpu_ops.h -- the small row operations hipc's CPU kernels share: scratch
// buffers, RMSNorm, RoPE. Matrix products live in hipc_cpu.h.
#pragma once

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

// ---- float32-activation matmuls against quantized weights --------------------------
//
// y[t, n] = sum_k x[t, k] * W[n, k] with x kept in float32: each 32-weight block is
// dequantized into registers and multiplied by the float activations, so the result
// equals a float32 matmul against the dequantized weights up to summation order (the
// int8-activation kernels in hipc_cpu.h trade that for speed). Threads split the N
// output rows; each dequantized block is reused for up to TT tokens.

inline void dequant_block(const block_q4_0& b, float* w) {
  const float d = fp16_to_fp32(b.d);
#pragma omp simd
  for (int j = 0; j < 16; ++j) {
    w[j] = d * (float)((int)(b.qs[j] & 15) - 8);
    w[j + 16] = d * (float)((int)(b.qs[j] >> 4) - 8);
  }
}

inline void dequant_block(const block_q4_1& b, float* w) {
  const float d = fp16_to_fp32(b.d), m = fp16_to_fp32(b.m);
#pragma omp simd
  for (int j = 0; j < 16; ++j) {
    w[j] = d * (float)(b.qs[j] & 15) + m;
    w[j + 16] = d * (float)(b.qs[j] >> 4) + m;
  }
}

inline void dequant_block(const block_q8_0& b, float* w) {
  const float d = fp16_to_fp32(b.d);
#pragma omp simd
  for (int j = 0; j < 32; ++j) w[j] = d * (float)b.qs[j];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Block b's 32 weights as two 16-float registers (elements 0..15 and 16..31).
inline void dequant16x2(const block_q4_0& b, __m512& lo, __m512& hi) {
  const __m128i q = _mm_loadu_si128((const __m128i*)b.qs);
  const __m512 d = _mm512_set1_ps(fp16_to_fp32(b.d)), off = _mm512_set1_ps(-8.f);
  const __m128i m4 = _mm_set1_epi8(15);
  lo = _mm512_mul_ps(d, _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, m4))), off));
  hi = _mm512_mul_ps(d, _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m4))), off));
}
inline void dequant16x2(const block_q4_1& b, __m512& lo, __m512& hi) {
  const __m128i q = _mm_loadu_si128((const __m128i*)b.qs);
  const __m512 d = _mm512_set1_ps(fp16_to_fp32(b.d)), m = _mm512_set1_ps(fp16_to_fp32(b.m));
  const __m128i m4 = _mm_set1_epi8(15);
  lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, m4))), m);
  hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m4))), m);
}
inline void dequant16x2(const block_q8_0& b, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(fp16_to_fp32(b.d));
  lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)b.qs))));
  hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b.qs + 16)))));
}

// TN tokens against one weight row, accumulators held in registers.
template <class Block, int TN>
inline void deq_row_tile(const Block* row, int nb, const float* x, int K, float* y, int ldy) {
  __m512 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    __m512 lo, hi;
    dequant16x2(row[b], lo, hi);
    for (int t = 0; t < TN; ++t) {
      const float* xr = x + (size_t)t * K + b * 32;
      acc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[t]);
      acc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[t]);
    }
  }
  for (int t = 0; t < TN; ++t) y[(size_t)t * ldy] = _mm512_reduce_add_ps(acc[t]);
}
#endif

template <class Block>
inline void deq_row_generic(const Block* row, int nb, const float* x, int K, int tn, float* y, int ldy) {
  for (int t = 0; t < tn; ++t) {
    float acc[32] = {};
    for (int b = 0; b < nb; ++b) {
      alignas(64) float w[32];
      dequant_block(row[b], w);
      const float* xr = x + (size_t)t * K + b * 32;
#pragma omp simd
      for (int j = 0; j < 32; ++j) acc[j] += w[j] * xr[j];
    }
    float s = 0.f;
    for (int j = 0; j < 32; ++j) s += acc[j];
    y[(size_t)t * ldy] = s;
  }
}

template <class Block>
inline void matmul_deq(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  const int nb = K / 32;
  const Block* Wb = (const Block*)W;
#pragma omp parallel for schedule(static) if ((size_t)N * K * T > 65536)
  for (int n = 0; n < N; ++n) {
    const Block* row = Wb + (size_t)n * nb;
    int t = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; t + 4 <= T; t += 4) deq_row_tile<Block, 4>(row, nb, x + (size_t)t * K, K, y + (size_t)t * ldy + n, ldy);
    for (; t < T; ++t) deq_row_tile<Block, 1>(row, nb, x + (size_t)t * K, K, y + (size_t)t * ldy + n, ldy);
#endif
    if (t < T) deq_row_generic(row, nb, x + (size_t)t * K, K, T - t, y + (size_t)t * ldy + n, ldy);
  }
}

inline void matmul_f32act_q4_0(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_deq<block_q4_0>(x, T, K, W, N, y, ldy);
}
inline void matmul_f32act_q4_1(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_deq<block_q4_1>(x, T, K, W, N, y, ldy);
}
inline void matmul_f32act_q8_0(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_deq<block_q8_0>(x, T, K, W, N, y, ldy);
}
// dense weights have no activation quantization to begin with
inline void matmul_f32act_f32(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_f32(x, T, K, W, N, y, ldy);
}
inline void matmul_f32act_f16(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_f16(x, T, K, W, N, y, ldy);
}
inline void matmul_f32act_bf16(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_bf16(x, T, K, W, N, y, ldy);
}

}  // namespace hipc
