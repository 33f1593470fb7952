// linear_kquant.h -- matmuls and embedding gathers for Q5_0, Q5_1, IQ4_NL, IQ4_XS and
// the K-quants (Q3_K, Q4_K, Q5_K, Q6_K). Apart from linear_vnni.h / linear_avx2.h because these types share
// one shape the 32-blocks of Q4_0/Q4_1/Q8_0 do not have: scales that change every 16 or
// 32 elements inside a block, read from packed 6-bit or int8 fields. One kernel serves
// them all: a block is w = q * s[e / 16] + m[e / 32] (int16 values q, a float scale per
// 16 elements, an offset per 32). Decode (T < 8) dots q with integer activations, on
// AVX512 widening each 32-unit straight into registers (kq_tile_reg). Prefill (T >= 8)
// unpacks slabs of 16 rows once: IQ4_NL on AVX512 into int16 pairs for vpdpwssd (the
// decode path's integer math, rows in lanes), everything else into f32 for the dense
// tile (x not rounded). On AVX512 (int16 or int8 activations), Q5_0/Q5_1 leave for the VNNI
// byte-plane kernels of linear_vnni.h, and the K-quants for linear_vnni_k.h's (kq_matmul).
#pragma once

#include <type_traits>

namespace hipc {

namespace detail {

// A block unpacked: w[e] = q[e] * s[e / 16] + m[e / 32] (the s of both halves of a 32
// unit are equal for every type but Q6_K).
template <int QK>
struct Unpacked {
  alignas(64) int16_t q[QK];
  float s[QK / 16];
  float m[QK / 32];
};

// QK: elements per block; kMin: an offset per 32; kHalves: the scale changes inside a 32-unit
template <class B> struct KTraits;
template <int N, bool M, bool H = false>
struct KShape {
  static constexpr int QK = N;
  static constexpr bool kMin = M, kHalves = H;
};
template <> struct KTraits<block_q5_0> : KShape<32, false> {};
template <> struct KTraits<block_q5_1> : KShape<32, true> {};
template <> struct KTraits<block_iq4_nl> : KShape<32, false> {};
template <> struct KTraits<block_iq4_xs> : KShape<256, false> {};
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

inline void unpack(const block_q3_k& b, Unpacked<256>& u) {
  for (int j = 0; j < 8; ++j) {
    const uint8_t* qs = b.qs + 32 * (j >> 2);
    const int shift = 2 * (j & 3);
    int16_t* q = u.q + 32 * j;
#pragma omp simd
    for (int i = 0; i < 32; ++i) q[i] = (int16_t)(((qs[i] >> shift) & 3) - ((b.hmask[i] >> j) & 1 ? 0 : 4));
  }
  q3_k_scales(b, u.s);
  for (int j = 0; j < 8; ++j) u.m[j] = 0.f;
}

#if defined(HIPC_ISA_AVX512)
// Decode (AVX512): 32-unit j of a block straight into 32 int16 lanes, no trip through
// memory: byte ops on the packed fields, then one widening. Scales come from scales().
inline __m512i w16_nibbles(__m128i q16, __m256i bits, __mmask32 high, int bias) {
  const __m128i m4 = _mm_set1_epi8(15);
  __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q16, 4), m4), _mm_and_si128(q16, m4));
  v = _mm256_mask_add_epi8(v, high, v, bits);  // v <= 15: adding 16 sets bit 4
  return _mm512_sub_epi16(_mm512_cvtepu8_epi16(v), _mm512_set1_epi16((short)bias));
}
inline __m512i w16(const block_q5_0& b, int) {
  return w16_nibbles(_mm_loadu_si128((const __m128i*)b.qs), _mm256_set1_epi8(16), (__mmask32)load_u32(b.qh), 16);
}
inline __m512i w16(const block_q5_1& b, int) {
  return w16_nibbles(_mm_loadu_si128((const __m128i*)b.qs), _mm256_set1_epi8(16), (__mmask32)load_u32(b.qh), 0);
}
// IQ4_NL: the nibbles (as Q4_0's) index the 16-value table, one byte shuffle; IQ4_XS:
// sub-block j is such a block's nibbles at qs + 16j
inline __m512i iq4_w16(const uint8_t* qs) {
  const __m128i q16 = _mm_loadu_si128((const __m128i*)qs), m4 = _mm_set1_epi8(15);
  const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q16, 4), m4), _mm_and_si128(q16, m4));
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)kIq4nlValues));
  return _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, idx));
}
inline __m512i w16(const block_iq4_nl& b, int) { return iq4_w16(b.qs); }
inline __m512i w16(const block_iq4_xs& b, int j) { return iq4_w16(b.qs + 16 * j); }
// K-quants: unit j = 2c + h is nibble h of qs[32c .. 32c+31]
inline __m256i k_nibbles(const uint8_t* qs, int j) {
  const __m256i q = _mm256_loadu_si256((const __m256i*)(qs + 32 * (j >> 1)));
  return _mm256_and_si256(_mm256_srli_epi16(q, 4 * (j & 1)), _mm256_set1_epi8(15));
}
inline __m512i w16(const block_q4_k& b, int j) { return _mm512_cvtepu8_epi16(k_nibbles(b.qs, j)); }
inline __m512i w16(const block_q5_k& b, int j) {
  const __mmask32 high = _mm256_test_epi8_mask(_mm256_loadu_si256((const __m256i*)b.qh), _mm256_set1_epi8((char)(1 << j)));
  const __m256i v = k_nibbles(b.qs, j);
  return _mm512_cvtepu8_epi16(_mm256_mask_add_epi8(v, high, v, _mm256_set1_epi8(16)));
}
// Q3_K: unit j = 4h + k: bits 2k of qs[32h + i], less 4 where bit j of hmask[i] is clear
inline __m512i w16(const block_q3_k& b, int j) {
  const __m256i q = _mm256_loadu_si256((const __m256i*)(b.qs + 32 * (j >> 2)));
  const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(q, 2 * (j & 3)), _mm256_set1_epi8(3));
  const __mmask32 high = _mm256_test_epi8_mask(_mm256_loadu_si256((const __m256i*)b.hmask), _mm256_set1_epi8((char)(1 << j)));
  return _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_mask_add_epi8(lo, high, lo, _mm256_set1_epi8(4))), _mm512_set1_epi16(4));
}
// Q6_K: unit j = 4h + k holds elements 32k.. of half h: low nibble (k >> 1) of
// ql[64h + 32(k & 1) + i], top bits 2k of qh[32h + i]
inline __m512i w16(const block_q6_k& b, int j) {
  const int h = j >> 2, k = j & 3;
  const __m256i lo = _mm256_and_si256(
      _mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)(b.ql + 64 * h + 32 * (k & 1))), 4 * (k >> 1)),
      _mm256_set1_epi8(15));
  const __m256i hi = _mm256_and_si256(
      _mm256_slli_epi16(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)(b.qh + 32 * h)), 2 * k), 4),
      _mm256_set1_epi8(0x30));
  return _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_or_si256(lo, hi)), _mm512_set1_epi16(32));
}

