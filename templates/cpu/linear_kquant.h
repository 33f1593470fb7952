// linear_kquant.h -- matmuls and embedding gathers for Q5_0, Q5_1, IQ4_NL, IQ4_XS and
// the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K). Apart from linear_vnni.h / linear_avx2.h
// because these types share one shape the 32-blocks of Q4_0/Q4_1/Q8_0 do not have: scales
// that change every 16 or 32 elements inside a block, read from packed 4-bit, 6-bit or int8
// fields. On AVX512-VNNI each type runs a byte-plane kernel (kq_matmul: Q5_0/Q5_1/IQ4_NL
// linear_vnni.h's, the K-quants and IQ4_XS linear_vnni_k.h's). Elsewhere one kernel serves
// them all: a block is w = q * s[e / 16] + m[e / 32] (int16 values q, a float scale per 16
// elements, an offset per 32; Q2_K's offset changes every 16: m16[e / 16]); decode (T < 8)
// dots q with integer activations (kq_tile), prefill (T >= 8) dequantizes slabs of 16 rows
// once into f32 for the dense tile (x not rounded).
#pragma once

#include <type_traits>

namespace hipc {

namespace detail {

// A block unpacked: w[e] = q[e] * s[e / 16] + m[e / 32] (the s of both halves of a 32
// unit are equal for every type but Q3_K, Q6_K and Q2_K), + m16[e / 16] for Q2_K only.
template <int QK>
struct Unpacked {
  alignas(64) int16_t q[QK];
  float s[QK / 16];
  float m[QK / 32];
  float m16[QK / 16];
};

// QK: elements per block; kMin: an offset per 32; kHalves: the scale changes inside a
// 32-unit; kMin16: an offset per 16 instead (Q2_K)
template <class B> struct KTraits;
template <int N, bool M, bool H = false, bool M16 = false>
struct KShape {
  static constexpr int QK = N;
  static constexpr bool kMin = M, kHalves = H, kMin16 = M16;
};
template <> struct KTraits<block_q5_0> : KShape<32, false> {};
template <> struct KTraits<block_q5_1> : KShape<32, true> {};
template <> struct KTraits<block_iq4_nl> : KShape<32, false> {};
template <> struct KTraits<block_iq4_xs> : KShape<256, false> {};
template <> struct KTraits<block_q2_k> : KShape<256, false, true, true> {};
template <> struct KTraits<block_q3_k> : KShape<256, false, true> {};
template <> struct KTraits<block_q4_k> : KShape<256, true> {};
template <> struct KTraits<block_q5_k> : KShape<256, true> {};
template <> struct KTraits<block_q6_k> : KShape<256, false, true> {};

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The 5-bit legacy blocks: element j's fifth bit is bit j of qh.
inline void unpack5(const uint8_t* qh4, const uint8_t* qs, int bias, int16_t* q) {
  const uint32_t qh = load_u32(qh4);
#pragma omp simd
  for (int j = 0; j < 16; ++j) {
    q[j] = (int16_t)(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - bias);
    q[j + 16] = (int16_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
  }
}

inline void unpack(const block_q5_0& b, Unpacked<32>& u) {
  unpack5(b.qh, b.qs, 16, u.q);
  u.s[0] = u.s[1] = fp16_to_fp32(b.d);
  u.m[0] = 0.f;
}

inline void unpack(const block_iq4_nl& b, Unpacked<32>& u) {
#pragma omp simd
  for (int j = 0; j < 16; ++j) {
    u.q[j] = kIq4nlValues[b.qs[j] & 15];
    u.q[j + 16] = kIq4nlValues[b.qs[j] >> 4];
  }
  u.s[0] = u.s[1] = fp16_to_fp32(b.d);
  u.m[0] = 0.f;
}

// IQ4_XS sub-block j's scale: d * (ls - 32), ls its 6 bits from scales_l and scales_h
inline float iq4_xs_scale(const block_iq4_xs& b, int j) {
  const int ls = ((b.scales_l[j / 2] >> (4 * (j % 2))) & 15) | (((b.scales_h >> (2 * j)) & 3) << 4);
  return fp16_to_fp32(b.d) * (float)(ls - 32);
}

inline void unpack(const block_iq4_xs& b, Unpacked<256>& u) {
  for (int j = 0; j < 8; ++j) {
    const uint8_t* qs = b.qs + 16 * j;
#pragma omp simd
    for (int i = 0; i < 16; ++i) {
      u.q[32 * j + i] = kIq4nlValues[qs[i] & 15];
      u.q[32 * j + 16 + i] = kIq4nlValues[qs[i] >> 4];
    }
    u.s[2 * j] = u.s[2 * j + 1] = iq4_xs_scale(b, j);
    u.m[j] = 0.f;
  }
}

inline void unpack(const block_q5_1& b, Unpacked<32>& u) {
  unpack5(b.qh, b.qs, 0, u.q);
  u.s[0] = u.s[1] = fp16_to_fp32(b.d);
  u.m[0] = fp16_to_fp32(b.m);
}

// 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block (layout: blocks.h).
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

inline void k_scales(const uint8_t* scales, uint16_t d16, uint16_t dmin16, float* s, float* m) {
  const float d = fp16_to_fp32(d16), dmin = fp16_to_fp32(dmin16);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    k_scale_min(scales, j, sc, mn);
    s[2 * j] = s[2 * j + 1] = d * (float)sc;
    m[j] = -(dmin * (float)mn);
  }
}

inline void unpack(const block_q4_k& b, Unpacked<256>& u) {
  for (int c = 0; c < 4; ++c) {
    const uint8_t* qs = b.qs + 32 * c;
    int16_t* q = u.q + 64 * c;
#pragma omp simd
    for (int i = 0; i < 32; ++i) {
      q[i] = (int16_t)(qs[i] & 15);
      q[i + 32] = (int16_t)(qs[i] >> 4);
    }
  }
  k_scales(b.scales, b.d, b.dmin, u.s, u.m);
}

inline void unpack(const block_q5_k& b, Unpacked<256>& u) {
  for (int c = 0; c < 4; ++c) {
    const uint8_t* qs = b.qs + 32 * c;
    int16_t* q = u.q + 64 * c;
#pragma omp simd
    for (int i = 0; i < 32; ++i) {
      q[i] = (int16_t)((qs[i] & 15) | (((b.qh[i] >> (2 * c)) & 1) << 4));
      q[i + 32] = (int16_t)((qs[i] >> 4) | (((b.qh[i] >> (2 * c + 1)) & 1) << 4));
    }
  }
  k_scales(b.scales, b.d, b.dmin, u.s, u.m);
}

inline void unpack(const block_q6_k& b, Unpacked<256>& u) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b.ql + 64 * h;
    const uint8_t* qh = b.qh + 32 * h;
    int16_t* q = u.q + 128 * h;
#pragma omp simd
    for (int i = 0; i < 32; ++i) {
      q[i] = (int16_t)(((ql[i] & 15) | ((qh[i] & 3) << 4)) - 32);
      q[i + 32] = (int16_t)(((ql[i + 32] & 15) | (((qh[i] >> 2) & 3) << 4)) - 32);
      q[i + 64] = (int16_t)(((ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4)) - 32);
      q[i + 96] = (int16_t)(((ql[i + 32] >> 4) | (((qh[i] >> 6) & 3) << 4)) - 32);
    }
  }
  const float d = fp16_to_fp32(b.d);
  for (int j = 0; j < 16; ++j) u.s[j] = d * (float)b.scales[j];
  for (int j = 0; j < 8; ++j) u.m[j] = 0.f;
}

