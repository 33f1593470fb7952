// linear_a16.h -- the public matmul_a16_<type> entry points (int16 activations, the
// default). Apart from linear.h because they are a second rounding of x, with their own
// portable kernel (matmul_deq); on AVX512 they reuse linear_vnni.h's kernels.
#pragma once

namespace hipc {

// y[t, n] = sum_k x[t, k] * W[n, k] for W in GGUF blocks. The activations are rounded
// to int16 per 32-element block (below), which keeps the result within ~1e-5 of a
// float32 matmul against the dequantized weights; the int8-activation kernels in
// linear.h trade more accuracy for speed. Threads split the N output rows.

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

// Activations as int16 per 32-element block (scale = max|x| / 32767) plus the block's
// float sum: integer products with the weights' small integers are exact, so the only
// rounding left is x's, at 1/65534 of its block maximum -- far below what changes a
// token, and cheap: one vpmaddwd multiplies 32 weights by 32 activations.
struct Act16 {
  int nb = 0;
  int16_t* q = nullptr;  // [T][nb*32]
  float* scale = nullptr;  // [T][nb]
  float* sum = nullptr;  // [T][nb]
};

// qmax: 32767 (int16); linear_kquant.h also asks for 127 (int8 activations).
inline Act16 quantize_act16(const float* x, int T, int K, float qmax = 32767.f) {
  Act16 a;
  a.nb = K / 32;
  const size_t nblk = (size_t)T * a.nb;
  a.q = (int16_t*)scratch_f32(2, nblk * 16 + 16);
  a.scale = scratch_f32(3, nblk * 2 + 16);
  a.sum = a.scale + nblk;
  for (size_t i = 0; i < nblk; ++i) {
    const float* xb = x + i * 32;  // rows are K = nb*32 wide, so blocks are contiguous
    float amax = 0.f, s = 0.f;
    for (int j = 0; j < 32; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      s += xb[j];
    }
    const float inv = amax > 0.f ? qmax / amax : 0.f;
    for (int j = 0; j < 32; ++j) a.q[i * 32 + j] = (int16_t)std::lrint(xb[j] * inv);
    a.scale[i] = amax / qmax;
    a.sum[i] = s;
  }
  return a;
}

// A block's weights as integers w and its float scale/offset: value = d * w + m.
inline void block_ints(const block_q4_0& b, int16_t* w, float& d, float& m) {
  d = fp16_to_fp32(b.d), m = 0.f;
  for (int j = 0; j < 16; ++j) w[j] = (int16_t)((b.qs[j] & 15) - 8), w[j + 16] = (int16_t)((b.qs[j] >> 4) - 8);
}
inline void block_ints(const block_q4_1& b, int16_t* w, float& d, float& m) {
  d = fp16_to_fp32(b.d), m = fp16_to_fp32(b.m);
  for (int j = 0; j < 16; ++j) w[j] = (int16_t)(b.qs[j] & 15), w[j + 16] = (int16_t)(b.qs[j] >> 4);
}
inline void block_ints(const block_q8_0& b, int16_t* w, float& d, float& m) {
  d = fp16_to_fp32(b.d), m = 0.f;
  for (int j = 0; j < 32; ++j) w[j] = b.qs[j];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512i block_w16(const block_q4_0& b) {
  const __m128i q = _mm_loadu_si128((const __m128i*)b.qs), m4 = _mm_set1_epi8(15);
  const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
  return _mm512_sub_epi16(_mm512_cvtepu8_epi16(nib), _mm512_set1_epi16(8));
}
inline __m512i block_w16(const block_q4_1& b) {
  const __m128i q = _mm_loadu_si128((const __m128i*)b.qs), m4 = _mm_set1_epi8(15);
  return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4)));
}
inline __m512i block_w16(const block_q8_0& b) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)b.qs)); }
// Only Q4_1 has an offset m; the others skip its term at compile time.
template <class B> constexpr bool has_m = false;
template <> constexpr bool has_m<block_q4_1> = true;