// The per-16 scales and per-32 offsets of a block (what unpack() writes besides q).
inline void scales(const block_q5_0& b, float* s, float* m) { s[0] = s[1] = fp16_to_fp32(b.d), m[0] = 0.f; }
inline void scales(const block_iq4_nl& b, float* s, float* m) { s[0] = s[1] = fp16_to_fp32(b.d), m[0] = 0.f; }
inline void scales(const block_iq4_xs& b, float* s, float* m) {
  for (int j = 0; j < 8; ++j) s[2 * j] = s[2 * j + 1] = iq4_xs_scale(b, j), m[j] = 0.f;
}
inline void scales(const block_q5_1& b, float* s, float* m) {
  s[0] = s[1] = fp16_to_fp32(b.d), m[0] = fp16_to_fp32(b.m);
}
inline void scales(const block_q4_k& b, float* s, float* m) { k_scales(b.scales, b.d, b.dmin, s, m); }
inline void scales(const block_q5_k& b, float* s, float* m) { k_scales(b.scales, b.d, b.dmin, s, m); }
inline void scales(const block_q3_k& b, float* s, float* m) {
  q3_k_scales(b, s);
  for (int j = 0; j < 8; ++j) m[j] = 0.f;
}
inline void scales(const block_q6_k& b, float* s, float* m) {
  const float d = fp16_to_fp32(b.d);
  for (int j = 0; j < 16; ++j) s[j] = d * (float)b.scales[j];
  for (int j = 0; j < 8; ++j) m[j] = 0.f;
}