// Q3_K sub-block n's scale: d * (sc - 32), sc its 6 bits (blocks.h)
inline void q3_k_scales(const block_q3_k& b, float* s) {
  const float d = fp16_to_fp32(b.d);
  for (int n = 0; n < 16; ++n) {
    const int lo = n < 8 ? b.scales[n] & 15 : b.scales[n - 8] >> 4;
    const int hi = (b.scales[8 + n % 4] >> (2 * (n / 4))) & 3;
    s[n] = d * (float)((lo | hi << 4) - 32);
  }
}

// Element i of 32-unit j of a super-block's 2-bit fields (Q3_K's low bits, Q2_K's values):
// bits 2 * (j % 4) of qs[32 * (j / 4) + i]
inline int two_bits(const uint8_t* qs, int j, int i) { return (qs[32 * (j >> 2) + i] >> (2 * (j & 3))) & 3; }

inline void unpack(const block_q3_k& b, Unpacked<256>& u) {
  for (int j = 0; j < 8; ++j) {
    int16_t* q = u.q + 32 * j;
#pragma omp simd
    for (int i = 0; i < 32; ++i) q[i] = (int16_t)(two_bits(b.qs, j, i) - ((b.hmask[i] >> j) & 1 ? 0 : 4));
  }
  q3_k_scales(b, u.s);
  for (int j = 0; j < 8; ++j) u.m[j] = 0.f;
}