// R weight rows x TN tokens per call: R independent streams keep enough loads in
// flight to run at memory bandwidth (one sequential stream per core does not).
template <class Block, int R, int TN>
inline void i16_tile(const Block* rows, size_t row_stride, const Act16& a, int t0, float* y, int ldy) {
  __m512 acc[R][TN];
  float macc[R][TN];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TN; ++t) acc[r][t] = _mm512_setzero_ps(), macc[r][t] = 0.f;
  for (int b = 0; b < a.nb; ++b) {
    for (int r = 0; r < R; ++r) {
      const Block& blk = rows[r * row_stride + b];
      _mm_prefetch((const char*)(&blk + 8), _MM_HINT_T0);
      const __m512i w = block_w16(blk);
      const float d = fp16_to_fp32(blk.d);
      for (int t = 0; t < TN; ++t) {
        const size_t i = (size_t)(t0 + t) * a.nb + b;
        const __m512i x = _mm512_loadu_si512((const void*)(a.q + i * 32));
        const __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(w, x));
        acc[r][t] = _mm512_fmadd_ps(p, _mm512_set1_ps(d * a.scale[i]), acc[r][t]);
        if constexpr (has_m<Block>) macc[r][t] += fp16_to_fp32(((const block_q4_1&)blk).m) * a.sum[i];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TN; ++t) y[(size_t)t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]) + macc[r][t];
}
#endif

template <class Block>
inline void i16_row_generic(const Block* row, const Act16& a, int t0, int tn, float* y, int ldy) {
  for (int t = 0; t < tn; ++t) {
    float acc = 0.f;
    for (int b = 0; b < a.nb; ++b) {
      int16_t w[32];
      float d, m;
      block_ints(row[b], w, d, m);
      const size_t i = (size_t)(t0 + t) * a.nb + b;
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) s += (int32_t)w[j] * a.q[i * 32 + j];
      acc += d * a.scale[i] * (float)s + m * a.sum[i];
    }
    y[(size_t)t * ldy] = acc;
  }
}

template <class Block>
inline void matmul_deq(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  constexpr int R = 4;
  const Act16 a = quantize_act16(x, T, K);
  const Block* Wb = (const Block*)W;
  const int groups = (N + R - 1) / R;
#pragma omp parallel for schedule(static) if ((size_t)N * K * T > 65536)
  for (int g = 0; g < groups; ++g) {
    const int n0 = g * R;
    int t = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const Block* rows = Wb + (size_t)n0 * a.nb;
    if (n0 + R <= N) {
      for (; t + 4 <= T; t += 4) i16_tile<Block, R, 4>(rows, a.nb, a, t, y + (size_t)t * ldy + n0, ldy);
      for (; t < T; ++t) i16_tile<Block, R, 1>(rows, a.nb, a, t, y + (size_t)t * ldy + n0, ldy);
    }
#endif
    for (int n = n0; n < N && n < n0 + R && t < T; ++n)
      i16_row_generic(Wb + (size_t)n * a.nb, a, t, T - t, y + (size_t)t * ldy + n, ldy);
  }
}

// With AVX512-VNNI the int16 values run through the int8 kernels as two byte planes
// (linear_vnni.h, quantize_block16): the same integer block sums as matmul_deq, from
// vpdpbusd instead of vpmaddwd, against the weight bytes those kernels already prepare.
#if defined(HIPC_ISA_AVX512)
inline void matmul_a16_q4_0(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  detail::q_matmul<detail::KQ4_0, 2>(x, T, K, W, N, y, ldy);
}
inline void matmul_a16_q4_1(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  detail::q_matmul<detail::KQ4_1, 2>(x, T, K, W, N, y, ldy);
}
inline void matmul_a16_q8_0(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  detail::q_matmul<detail::KQ8_0, 2>(x, T, K, W, N, y, ldy);
}
#else
inline void matmul_a16_q4_0(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_deq<block_q4_0>(x, T, K, W, N, y, ldy);
}
inline void matmul_a16_q4_1(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_deq<block_q4_1>(x, T, K, W, N, y, ldy);
}
inline void matmul_a16_q8_0(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_deq<block_q8_0>(x, T, K, W, N, y, ldy);
}
#endif
// dense weights have no activation quantization to begin with
inline void matmul_a16_f32(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_f32(x, T, K, W, N, y, ldy);
}
inline void matmul_a16_f16(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_f16(x, T, K, W, N, y, ldy);
}
inline void matmul_a16_bf16(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  matmul_bf16(x, T, K, W, N, y, ldy);
}

}  // namespace hipc