// The decode GEMV tile (TN tokens, TN small): as kq_tile below, with the units widened
// in registers. Q3_K and Q6_K change scale inside a 32-unit (lanes 8..15 hold its second
// 16 elements' pair sums).
template <class B, int R, int TN>
inline void kq_tile_reg(const B* rows, size_t row_stride, const Act16& a, int t0, float* y, int ldy) {
  constexpr int QK = KTraits<B>::QK, U = QK / 32;
  constexpr bool kHalves = KTraits<B>::kHalves;
  const int nsb = a.nb / U;
  __m512 acc[R][TN];
  float macc[R][TN];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TN; ++t) acc[r][t] = _mm512_setzero_ps(), macc[r][t] = 0.f;
  for (int b = 0; b < nsb; ++b) {
    for (int r = 0; r < R; ++r) {
      const B& blk = rows[r * row_stride + b];
      _mm_prefetch((const char*)(&blk + (QK == 256 ? 4 : 16)), _MM_HINT_T0);
      float s[QK / 16], m[QK / 32];
      scales(blk, s, m);
      for (int j = 0; j < U; ++j) {
        const __m512i w = w16(blk, j);
        for (int t = 0; t < TN; ++t) {
          const size_t i = (size_t)(t0 + t) * a.nb + (size_t)b * U + j;
          const __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512((const void*)(a.q + i * 32))));
          __m512 sv;
          if constexpr (kHalves)
            sv = _mm512_mul_ps(_mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[2 * j]), _mm512_set1_ps(s[2 * j + 1])),
                               _mm512_set1_ps(a.scale[i]));
          else
            sv = _mm512_set1_ps(s[2 * j] * a.scale[i]);
          acc[r][t] = _mm512_fmadd_ps(p, sv, acc[r][t]);
          if constexpr (KTraits<B>::kMin) macc[r][t] += m[j] * a.sum[i];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TN; ++t) y[(size_t)t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]) + macc[r][t];
}
#endif

// R weight rows x TN tokens. Per 32-unit j of a block and token t (activation block i):
//   y += dx[i] * (s[2j] * sum_{e<16} q[e] x[e] + s[2j+1] * sum_{e>=16} q[e] x[e]) + m[j] * sum(x)
// The integer sums are exact (|q| <= 32, |x| <= 32767: 16 * 32 * 32767 < 2^31).
// The R rows' blocks are unpacked once and reused for all TN tokens; R streams of loads
// keep the memory system busy in the decode GEMV. (AVX512 uses kq_tile_reg.)
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
    float* o = out + (size_t)i * QK;
#pragma omp simd
    for (int e = 0; e < QK; ++e) o[e] = (float)u.q[e] * u.s[e / 16] + u.m[e / 32];
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
  constexpr int S = kDequantRows, R = 4, QK = KTraits<B>::QK;
#if defined(HIPC_ISA_AVX512)
  constexpr int C = 6;
#else
  constexpr int C = 4;
#endif
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

#if defined(HIPC_ISA_AVX512)
// Prefill on AVX512-VNNI, "row lanes" over int16 pairs: a slab of 16 rows is unpacked
// once into wp[unit j][pair p][row r] = (q[32j+2p], q[32j+2p+1]) as one int32, so
// vpdpwssd against a broadcast pair of x's int16 values adds two products to each row's
// lane (32 multiply-adds per instruction, exact in int32: 16 pairs x 2 x 32 x 32767).
// Per unit the int32 sums are scaled by the rows' s (per 16-half for Q6_K) times x's
// block scale, plus m * sum(x): the decode path's math, with every row at once.
struct PairSlab {
  int32_t* w;  // [nb][16][16]
  float* s;  // [nb][2][16]: scale of elements 0..15 and 16..31 of unit j, per row
  float* m;  // [nb][16]
};

template <class B>
inline void pair_slab(const B* rows, size_t rb, int nr, int nb, const PairSlab& ps) {
  constexpr int QK = KTraits<B>::QK, U = QK / 32;
  Unpacked<QK> u;
  for (int r = 0; r < 16; ++r) {
    for (size_t b = 0; b < rb; ++b) {
      if (r < nr) {
        unpack(rows[(size_t)r * rb + b], u);
      } else {
        std::memset(&u, 0, sizeof(u));
      }
      for (int jj = 0; jj < U; ++jj) {
        const int j = (int)b * U + jj;
        for (int p = 0; p < 16; ++p)
          ps.w[(j * 16 + p) * 16 + r] =
              (int32_t)((uint32_t)(uint16_t)u.q[32 * jj + 2 * p] | ((uint32_t)(uint16_t)u.q[32 * jj + 2 * p + 1] << 16));
        ps.s[j * 32 + r] = u.s[2 * jj];
        ps.s[j * 32 + 16 + r] = u.s[2 * jj + 1];
        ps.m[j * 16 + r] = u.m[jj];
      }
    }
  }
  (void)nb;
}