// Q2_K: 2-bit q under a 4-bit scale and min per 16 (blocks.h)
inline void unpack(const block_q2_k& b, Unpacked<256>& u) {
  for (int j = 0; j < 8; ++j) {
    int16_t* q = u.q + 32 * j;
#pragma omp simd
    for (int i = 0; i < 32; ++i) q[i] = (int16_t)two_bits(b.qs, j, i);
    u.m[j] = 0.f;
  }
  const float d = fp16_to_fp32(b.d), dmin = fp16_to_fp32(b.dmin);
  for (int n = 0; n < 16; ++n) {
    u.s[n] = d * (float)(b.scales[n] & 15);
    u.m16[n] = -(dmin * (float)(b.scales[n] >> 4));
  }
}

// The QK weights of an unpacked block of type B into o
template <class B, int QK>
inline void dequant_unpacked(const Unpacked<QK>& u, float* o) {
  if constexpr (KTraits<B>::kMin16) {
#pragma omp simd
    for (int e = 0; e < QK; ++e) o[e] = (float)u.q[e] * u.s[e / 16] + u.m16[e / 16];
  } else {
#pragma omp simd
    for (int e = 0; e < QK; ++e) o[e] = (float)u.q[e] * u.s[e / 16] + u.m[e / 32];
  }
}

// R weight rows x TN tokens. Per 32-unit j of a block and token t (activation block i):
//   y += dx[i] * (s[2j] * sum_{e<16} q[e] x[e] + s[2j+1] * sum_{e>=16} q[e] x[e]) + m[j] * sum(x)
// (Q2_K: + dx[i] * (m16[2j] * sum_{e<16} x[e] + m16[2j+1] * sum_{e>=16} x[e]), x as rounded)
// The integer sums are exact (|q| <= 32, |x| <= 32767: 16 * 32 * 32767 < 2^31).
// The R rows' blocks are unpacked once and reused for all TN tokens; R streams of loads
// keep the memory system busy in the decode GEMV. (AVX512-VNNI runs the byte-plane kernels.)
template <class B, int R, int TN>
inline void kq_tile(const B* rows, size_t row_stride, const Act16& a, int t0, float* y, int ldy) {
  constexpr int QK = KTraits<B>::QK, U = QK / 32;
  const int nsb = a.nb / U;
  Unpacked<QK> u[R];
  float macc[R][TN];
#if defined(HIPC_ISA_AVX2)
  __m256 acc[R][TN];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TN; ++t) acc[r][t] = _mm256_setzero_ps(), macc[r][t] = 0.f;
#else
  float acc[R][TN];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TN; ++t) acc[r][t] = 0.f, macc[r][t] = 0.f;