template <class B, int C>
inline void pair_tile(const PairSlab& ps, int nb, int K, const Act16& a, int t0, int nr, float* y, int ldy) {
  constexpr bool kHalves = KTraits<B>::kHalves;
  __m512 facc[C];
  for (int c = 0; c < C; ++c) facc[c] = _mm512_setzero_ps();
  for (int j = 0; j < nb; ++j) {
    __m512i ilo[C], ihi[C];
    for (int c = 0; c < C; ++c) ilo[c] = ihi[c] = _mm512_setzero_si512();
    const int32_t* w = ps.w + (size_t)j * 256;
    for (int p = 0; p < 16; ++p) {
      const __m512i wv = _mm512_load_si512((const void*)(w + 16 * p));
      for (int c = 0; c < C; ++c) {
        int32_t xp;
        std::memcpy(&xp, a.q + (size_t)(t0 + c) * K + 32 * j + 2 * p, 4);
        if (kHalves && p >= 8)
          ihi[c] = _mm512_dpwssd_epi32(ihi[c], wv, _mm512_set1_epi32(xp));
        else
          ilo[c] = _mm512_dpwssd_epi32(ilo[c], wv, _mm512_set1_epi32(xp));
      }
    }
    const __m512 slo = _mm512_load_ps(ps.s + j * 32), shi = _mm512_load_ps(ps.s + j * 32 + 16);
    const __m512 mv = _mm512_load_ps(ps.m + j * 16);
    for (int c = 0; c < C; ++c) {
      const size_t i = (size_t)(t0 + c) * nb + j;
      const __m512 dx = _mm512_set1_ps(a.scale[i]);
      facc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ilo[c]), _mm512_mul_ps(slo, dx), facc[c]);
      if constexpr (kHalves) facc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ihi[c]), _mm512_mul_ps(shi, dx), facc[c]);
      if constexpr (KTraits<B>::kMin) facc[c] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.sum[i]), facc[c]);
    }
  }
  const __mmask16 keep = (__mmask16)((1u << nr) - 1);
  for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(y + (size_t)(t0 + c) * ldy, keep, facc[c]);
}

template <class B>
inline void kq_matmul_pairs(const float* x, int T, int K, const B* Wb, int N, float* y, int ldy, float qmax) {
  constexpr int QK = KTraits<B>::QK, C = 4;
  const Act16 a = quantize_act16(x, T, K, qmax);
  const int nb = K / 32, slabs = (N + 15) / 16;
  const size_t rb = (size_t)K / QK;
#pragma omp parallel
  {
    uint8_t* mem = scratch(1, (size_t)nb * (256 * 4 + 48 * 4));
    const PairSlab ps{(int32_t*)mem, (float*)(mem + (size_t)nb * 1024), (float*)(mem + (size_t)nb * 1024 + (size_t)nb * 128)};
#pragma omp for schedule(static)
    for (int g = 0; g < slabs; ++g) {
      const int n0 = 16 * g, nr = std::min(16, N - n0);
      pair_slab(Wb + (size_t)n0 * rb, rb, nr, nb, ps);
      int t = 0;
      for (; t + C <= T; t += C) pair_tile<B, C>(ps, nb, K, a, t, nr, y + n0, ldy);
      for (; t < T; ++t) pair_tile<B, 1>(ps, nb, K, a, t, nr, y + n0, ldy);
    }
  }
}
#endif