#endif
  for (int b = 0; b < nsb; ++b) {
    for (int r = 0; r < R; ++r) {
      const B* blk = rows + r * row_stride + b;
      __builtin_prefetch(blk + (QK == 256 ? 2 : 8));
      unpack(*blk, u[r]);
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < U; ++j) {
        const int16_t* wq = u[r].q + 32 * j;
        const float slo = u[r].s[2 * j], shi = u[r].s[2 * j + 1];
#if defined(HIPC_ISA_AVX2)
        const __m256i wl = _mm256_load_si256((const __m256i*)wq);
        const __m256i wh = _mm256_load_si256((const __m256i*)(wq + 16));
#endif
        for (int t = 0; t < TN; ++t) {
          const size_t i = (size_t)(t0 + t) * a.nb + (size_t)b * U + j;
          const int16_t* xq = a.q + i * 32;
#if defined(HIPC_ISA_AVX2)
          const __m256 pl = _mm256_cvtepi32_ps(_mm256_madd_epi16(wl, _mm256_loadu_si256((const __m256i*)xq)));
          const __m256 ph = _mm256_cvtepi32_ps(_mm256_madd_epi16(wh, _mm256_loadu_si256((const __m256i*)(xq + 16))));
          const float dx = a.scale[i];
          acc[r][t] = _mm256_fmadd_ps(pl, _mm256_set1_ps(slo * dx), acc[r][t]);
          acc[r][t] = _mm256_fmadd_ps(ph, _mm256_set1_ps(shi * dx), acc[r][t]);
#else
          int32_t lo = 0, hi = 0;
          for (int e = 0; e < 16; ++e) lo += (int32_t)wq[e] * xq[e];
          for (int e = 16; e < 32; ++e) hi += (int32_t)wq[e] * xq[e];
          acc[r][t] += a.scale[i] * (slo * (float)lo + shi * (float)hi);
#endif
          if constexpr (KTraits<B>::kMin) macc[r][t] += u[r].m[j] * a.sum[i];
          if constexpr (KTraits<B>::kMin16) {
            int32_t xlo = 0, xhi = 0;
            for (int e = 0; e < 16; ++e) xlo += xq[e], xhi += xq[e + 16];
            macc[r][t] += a.scale[i] * (u[r].m16[2 * j] * (float)xlo + u[r].m16[2 * j + 1] * (float)xhi);
          }
        }
      }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TN; ++t) {
#if defined(HIPC_ISA_AVX2)
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r][t]), _mm256_extractf128_ps(acc[r][t], 1));
      const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
      const float s = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#else
      const float s = acc[r][t];
#endif
      y[(size_t)t * ldy + r] = s + macc[r][t];
    }
}

template <class B>
inline void kq_dequant_rows(const B* rows, int K, int R, float* out) {
  constexpr int QK = KTraits<B>::QK;
  Unpacked<QK> u;
  for (int i = 0; i < R * (K / QK); ++i) {
    unpack(rows[i], u);
    dequant_unpacked<B>(u, out + (size_t)i * QK);
  }
}

// Prefill from this many tokens on: each thread dequantizes a tile of kDequantRows rows to
// f32 (in L1/L2) and runs the dense f32 tile over all T tokens. There float FMAs do more
// multiply-adds per instruction than the int16 path's madd + convert + scale, the
// dequantization is amortized over T, and x is not rounded at all.
// A slab of kDequantRows rows is dequantized once; tokens go in chunks of C through
// its 4-row tiles, so a chunk of x stays in L1 while the slab's tiles pass over it.
constexpr int kDequantMinT = 8;
constexpr int kDequantRows = 16;