// Driver. Decode and short prefills: x rounded to integers per 32-block (qmax 32767:
// int16, 127: int8, the --activations choice), then `omp for` over tiles of R rows
// (kq_tile_reg on AVX512, kq_tile elsewhere). Longer prefills: kq_matmul_dequant.
template <class B>
inline void kq_matmul(const float* x, int T, int K, const void* W, int N, float* y, int ldy, float qmax) {
  constexpr int R = 4, QK = KTraits<B>::QK;
  const B* Wb = (const B*)W;
#if defined(HIPC_ISA_AVX512)
  // Q5_0/Q5_1: the Q4 byte-plane VNNI kernels (linear_vnni.h KQ5_0/KQ5_1), GEMV and
  // row-lane GEMM, int8 activations in the int16 planes too. NOTE: measured on the SmolLM2
  // Q4_K_M file (one core, int16): decode 65 -> 69 tok/s over kq_tile_reg, prefill 440 -> 532
  // over the pairs; int8 without row lanes (Intel Xeon): decode 93 -> 155 tok/s
  if constexpr (std::is_same<B, block_q5_0>::value) return q_matmul<KQ5_0, 2>(x, T, K, W, N, y, ldy, qmax);
  if constexpr (std::is_same<B, block_q5_1>::value) return q_matmul<KQ5_1, 2>(x, T, K, W, N, y, ldy, qmax);
  // IQ4_NL: Q8_0's kernels on its table values (KIQ4NL)
  if constexpr (std::is_same<B, block_iq4_nl>::value) return q_matmul<KIQ4NL, 2>(x, T, K, W, N, y, ldy, qmax);
  // Q3_K/Q4_K/Q5_K/Q6_K: linear_vnni_k.h, int8 activations too (as int16 planes). NOTE: measured
  // on the SmolLM2 Q4_K_M file with int8 (Intel Xeon, engine loop) over kq_tile_reg and the
  // f32 prefill: decode 122 -> 183 tok/s on one core (int16: 190), 266 -> 360 on two,
  // 128-token prefill 911 -> 1,244
  if constexpr (std::is_same<B, block_q3_k>::value) return ks_matmul<KSQ3K>(x, T, K, W, N, y, ldy, qmax);
  if constexpr (std::is_same<B, block_q4_k>::value) return ks_matmul<KSQ4K>(x, T, K, W, N, y, ldy, qmax);
  if constexpr (std::is_same<B, block_q5_k>::value) return ks_matmul<KSQ5K>(x, T, K, W, N, y, ldy, qmax);
  if constexpr (std::is_same<B, block_q6_k>::value) return ks_matmul<KSQ6K>(x, T, K, W, N, y, ldy, qmax);
  // IQ4_XS likewise (KSIQ4XS: signed table values, the low plane's dot on v itself). NOTE:
  // measured with bench_cpu_kquant_types.py (Intel Xeon, 2 layers of 2048 x 5632) over
  // kq_tile_reg: decode 146 -> 241 tok/s on one core, 272 -> 423 on two
  if constexpr (std::is_same<B, block_iq4_xs>::value) return ks_matmul<KSIQ4XS>(x, T, K, W, N, y, ldy, qmax);
  // NOTE: measured on SmolLM2 shapes (one core): pairs 71 vs f32 49 GMAC/s for Q5_0, but
  // 47 vs 53 for the K-quants, whose 256-wide rows make a slab spill L1
  if (T >= kDequantMinT && QK == 32) return kq_matmul_pairs<B>(x, T, K, Wb, N, y, ldy, qmax);
#endif
  if (T >= kDequantMinT) return kq_matmul_dequant<B>(x, T, K, Wb, N, y, ldy);
  const Act16 a = quantize_act16(x, T, K, qmax);
  const size_t rb = (size_t)K / QK;
  const int groups = (N + R - 1) / R;
#pragma omp parallel for schedule(static) if ((size_t)N * K * T > 65536)
  for (int g = 0; g < groups; ++g) {
    const int n0 = g * R;
    if (n0 + R <= N) {
      const B* rows = Wb + (size_t)n0 * rb;
#if defined(HIPC_ISA_AVX512)
      for (int t = 0; t < T; ++t) kq_tile_reg<B, R, 1>(rows, rb, a, t, y + (size_t)t * ldy + n0, ldy);
#else
      int t = 0;
      for (; t + 4 <= T; t += 4) kq_tile<B, R, 4>(rows, rb, a, t, y + (size_t)t * ldy + n0, ldy);
      for (; t < T; ++t) kq_tile<B, R, 1>(rows, rb, a, t, y + (size_t)t * ldy + n0, ldy);
#endif
    } else {
      for (int n = n0; n < N; ++n)
        for (int t = 0; t < T; ++t) {
#if defined(HIPC_ISA_AVX512)
          kq_tile_reg<B, 1, 1>(Wb + (size_t)n * rb, rb, a, t, y + (size_t)t * ldy + n, ldy);
#else
          kq_tile<B, 1, 1>(Wb + (size_t)n * rb, rb, a, t, y + (size_t)t * ldy + n, ldy);
#endif
        }
    }
  }
}

template <class B>
inline void kq_embed_row(const void* W, int K, int64_t row, float* out) {
  constexpr int QK = KTraits<B>::QK;
  const B* b = (const B*)W + row * (K / QK);
  Unpacked<QK> u;
  for (int i = 0; i < K / QK; ++i) {
    unpack(b[i], u);
    for (int e = 0; e < QK; ++e) out[QK * i + e] = (float)u.q[e] * u.s[e / 16] + u.m[e / 32];
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
HIPC_KQUANT_ENTRY(q3_k, block_q3_k)
HIPC_KQUANT_ENTRY(q4_k, block_q4_k)
HIPC_KQUANT_ENTRY(q5_k, block_q5_k)
HIPC_KQUANT_ENTRY(q6_k, block_q6_k)
#undef HIPC_KQUANT_ENTRY

}  // namespace hipc