template <class B>
inline void kq_matmul_dequant(const float* x, int T, int K, const B* Wb, int N, float* y, int ldy) {
  constexpr int S = kDequantRows, R = 4, QK = KTraits<B>::QK, C = 4;
  const size_t rb = (size_t)K / QK;
  const int slabs = (N + S - 1) / S;
#pragma omp parallel
  {
    float* wf = (float*)scratch(1, (size_t)S * K * sizeof(float));
#pragma omp for schedule(static)
    for (int g = 0; g < slabs; ++g) {
      const int n0 = g * S, nr = std::min(S, N - n0);
      kq_dequant_rows(Wb + (size_t)n0 * rb, K, nr, wf);
      int t = 0;
      for (; t + C <= T; t += C) {
        int r = 0;
        for (; r + R <= nr; r += R) d_tile<DF32, R, C>(x, K, wf, r, t, y + n0, ldy);
        for (; r < nr; ++r) d_tile<DF32, 1, C>(x, K, wf, r, t, y + n0, ldy);
      }
      for (; t < T; ++t) {
        int r = 0;
        for (; r + R <= nr; r += R) d_tile<DF32, R, 1>(x, K, wf, r, t, y + n0, ldy);
        for (; r < nr; ++r) d_tile<DF32, 1, 1>(x, K, wf, r, t, y + n0, ldy);
      }
    }
  }
}

// Driver. On AVX512-VNNI every type runs a byte-plane kernel (below). Elsewhere, decode and
// short prefills: x rounded to integers per 32-block (qmax 32767: int16, 127: int8, the
// --activations choice), then `omp for` over kq_tile's tiles of R rows; longer prefills:
// kq_matmul_dequant.
template <class B>
inline void kq_matmul(const float* x, int T, int K, const void* W, int N, float* y, int ldy, float qmax) {
#if defined(HIPC_ISA_AVX512)
  // Q5_0/Q5_1: the Q4 byte-plane VNNI kernels (linear_vnni.h KQ5_0/KQ5_1), GEMV and
  // row-lane GEMM, int8 activations in the int16 planes too. NOTE: measured on the SmolLM2
  // Q4_K_M file (one core, int16): decode 65 -> 69 tok/s over the generic kernel's register
  // tiles, prefill 440 -> 532 over its int16 pairs; int8 without row lanes (Intel Xeon): decode
  // 93 -> 155 tok/s
  if constexpr (std::is_same<B, block_q5_0>::value) return q_matmul<KQ5_0, 2>(x, T, K, W, N, y, ldy, qmax);
  else if constexpr (std::is_same<B, block_q5_1>::value) return q_matmul<KQ5_1, 2>(x, T, K, W, N, y, ldy, qmax);
  // IQ4_NL: Q8_0's kernels on its table values (KIQ4NL). NOTE: measured with
  // bench_cpu_kquant_types.py (Intel Xeon, 2 layers of 2048 x 5632) over the generic kernel:
  // decode 133 -> 212 tok/s on one core, 268 -> 390 on two, prefill 423 -> 969 / 773 -> 1,786
  else if constexpr (std::is_same<B, block_iq4_nl>::value) return q_matmul<KIQ4NL, 2>(x, T, K, W, N, y, ldy, qmax);
  // Q3_K/Q4_K/Q5_K/Q6_K: linear_vnni_k.h, int8 activations too (as int16 planes). NOTE: measured
  // on the SmolLM2 Q4_K_M file with int8 (Intel Xeon, engine loop) over the generic kernel:
  // decode 122 -> 183 tok/s on one core (int16: 190), 266 -> 360 on two, 128-token prefill
  // 911 -> 1,244
  else if constexpr (std::is_same<B, block_q3_k>::value) return ks_matmul<KSQ3K>(x, T, K, W, N, y, ldy, qmax);
  // Q2_K likewise (KSQ2K: its mins per 16-group times x's sums per 16-group)
  else if constexpr (std::is_same<B, block_q2_k>::value) return ks_matmul<KSQ2K>(x, T, K, W, N, y, ldy, qmax);
  else if constexpr (std::is_same<B, block_q4_k>::value) return ks_matmul<KSQ4K>(x, T, K, W, N, y, ldy, qmax);
  else if constexpr (std::is_same<B, block_q5_k>::value) return ks_matmul<KSQ5K>(x, T, K, W, N, y, ldy, qmax);
  else if constexpr (std::is_same<B, block_q6_k>::value) return ks_matmul<KSQ6K>(x, T, K, W, N, y, ldy, qmax);
  // IQ4_XS likewise (KSIQ4XS: signed table values, the low plane's dot on v itself). NOTE:
  // measured as IQ4_NL: decode 99 -> 201 tok/s on one core, 240 -> 373 on two, 64-token
  // prefill 343 -> 922 / 601 -> 1,703
  else if constexpr (std::is_same<B, block_iq4_xs>::value) return ks_matmul<KSIQ4XS>(x, T, K, W, N, y, ldy, qmax);
  else
    static_assert(sizeof(B) == 0, "a block type with no AVX512-VNNI kernel");
#else
  constexpr int R = 4, QK = KTraits<B>::QK;
  const B* Wb = (const B*)W;
  if (T >= kDequantMinT) return kq_matmul_dequant<B>(x, T, K, Wb, N, y, ldy);
  const Act16 a = quantize_act16(x, T, K, qmax);
  const size_t rb = (size_t)K / QK;
  const int groups = (N + R - 1) / R;
#pragma omp parallel for schedule(static) if ((size_t)N * K * T > 65536)
  for (int g = 0; g < groups; ++g) {
    const int n0 = g * R;
    if (n0 + R <= N) {
      const B* rows = Wb + (size_t)n0 * rb;
      int t = 0;
      for (; t + 4 <= T; t += 4) kq_tile<B, R, 4>(rows, rb, a, t, y + (size_t)t * ldy + n0, ldy);
      for (; t < T; ++t) kq_tile<B, R, 1>(rows, rb, a, t, y + (size_t)t * ldy + n0, ldy);
    } else {
      for (int n = n0; n < N; ++n)
        for (int t = 0; t < T; ++t) kq_tile<B, 1, 1>(Wb + (size_t)n * rb, rb, a, t, y + (size_t)t * ldy + n, ldy);
    }
  }
#endif
}

template <class B>
inline void kq_embed_row(const void* W, int K, int64_t row, float* out) {
  constexpr int QK = KTraits<B>::QK;
  const B* b = (const B*)W + row * (K / QK);
  Unpacked<QK> u;
  for (int i = 0; i < K / QK; ++i) {
    unpack(b[i], u);
    dequant_unpacked<B>(u, out + (size_t)QK * i);
  }
}

}  // namespace detail

// y[t, n] = sum_k x[t, k] * W[n, k], W in the named GGUF blocks (K % 32 == 0 for q5_0/q5_1/iq4_nl,
// K % 256 == 0 for the K-quants and iq4_xs). matmul_a16_*: int16 activations (the default);
// matmul_*: int8 ones (--activations int8), the same kernel with x rounded coarser.
#define HIPC_KQUANT_ENTRY(name, B)                                                                     \
  inline void matmul_a16_##name(const float* x, int T, int K, const void* W, int N, float* y, int ldy) { \
    detail::kq_matmul<B>(x, T, K, W, N, y, ldy, 32767.f);                                              \
  }                                                                                                    \
  inline void matmul_##name(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {     \
    detail::kq_matmul<B>(x, T, K, W, N, y, ldy, 127.f);                                                \
  }                                                                                                    \
  inline void embed_row_##name(const void* W, int K, int64_t row, float* out) {                        \
    detail::kq_embed_row<B>(W, K, row, out);                                                           \
  }
HIPC_KQUANT_ENTRY(q5_0, block_q5_0)
HIPC_KQUANT_ENTRY(q5_1, block_q5_1)
HIPC_KQUANT_ENTRY(iq4_nl, block_iq4_nl)
HIPC_KQUANT_ENTRY(iq4_xs, block_iq4_xs)
HIPC_KQUANT_ENTRY(q2_k, block_q2_k)
HIPC_KQUANT_ENTRY(q3_k, block_q3_k)
HIPC_KQUANT_ENTRY(q4_k, block_q4_k)
HIPC_KQUANT_ENTRY(q5_k, block_q5_k)
HIPC_KQUANT_ENTRY(q6_k, block_q6_k)
#undef HIPC_KQUANT_ENTRY

}  // namespace hipc
