// linear_vnni_k.h -- the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_XS on the AVX512-VNNI byte planes.
// Apart from linear_vnni.h because a K-quant scale covers 32 (Q4_K/Q5_K) or 16 (Q6_K)
// elements of a 256-element super-block, read from packed fields, where the 32-blocks
// there carry one f16 scale each; the integer machinery (int16 activations as a signed
// high-byte and an unsigned low-byte plane, vpdpbusd) is the same.
#pragma once

namespace hipc {

#if defined(HIPC_ISA_AVX512)
namespace detail {

// ------------------------------------------------------------------------------------
// Per super-block b of a row and token, with u the unsigned weight bytes as stored
// (Q4_K nibble 0..15, Q5_K 0..31, Q6_K 0..63) and q the token's int16 values:
//   Q4_K/Q5_K: y += sum_{j<8} d*sc[j] * dx[j] * sum_{e in unit j} u*q  -  dmin*mn[j] * s[j]
//   Q6_K:      y += sum_{g<16} d*sc[g] * dx[g/2] * (sum_{e in 16-group g} u*q - 32 * sum q)
//   Q2_K:      y += sum_{g<16} dx[g/2] * (d*sc[g] * sum_{e in 16-group g} u*q - dmin*mn[g] * sum q)
// (s: the float sum of x over 32-unit j, dx its int16 scale.) The integer sums are
// exact: vpdpbusd(u, hi) * 256 + vpdpbusd(lo, u) = sum u*q per 4 elements (u <= 63 is
// its own signed view), and sum q of 4 elements is computed once per token.
//
// Decode ("natural pairs", as linear_vnni.h's): one zmm = 64 consecutive elements of a
// super-block, int32 lane l = elements 4l..4l+3; a lane's f32 scale is its unit's
// (or 16-group's) d*sc, permuted from the 16 scales of the super-block, times dx,
// which the token pack holds per lane (dxl). Prefill ("row lanes", rl_tile): lane =
// output row, 16 rows' units prepped once per slab as WGroups (Q6_K: the two 16-groups
// of a unit in dw and mw, the offsets from the per-16 sums of q; Q2_K's mins per 16-group in
// a WMins beside each WGroup).
// ------------------------------------------------------------------------------------

// Per-token pack extras (QAct::ext), per token row: dxl [K/4] f32 (dx of lane l's unit),
// qs4 [K/4] int32 (sum of q over lane l's 4 elements), qs16 [K/16] int32 (per 16-group),
// and for signed weights (kSignedLo) the high plane's sums: hs4 [K/4] per lane, hsu [K/32]
// per 32-unit.
struct KAct {
  int n4 = 0;  // K / 4
  float* dxl = nullptr;
  int32_t* qs4 = nullptr;
  int32_t* qs16 = nullptr;
  int32_t* hs4 = nullptr;
  int32_t* hsu = nullptr;
};

inline size_t kact_bytes(int T, int K) {
  const size_t n4 = (size_t)K / 4;
  return (size_t)T * (n4 * 12 + n4 + n4 / 8 * 4 + 64) + 128;
}

inline KAct kact(const QAct& a, int T, int K) {
  KAct k;
  k.n4 = K / 4;
  k.dxl = (float*)a.ext;
  k.qs4 = (int32_t*)(k.dxl + (size_t)T * k.n4);
  k.qs16 = k.qs4 + (size_t)T * k.n4;
  k.hs4 = k.qs16 + (size_t)T * (k.n4 / 4);
  k.hsu = k.hs4 + (size_t)T * k.n4;
  return k;
}

// Fill token t's extras from its quantized row (natural block order, ntg = 0); the high
// plane's sums only where the weights are signed (kSignedLo).
template <bool kSignedLo>
inline void kact_row(const QAct& a, const KAct& k, int t) {
  const int8_t* hr = a.q + (size_t)t * a.nbp * 32;
  const uint8_t* lr = a.lo + (size_t)t * a.nbp * 32;
  const float* dr = a.d + (size_t)t * a.nbp;
  float* dxl = k.dxl + (size_t)t * k.n4;
  int32_t* qs4 = k.qs4 + (size_t)t * k.n4;
  int32_t* qs16 = k.qs16 + (size_t)t * (k.n4 / 4);
  int32_t* hs4 = k.hs4 + (size_t)t * k.n4;
  int32_t* hsu = k.hsu + (size_t)t * (k.n4 / 8);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int b = 0; 2 * b < a.nb; ++b) {  // 64 elements (two units) per step; nb is even
    const __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(hr + 64 * b));
    const __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(lr + 64 * b), ones);
    const __m512i s4 = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
    _mm512_storeu_si512(qs4 + 16 * b, s4);
    if constexpr (kSignedLo) {
      _mm512_storeu_si512(hs4 + 16 * b, h);
      hsu[2 * b] = _mm512_mask_reduce_add_epi32(0x00FF, h);
      hsu[2 * b + 1] = _mm512_mask_reduce_add_epi32(0xFF00, h);
    }
    const __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(dr[2 * b]), _mm512_set1_ps(dr[2 * b + 1]));
    _mm512_storeu_ps(dxl + 16 * b, d);
    alignas(64) int32_t v[16];
    _mm512_store_si512(v, s4);
    for (int g = 0; g < 4; ++g) qs16[4 * b + g] = v[4 * g] + v[4 * g + 1] + v[4 * g + 2] + v[4 * g + 3];
  }
}

// pair p of a Q4_K/Q5_K super-block: units 2p (low nibbles of qs[32p..32p+31]) and
// 2p+1 (high nibbles): element order, 32 bytes each
inline __m512i k4_pair(const uint8_t* qs, int p) {
  const __m256i q = _mm256_loadu_si256((const __m256i*)(qs + 32 * p));
  const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
  return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
}

// 6-bit scales and mins of a Q4_K/Q5_K super-block (blocks.h): [d*sc[0..7], -dmin*mn[0..7]]
inline __m512 k4_scales(const uint8_t* b) {
  uint16_t d16, m16;
  uint32_t w0, w1, w2;
  std::memcpy(&d16, b, 2);
  std::memcpy(&m16, b + 2, 2);
  std::memcpy(&w0, b + 4, 4);
  std::memcpy(&w1, b + 8, 4);
  std::memcpy(&w2, b + 12, 4);
  const uint32_t lo6 = 0x3F3F3F3Fu, lo4 = 0x0F0F0F0Fu, top2 = 0x03030303u;
  const uint32_t sc03 = w0 & lo6, mn03 = w1 & lo6;
  const uint32_t sc47 = (w2 & lo4) | (((w0 >> 6) & top2) << 4);
  const uint32_t mn47 = ((w2 >> 4) & lo4) | (((w1 >> 6) & top2) << 4);
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi32((int)mn47, (int)mn03, (int)sc47, (int)sc03)));
  const __m512 dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(fp16_to_fp32(d16)), _mm512_set1_ps(-fp16_to_fp32(m16)));
  return _mm512_mul_ps(v, dd);
}

// Row lanes: byte i of each 32-bit lane of every 16-row gather below is element i of a
// 4-element chunk; chunk m of a unit (elements 4m..4m+3) is WGroup chunk j with
// chunk_elem(j) = 4m.
constexpr int chunk_of(int m) { return 2 * (m % 4) + m / 4; }

inline __m512i lane_byte(__m512i v, int i) { return _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(255)); }
// byte i of each 32-bit lane, signed (Q6_K's int8 scales)
inline __m512i lane_sbyte(__m512i v, int i) { return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24); }
// Q3_K's 6-bit scale of 16-group g less 32, lane r = row r (w0, w1, w2: the rows' scale bytes
// 0..3, 4..7, 8..11: the low nibbles of bytes 0..7, then their high ones; the top bits of
// group g from byte g % 4 of w2, shifted by 2 * (g / 4))
inline __m512i q3_scale(__m512i w0, __m512i w1, __m512i w2, int g) {
  const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(g % 8 < 4 ? w0 : w1, 8 * (g % 4) + 4 * (g / 8)), _mm512_set1_epi32(15));
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(w2, 8 * (g % 4) + 2 * (g / 4)), _mm512_set1_epi32(3));
  return _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
}

// The 6-bit scales and mins of 16 Q4_K/Q5_K super-blocks, lane r = row r (w0, w1, w2: the
// rows' scale bytes 0..3, 4..7, 8..11): unit j's in byte j % 4 of sc[j / 4] and mn[j / 4]
inline void k4_fields(__m512i w0, __m512i w1, __m512i w2, __m512i (&sc)[2], __m512i (&mn)[2]) {
  const __m512i lo6 = _mm512_set1_epi32(0x3F3F3F3F), lo4 = _mm512_set1_epi32(0x0F0F0F0F), top2 = _mm512_set1_epi32(0x03030303);
  sc[0] = _mm512_and_si512(w0, lo6);
  mn[0] = _mm512_and_si512(w1, lo6);
  sc[1] = _mm512_or_si512(_mm512_and_si512(w2, lo4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), top2), 4));
  mn[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), lo4),
                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), top2), 4));
}
// unit j's field of k4_fields times s
inline __m512 k4_unit(const __m512i (&f)[2], int j, __m512 s) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(lane_byte(f[j / 4], j % 4)), s);
}

// Q4_K/Q5_K row lanes: the 8 units of a super-block at b (+ ridx per row) into
// out[0], out[stride], ... (qh: Q5_K's fifth bits, nullptr for Q4_K)
inline void k4_rows8(const uint8_t* b, const uint8_t* qs, const uint8_t* qh, __m512i ridx, __mmask16 k, WGroup* out,
                     int stride) {
  __m512 D, M;
  cvt_dm(gather32(b, ridx, k), D, M);
  __m512i sc[2], mn[2];
  k4_fields(gather32(b + 4, ridx, k), gather32(b + 8, ridx, k), gather32(b + 12, ridx, k), sc, mn);
  const __m512 negM = _mm512_sub_ps(_mm512_setzero_ps(), M);
  for (int j = 0; j < 8; ++j) {
    WGroup& g = out[j * stride];
    g.dw = k4_unit(sc, j, D);
    g.mw = k4_unit(mn, j, negM);
  }
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int m = 0; m < 8; ++m) {
    const __m512i h = qh ? gather32(qh + 4 * m, ridx, k) : _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i q = gather32(qs + 32 * c + 4 * m, ridx, k);
      __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
      if (qh) {
        const __m512i one = _mm512_set1_epi8(1);
        lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * c), one), 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * c + 1), one), 4));
      }
      out[(2 * c) * stride].w[chunk_of(m)] = lo;
      out[(2 * c + 1) * stride].w[chunk_of(m)] = hi;
    }
  }
}

struct KSQ4K {
  static constexpr size_t kBytes = 144;
  static constexpr bool kMin = true;
  static constexpr int kOffShift = 0;
  static constexpr bool kHalves = false;
  static constexpr bool kSignedLo = false;
  static constexpr bool kMin16 = false;
  static inline __m512 scales(const uint8_t* b) { return k4_scales(b); }
  static inline __m512i pair(const uint8_t* b, int p) { return k4_pair(b + 16, p); }
  static inline void rows8(const uint8_t* b, __m512i ridx, __mmask16 k, WGroup* out, int stride) {
    k4_rows8(b, b + 16, nullptr, ridx, k, out, stride);
  }
};

struct KSQ5K {
  static constexpr size_t kBytes = 176;
  static constexpr bool kMin = true;
  static constexpr int kOffShift = 0;
  static constexpr bool kHalves = false;
  static constexpr bool kSignedLo = false;
  static constexpr bool kMin16 = false;
  static inline __m512 scales(const uint8_t* b) { return k4_scales(b); }
  // fifth bit of element i of unit j: bit j of qh[i]
  static inline __m512i pair(const uint8_t* b, int p) {
    const __m512i v = k4_pair(b + 48, p);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 16)));
    const __m512i bit = _mm512_mask_blend_epi8((__mmask64)0xFFFFFFFF00000000ull, _mm512_set1_epi8((char)(1 << (2 * p))),
                                               _mm512_set1_epi8((char)(1 << (2 * p + 1))));
    return _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(qh, bit), v, _mm512_set1_epi8(16));
  }
  static inline void rows8(const uint8_t* b, __m512i ridx, __mmask16 k, WGroup* out, int stride) {
    k4_rows8(b, b + 48, b + 16, ridx, k, out, stride);
  }
};

struct KSQ6K {
  static constexpr size_t kBytes = 210;
  static constexpr bool kMin = false;
  static constexpr int kOffShift = 5;  // u = q + 32
  static constexpr bool kHalves = true;
  static constexpr bool kSignedLo = false;
  static constexpr bool kMin16 = false;
  // [d*sc[0..15]], one per 16-group
  static inline __m512 scales(const uint8_t* b) {
    uint16_t d16;
    std::memcpy(&d16, b + 208, 2);
    const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192))));
    return _mm512_mul_ps(s, _mm512_set1_ps(fp16_to_fp32(d16)));
  }
  // pair p = 2h + k: elements 64k..64k+63 of half h. Element i of the pair: low nibble k
  // of ql[64h + i], high bits 2*(2k + i/32) of qh[32h + i%32].
  static inline __m512i pair(const uint8_t* b, int p) {
    const int h = p >> 1, k = p & 1;
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(b + 64 * h), 4 * k), _mm512_set1_epi8(0x0F));
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)));
    const __m512i cnt = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(4 * k)), _mm512_set1_epi16((short)(4 * k + 2)));
    const __m512i hi = _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh, cnt), 4), _mm512_set1_epi8(0x30));
    return _mm512_or_si512(lo, hi);
  }
  // unit u = 4h + v: elements 32v..32v+31 of half h; dw / mw: the scales of its two
  // 16-groups (2u, 2u+1)
  static inline void rows8(const uint8_t* b, __m512i ridx, __mmask16 k, WGroup* out, int stride) {
    __m512 D, unused;
    cvt_dm(gather32(b + 208, ridx, k), D, unused);
    for (int i = 0; i < 4; ++i) {
      const __m512i sc = gather32(b + 192 + 4 * i, ridx, k);
      for (int e = 0; e < 4; ++e) {
        const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(lane_sbyte(sc, e)), D);
        const int g = 4 * i + e;  // 16-group
        if (g & 1) {
          out[(g >> 1) * stride].mw = s;
        } else {
          out[(g >> 1) * stride].dw = s;
        }
      }
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 32; i += 4) {  // elements i..i+3 of each 32-run v of half h
        const __m512i q0 = gather32(b + 64 * h + i, ridx, k), q1 = gather32(b + 64 * h + 32 + i, ridx, k);
        const __m512i qh = gather32(b + 128 + 32 * h + i, ridx, k);
        for (int v = 0; v < 4; ++v) {  // run v: low nibbles of ql[64h + 32(v&1) + i] shifted by 4(v>>1)
          const __m512i ql = (v & 1) ? q1 : q0;
          const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(ql, 4 * (v >> 1)), m4);
          const __m512i hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * v), m2), 4);
          out[(4 * h + v) * stride].w[chunk_of(i / 4)] = _mm512_or_si512(lo, hi);
        }
      }
  }
};

// Units 2p and 2p + 1 of a super-block's 2-bit fields at qs (Q3_K's lows, Q2_K's values;
// unit j = 4h + k: bits 2k of qs[32h + i]) as bytes 0..3, element order
inline __m512i k2_pair(const uint8_t* qs, int p) {
  const int j = 2 * p, k = j & 3;
  const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qs + 32 * (j >> 2))));
  const __m512i cnt = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(2 * k)), _mm512_set1_epi16((short)(2 * k + 2)));
  return _mm512_and_si512(_mm512_srlv_epi16(q, cnt), _mm512_set1_epi8(3));
}

// Q3_K (blocks.h): u = lo | hi << 2 in 0..7 with q = u - 4; scales per 16-group as Q6_K's.
// Offsets in the block: hmask 0, qs 32, scales 96, d 108.
struct KSQ3K {
  static constexpr size_t kBytes = 110;
  static constexpr bool kMin = false;
  static constexpr int kOffShift = 2;  // u = q + 4
  static constexpr bool kHalves = true;
  static constexpr bool kSignedLo = false;
  static constexpr bool kMin16 = false;
  // [d*(sc[0..15] - 32)]: the low nibbles of bytes 0..7 then their high ones, the top bits
  // of group n = 4 * lane + byte from the 32-bit lane of bytes 8..11 shifted by 2 * lane
  static inline __m512 scales(const uint8_t* b) {
    int32_t top;
    std::memcpy(&top, b + 104, 4);
    const __m128i lo8 = _mm_loadl_epi64((const __m128i*)(b + 96));
    const __m128i lo = _mm_and_si128(_mm_unpacklo_epi64(lo8, _mm_srli_epi16(lo8, 4)), _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(top), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)));
    uint16_t d16;
    std::memcpy(&d16, b + 108, 2);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sc, _mm512_set1_epi32(32))), _mm512_set1_ps(fp16_to_fp32(d16)));
  }
  // pair p: units 2p and 2p + 1 (unit j = 4h + k: bits 2k of qs[32h + i], bit j of hmask[i])
  static inline __m512i pair(const uint8_t* b, int p) {
    const int j = 2 * p;
    const __m512i lo = k2_pair(b + 32, p);
    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)b));
    const __m512i bit = _mm512_mask_blend_epi8((__mmask64)0xFFFFFFFF00000000ull, _mm512_set1_epi8((char)(1 << j)),
                                               _mm512_set1_epi8((char)(1 << (j + 1))));
    return _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(hm, bit), lo, _mm512_set1_epi8(4));
  }
  // unit u = 4h + k; dw / mw: the scales of its two 16-groups (2u, 2u+1)
  static inline void rows8(const uint8_t* b, __m512i ridx, __mmask16 k, WGroup* out, int stride) {
    __m512 D, unused;
    cvt_dm(gather32(b + 108, ridx, k), D, unused);
    const __m512i w0 = gather32(b + 96, ridx, k), w1 = gather32(b + 100, ridx, k), w2 = gather32(b + 104, ridx, k);
    for (int g = 0; g < 16; ++g) {  // 16-group g's 6-bit scale, per row
      const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(q3_scale(w0, w1, w2, g)), D);
      if (g & 1) {
        out[(g >> 1) * stride].mw = s;
      } else {
        out[(g >> 1) * stride].dw = s;
      }
    }
    const __m512i b3 = _mm512_set1_epi8(0x03), b1 = _mm512_set1_epi8(0x01);
    for (int i = 0; i < 32; i += 4) {  // elements i..i+3 of each unit
      const __m512i hm = gather32(b + i, ridx, k);
      for (int h = 0; h < 2; ++h) {
        const __m512i q = gather32(b + 32 + 32 * h + i, ridx, k);
        for (int kk = 0; kk < 4; ++kk) {
          const int u = 4 * h + kk;
          const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(q, 2 * kk), b3);
          const __m512i hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hm, u), b1), 2);
          out[u * stride].w[chunk_of(i / 4)] = _mm512_or_si512(lo, hi);
        }
      }
    }
  }
};

// A prefill slab's offsets per 16-group for kMin16 types: those of a WGroup's two groups
struct WMins {
  __m512 m0, m1;
};

// Q2_K (blocks.h): u = q in 0..3, a scale and an offset per 16-group (kMin16: mins, times
// the group's sum of x). Offsets in the block: scales 0, qs 16, d 80, dmin 82.
struct KSQ2K {
  static constexpr size_t kBytes = 84;
  static constexpr bool kMin = false;
  static constexpr int kOffShift = 0;
  static constexpr bool kHalves = true;
  static constexpr bool kSignedLo = false;
  static constexpr bool kMin16 = true;
  // the 16 groups' 4-bit fields (low nibbles: scales, high: mins) times the f16 at `at`
  static inline __m512 nibbles(const uint8_t* b, int shift, int at, float sign) {
    const __m128i v = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i*)b), shift), _mm_set1_epi8(15));
    uint16_t d16;
    std::memcpy(&d16, b + at, 2);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)), _mm512_set1_ps(sign * fp16_to_fp32(d16)));
  }
  static inline __m512 scales(const uint8_t* b) { return nibbles(b, 0, 80, 1.f); }  // [d*sc[0..15]]
  static inline __m512 mins(const uint8_t* b) { return nibbles(b, 4, 82, -1.f); }   // [-dmin*mn[0..15]]
  static inline __m512i pair(const uint8_t* b, int p) { return k2_pair(b + 16, p); }
  // unit u = 4h + k; dw / mw: the scales of its two 16-groups (2u, 2u+1), mins[u].m0 / m1
  // their -dmin*mn
  static inline void rows8(const uint8_t* b, __m512i ridx, __mmask16 k, WGroup* out, WMins* mins, int stride) {
    __m512 D, M;
    cvt_dm(gather32(b + 80, ridx, k), D, M);
    M = _mm512_sub_ps(_mm512_setzero_ps(), M);
    const __m512i m4 = _mm512_set1_epi32(15);
    for (int i = 0; i < 4; ++i) {
      const __m512i w = gather32(b + 4 * i, ridx, k);  // the fields of groups 4i..4i+3
      for (int e = 0; e < 4; ++e) {
        const int g = 4 * i + e;
        const __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 8 * e), m4)), D);
        const __m512 mn = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 8 * e + 4), m4)), M);
        if (g & 1) {
          out[(g >> 1) * stride].mw = sc;
          mins[(g >> 1) * stride].m1 = mn;
        } else {
          out[(g >> 1) * stride].dw = sc;
          mins[(g >> 1) * stride].m0 = mn;
        }
      }
    }
    const __m512i b3 = _mm512_set1_epi8(0x03);
    for (int i = 0; i < 32; i += 4)  // elements i..i+3 of each unit
      for (int h = 0; h < 2; ++h) {
        const __m512i q = gather32(b + 16 + 32 * h + i, ridx, k);
        for (int kk = 0; kk < 4; ++kk)
          out[(4 * h + kk) * stride].w[chunk_of(i / 4)] = _mm512_and_si512(_mm512_srli_epi16(q, 2 * kk), b3);
      }
  }
};

// A super-block's 16 sums of x per 16-group as the kernels see x: dx of the group's 32-unit
// times its integer sum (KAct::qs16); the offsets of kMin16 types multiply them.
inline __m512 group_sums(const int32_t* qs16, const float* dx8) {
  const __m512i half = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 1);
  const __m512 dx = _mm512_permutexvar_ps(half, _mm512_castps256_ps512(_mm256_loadu_ps(dx8)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(qs16)), dx);
}

// IQ4_XS (blocks.h): v = kIq4nlValues[nibble], signed, stored as u = v + 128 (1..241): the
// high plane's dot is vpdpbusd(u, hi) = sum v*hi + 128 * sum hi, the low plane's takes v
// itself as the signed operand (u ^ 0x80), and 32768 * sum hi (KAct::hs4, hsu) comes off.
// 32-unit j: qs[16j .. 16j+15], low nibbles elements 0..15, high ones 16..31; its scale
// d * (ls - 32), ls from scales_l (4 bits) and scales_h (2 bits). Offsets: d 0, scales_h 2,
// scales_l 4, qs 8.
struct KSIQ4XS {
  static constexpr size_t kBytes = 136;
  static constexpr bool kMin = false;
  static constexpr int kOffShift = 0;
  static constexpr bool kHalves = false;
  static constexpr bool kSignedLo = true;
  static constexpr bool kMin16 = false;
  static inline __m512i table() { return iq4_u_table(); }
  // [d*(ls[0..7] - 32), 0 x 8]
  static inline __m512 scales(const uint8_t* b) {
    uint16_t d16, sh;
    uint32_t sl;
    std::memcpy(&d16, b, 2);
    std::memcpy(&sh, b + 2, 2);
    std::memcpy(&sl, b + 4, 4);
    const __m256i j = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)sl), _mm256_slli_epi32(j, 2)), _mm256_set1_epi32(15));
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(sh), _mm256_slli_epi32(j, 1)), _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
    const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(ls), _mm256_set1_ps(fp16_to_fp32(d16)));
    return _mm512_insertf32x8(_mm512_setzero_ps(), sc, 0);
  }
  // pair p: units 2p and 2p + 1 in element order, as u
  static inline __m512i pair(const uint8_t* b, int p) {
    const __m128i q0 = _mm_loadu_si128((const __m128i*)(b + 8 + 32 * p));
    const __m128i q1 = _mm_loadu_si128((const __m128i*)(b + 24 + 32 * p));
    __m512i v = _mm512_castsi128_si512(q0);
    v = _mm512_inserti32x4(v, _mm_srli_epi16(q0, 4), 1);
    v = _mm512_inserti32x4(v, q1, 2);
    v = _mm512_inserti32x4(v, _mm_srli_epi16(q1, 4), 3);
    return _mm512_shuffle_epi8(table(), _mm512_and_si512(v, _mm512_set1_epi8(0x0F)));
  }
  // unit j: dw its scale, no min (mw 0); chunk m of a unit: nibbles m / 4 of qs[16j + 4(m % 4) ..]
  static inline void rows8(const uint8_t* b, __m512i ridx, __mmask16 k, WGroup* out, int stride) {
    __m512 D, unused;
    const __m512i dsh = gather32(b, ridx, k);
    cvt_dm(dsh, D, unused);
    const __m512i sh = _mm512_srli_epi32(dsh, 16), sl = gather32(b + 4, ridx, k);
    for (int j = 0; j < 8; ++j) {
      const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(sl, 4 * j), _mm512_set1_epi32(15));
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(sh, 2 * j), _mm512_set1_epi32(3));
      const __m512i ls = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
      out[j * stride].dw = _mm512_mul_ps(_mm512_cvtepi32_ps(ls), D);
      out[j * stride].mw = _mm512_setzero_ps();
    }
    const __m512i tab = table(), m4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 8; ++j)
      for (int c = 0; c < 4; ++c) {
        const __m512i q = gather32(b + 8 + 16 * j + 4 * c, ridx, k);
        out[j * stride].w[chunk_of(c)] = _mm512_shuffle_epi8(tab, _mm512_and_si512(q, m4));
        out[j * stride].w[chunk_of(c + 4)] = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
      }
  }
};

// Lane l of pair p -> its scale among the super-block's 16 (16-groups: 4p + l/4; units:
// 2p + l/8, kPrep.pair_idx).
struct KTables {
  alignas(64) int32_t g16[4][16];
};
constexpr KTables make_ktables() {
  KTables t{};
  for (int p = 0; p < 4; ++p)
    for (int l = 0; l < 16; ++l) t.g16[p][l] = 4 * p + l / 4;
  return t;
}
inline constexpr KTables kKTab = make_ktables();

template <class KS>
inline const int32_t* lane_scale_idx(int p) {
  return KS::kHalves ? kKTab.g16[p] : kPrep.pair_idx[p];
}

// The weight bytes as the low plane's (signed) vpdpbusd operand: u itself, or for signed
// weights stored as u = v + 128, v (kSignedLo)
template <class KS>
inline __m512i signed_view(__m512i w) {
  if constexpr (KS::kSignedLo) return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
  return w;
}

// A lane's integer dot less what the stored weights' offsets added: u = q + 2^kOffShift
// (times the lane's q sums, qs4) and, for signed weights (u = v + 128 on the high plane),
// 128 * 256 times the high plane's sums (hs4)
template <class KS>
inline __m512i unoffset(__m512i I, const int32_t* qs4, const int32_t* hs4) {
  if constexpr (KS::kOffShift != 0)
    I = _mm512_sub_epi32(I, _mm512_slli_epi32(_mm512_loadu_si512(qs4), KS::kOffShift));
  if constexpr (KS::kSignedLo) I = _mm512_sub_epi32(I, _mm512_slli_epi32(_mm512_loadu_si512(hs4), 15));
  return I;
}

// GEMV tile: rows n0..n0+R-1 of one token.
template <class KS, int R>
inline void ks_gemv_tile(const uint8_t* W, size_t rb, int nsb, int n0, const QAct& a, const KAct& k, float* y) {
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    const int8_t* xh = a.q + 256 * (size_t)sb;
    const uint8_t* xl = a.lo + 256 * (size_t)sb;
    const float* dxl = k.dxl + 64 * (size_t)sb;
    const int32_t* qs4 = k.qs4 + 64 * (size_t)sb;
    const int32_t* hs4 = k.hs4 + 64 * (size_t)sb;
    const __m512 sx = KS::kMin ? _mm512_insertf32x8(_mm512_setzero_ps(), _mm256_loadu_ps(a.s + 8 * sb), 1)
                               : _mm512_setzero_ps();
    const __m512 sx16 = KS::kMin16 ? group_sums(k.qs16 + 16 * (size_t)sb, a.d + 8 * (size_t)sb) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const uint8_t* bp = W + (size_t)(n0 + r) * rb + (size_t)sb * KS::kBytes;
      prefetch_range(bp + HIPC_PREFETCH_BYTES, KS::kBytes);
      const __m512 S = KS::scales(bp);
      __m512 acc = f[r];
      if constexpr (KS::kMin) acc = _mm512_fmadd_ps(S, sx, acc);  // lanes 8..15: -dmin*mn * s
      if constexpr (KS::kMin16) acc = _mm512_fmadd_ps(KS::mins(bp), sx16, acc);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i w = KS::pair(bp, p);
        const __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xh + 64 * p));
        const __m512i I = unoffset<KS>(
            _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 8), _mm512_loadu_si512(xl + 64 * p), signed_view<KS>(w)),
            qs4 + 16 * p, hs4 + 16 * p);
        const __m512 sc = _mm512_mul_ps(_mm512_permutexvar_ps(ld_idx(lane_scale_idx<KS>(p)), S), _mm512_loadu_ps(dxl + 16 * p));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), sc, acc);
      }
      f[r] = acc;
    }
  }
  if constexpr (R == 4) {
    _mm_storeu_ps(y + n0, hsum4(f[0], f[1], f[2], f[3]));
  } else {
    for (int r = 0; r < R; ++r) y[n0 + r] = _mm512_reduce_add_ps(f[r]);
  }
}

// Small-batch GEMV (T = 2..5, a batch's decode step; see q_gemv_batch): a
// super-block's scales and its 4 pairs are unpacked once per row and dotted against all
// T tokens. R rows per tile share the horizontal sums.
template <class KS, int T, int R>
inline void ks_gemv_batch_rows(const uint8_t* W, size_t rb, int nsb, int n0, const QAct& a, const KAct& k, float* y,
                               int ldy) {
  __m512 f[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) f[r][t] = _mm512_setzero_ps();
  const size_t xs = (size_t)a.nbp * 32, ss = (size_t)a.nbp, ks = (size_t)k.n4;
  for (int sb = 0; sb < nsb; ++sb) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* bp = W + (size_t)(n0 + r) * rb + (size_t)sb * KS::kBytes;
      prefetch_range(bp + HIPC_PREFETCH_BYTES, KS::kBytes);
      const __m512 S = KS::scales(bp);
      __m512 M = _mm512_setzero_ps();
      if constexpr (KS::kMin16) M = KS::mins(bp);
      __m512i w[4];
      __m512 sc[4];
      for (int p = 0; p < 4; ++p) {
        w[p] = KS::pair(bp, p);
        sc[p] = _mm512_permutexvar_ps(ld_idx(lane_scale_idx<KS>(p)), S);
      }
      for (int t = 0; t < T; ++t) {
        const int8_t* xh = a.q + t * xs + 256 * (size_t)sb;
        const uint8_t* xl = a.lo + t * xs + 256 * (size_t)sb;
        const float* dxl = k.dxl + t * ks + 64 * (size_t)sb;
        const int32_t* qs4 = k.qs4 + t * ks + 64 * (size_t)sb;
        const int32_t* hs4 = k.hs4 + t * ks + 64 * (size_t)sb;
        __m512 acc = f[r][t];
        if constexpr (KS::kMin) {  // lanes 8..15: -dmin*mn * s
          const __m512 sx = _mm512_insertf32x8(_mm512_setzero_ps(), _mm256_loadu_ps(a.s + t * ss + 8 * sb), 1);
          acc = _mm512_fmadd_ps(S, sx, acc);
        }
        if constexpr (KS::kMin16)
          acc = _mm512_fmadd_ps(M, group_sums(k.qs16 + t * (ks / 4) + 16 * (size_t)sb, a.d + t * ss + 8 * (size_t)sb), acc);
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          const __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[p], _mm512_loadu_si512(xh + 64 * p));
          const __m512i I = unoffset<KS>(
              _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 8), _mm512_loadu_si512(xl + 64 * p), signed_view<KS>(w[p])),
              qs4 + 16 * p, hs4 + 16 * p);
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(sc[p], _mm512_loadu_ps(dxl + 16 * p)), acc);
        }
        f[r][t] = acc;
      }
    }
  }
  constexpr int S = R * T;
  const __m512 zero = _mm512_setzero_ps();
  for (int i = 0; i < S; i += 4) {
    alignas(16) float s4[4];
    const auto g = [&](int j) { return i + j < S ? f[(i + j) % R][(i + j) / R] : zero; };
    _mm_store_ps(s4, hsum4(g(0), g(1), g(2), g(3)));
    for (int j = 0; j < 4 && i + j < S; ++j) y[(size_t)((i + j) / R) * ldy + n0 + (i + j) % R] = s4[j];
  }
}

template <class KS, int T>
inline void ks_gemv_batch(const uint8_t* W, size_t rb, int nsb, int N, const QAct& a, const KAct& k, float* y, int ldy,
                          bool par) {
  constexpr int R = T <= 3 ? 4 : 2;  // R x T accumulators + 4 pairs + 4 scales in 32 registers
  const int ntiles = (N + R - 1) / R;
#pragma omp parallel for schedule(static) if (par)
  for (int i = 0; i < ntiles; ++i) {
    const int n0 = i * R;
    if (n0 + R <= N) {
      ks_gemv_batch_rows<KS, T, R>(W, rb, nsb, n0, a, k, y, ldy);
    } else {
      for (int n = n0; n < N; ++n) ks_gemv_batch_rows<KS, T, 1>(W, rb, nsb, n, a, k, y, ldy);
    }
  }
}

// Prefill tile: rows n0.. (V vectors of 16) x tokens t0..t0+C-1, over the slab of
// prepped units (slab[b * V + v]). Per unit and token: 8 chunks of vpdpbusd on each
// activation plane, then the unit's scales (Q6_K: one per 16-group, even / odd chunks).
template <class KS, int V, int C>
inline void ks_rl_tile(const WGroup* slab, const WMins* mins, int nb, const QAct& a, const KAct& k, int t0, int n0,
                       int N, float* y, int ldy) {
  constexpr int H = KS::kHalves ? 2 : 1;
  __m512 facc[V][C];
  for (int v = 0; v < V; ++v)
    for (int c = 0; c < C; ++c) facc[v][c] = _mm512_setzero_ps();
  const size_t xstride = (size_t)a.nbp * 32;
  for (int b = 0; b < nb; ++b) {
    const WGroup* sb = slab + (size_t)b * V;
    __m512i acc[H][V][C];
    for (int h = 0; h < H; ++h)
      for (int v = 0; v < V; ++v)
        for (int c = 0; c < C; ++c) acc[h][v][c] = _mm512_setzero_si512();
    const int8_t* xb = a.q + (size_t)t0 * xstride + 32 * (size_t)b;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      constexpr int hm = H - 1;
      for (int c = 0; c < C; ++c) {
        const __m512i xv = _mm512_set1_epi32(load_i32(xb + c * xstride + chunk_elem(j)));
        for (int v = 0; v < V; ++v) acc[j & hm][v][c] = _mm512_dpbusd_epi32(acc[j & hm][v][c], sb[v].w[j], xv);
      }
    }
    for (int h = 0; h < H; ++h)
      for (int v = 0; v < V; ++v)
        for (int c = 0; c < C; ++c) acc[h][v][c] = _mm512_slli_epi32(acc[h][v][c], 8);
    const int8_t* lb = (const int8_t*)a.lo + (size_t)t0 * xstride + 32 * (size_t)b;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      constexpr int hm = H - 1;
      __m512i wl[V];
      for (int v = 0; v < V; ++v) wl[v] = signed_view<KS>(sb[v].w[j]);
      for (int c = 0; c < C; ++c) {
        const __m512i xv = _mm512_set1_epi32(load_i32(lb + c * xstride + chunk_elem(j)));
        for (int v = 0; v < V; ++v) acc[j & hm][v][c] = _mm512_dpbusd_epi32(acc[j & hm][v][c], xv, wl[v]);
      }
    }
    for (int c = 0; c < C; ++c) {
      const size_t so = (size_t)(t0 + c) * a.nbp + b;
      const __m512 dx = _mm512_set1_ps(a.d[so]);
      for (int v = 0; v < V; ++v) {
        if constexpr (KS::kHalves) {
          const int32_t* g = k.qs16 + (size_t)(t0 + c) * (k.n4 / 4) + 2 * b;
          // (u = q + 2^kOffShift: Q6_K, Q3_K; Q2_K's u is q)
          const int o0 = KS::kOffShift ? g[0] * (1 << KS::kOffShift) : 0, o1 = KS::kOffShift ? g[1] * (1 << KS::kOffShift) : 0;
          const __m512i i0 = _mm512_sub_epi32(acc[0][v][c], _mm512_set1_epi32(o0));
          const __m512i i1 = _mm512_sub_epi32(acc[H - 1][v][c], _mm512_set1_epi32(o1));
          facc[v][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(sb[v].dw, dx), facc[v][c]);
          facc[v][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(sb[v].mw, dx), facc[v][c]);
          if constexpr (KS::kMin16) {  // the mins times the groups' sums of x
            const WMins& mm = mins[(size_t)b * V + v];
            facc[v][c] = _mm512_fmadd_ps(mm.m0, _mm512_set1_ps(a.d[so] * (float)g[0]), facc[v][c]);
            facc[v][c] = _mm512_fmadd_ps(mm.m1, _mm512_set1_ps(a.d[so] * (float)g[1]), facc[v][c]);
          }
        } else {
          __m512i I = acc[0][v][c];
          if constexpr (KS::kSignedLo)
            I = _mm512_sub_epi32(I, _mm512_set1_epi32(k.hsu[(size_t)(t0 + c) * (k.n4 / 8) + b] * 32768));
          facc[v][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(sb[v].dw, dx), facc[v][c]);
          facc[v][c] = _mm512_fmadd_ps(sb[v].mw, _mm512_set1_ps(a.s[so]), facc[v][c]);
        }
      }
    }
  }
  store_tile<V, C>(facc, t0, n0, N, y, ldy);
}

template <class KS, int V>
inline void ks_rl_prep(const uint8_t* W, size_t rb, int nsb, int n0, int N, WGroup* slab, WMins* mins) {
  alignas(64) int32_t idx[16];
  for (int r = 0; r < 16; ++r) idx[r] = (int32_t)(r * rb);
  const __m512i ridx = _mm512_load_si512(idx);
  for (int v = 0; v < V; ++v) {
    const __mmask16 km = mask16(N - (n0 + 16 * v));
    const uint8_t* base = W + (size_t)(n0 + 16 * v) * rb;
    for (int sb = 0; sb < nsb; ++sb) {
      WGroup* out = slab + (size_t)(8 * sb) * V + v;
      WMins* mo = KS::kMin16 ? mins + (size_t)(8 * sb) * V + v : nullptr;
      if (km) {
        if constexpr (KS::kMin16) {
          KS::rows8(base + (size_t)sb * KS::kBytes, ridx, km, out, mo, V);
        } else {
          KS::rows8(base + (size_t)sb * KS::kBytes, ridx, km, out, V);
        }
      } else {
        for (int u = 0; u < 8; ++u) {
          clear(out[(size_t)u * V]);
          if constexpr (KS::kMin16) mo[(size_t)u * V].m0 = mo[(size_t)u * V].m1 = _mm512_setzero_ps();
        }
      }
    }
  }
}

template <class KS, int V, int C>
inline void ks_rl_rows(const WGroup* slab, const WMins* mins, int nb, const QAct& a, const KAct& k, int n0, int N,
                       float* y, int ldy) {
  int t = 0;
  for (; t + C <= a.T; t += C) ks_rl_tile<KS, V, C>(slab, mins, nb, a, k, t, n0, N, y, ldy);
  switch (a.T - t) {  // token tail
    case 3: if constexpr (C > 3) ks_rl_tile<KS, V, 3>(slab, mins, nb, a, k, t, n0, N, y, ldy); break;
    case 2: if constexpr (C > 2) ks_rl_tile<KS, V, 2>(slab, mins, nb, a, k, t, n0, N, y, ldy); break;
    case 1: if constexpr (C > 1) ks_rl_tile<KS, V, 1>(slab, mins, nb, a, k, t, n0, N, y, ldy); break;
    default: break;
  }
}

// Used for quantize_act16_row: isum is the whole sum(q) (unused by these kernels).
struct KSAct {
  static constexpr bool kLoOffset = true;
};

// K-quant matmul with integer activations as int16 planes (qmax 32767; 127: int8 values in
// the same planes, quantize_block16). T == 1: GEMV over tiles of kGemvRows rows.
// T = 2..5: the GEMV over all T tokens (ks_gemv_batch). Larger T: row lanes, one OpenMP region as q_matmul's: each thread preps a slab of 16V
// rows (K/32 * V WGroups) once and sweeps all T tokens with it.
template <class KS>
inline void ks_matmul(const float* x, int T, int K, const void* Wv, int N, float* y, int ldy, float qmax = 32767.f) {
  if (T <= 0 || N <= 0) return;
  const uint8_t* W = (const uint8_t*)Wv;
  const int nsb = K / 256, nb = K / 32;
  const size_t rb = (size_t)nsb * KS::kBytes;
  const QAct a = alloc_qact(T, K, 0, 2, kact_bytes(T, K));
  const KAct k = kact(a, T, K);
  const bool par = (long long)T * N * K >= kParallelMinWork;
  // past 5 tokens the row lanes win here (measured: a K-quant pair costs more to unpack
  // than the Q4 groups, so the per-token dot products weigh more)
  constexpr int kKSmallBatchMax = kSmallBatchMax < 5 ? kSmallBatchMax : 5;
  if (T > 1 && T <= kKSmallBatchMax) {
    for (int t = 0; t < T; ++t) {
      quantize_act16_row<KSAct>(x, K, a, t, qmax);
      kact_row<KS::kSignedLo>(a, k, t);
    }
    switch (T) {
      case 2: ks_gemv_batch<KS, 2>(W, rb, nsb, N, a, k, y, ldy, par); break;
      case 3: ks_gemv_batch<KS, 3>(W, rb, nsb, N, a, k, y, ldy, par); break;
      case 4: ks_gemv_batch<KS, 4>(W, rb, nsb, N, a, k, y, ldy, par); break;
      default: ks_gemv_batch<KS, kKSmallBatchMax>(W, rb, nsb, N, a, k, y, ldy, par); break;
    }
    return;
  }
  if (T > 1) {
    // Q6_K keeps two int32 sums per unit: fewer rows and tokens per tile fit the registers
    constexpr int V = KS::kHalves ? 2 : kRlVecs, C = KS::kHalves ? 3 : kRlCols;
    const int ntiles = (N + 16 * V - 1) / (16 * V);
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
      for (int t = 0; t < T; ++t) {
        quantize_act16_row<KSAct>(x, K, a, t, qmax);
        kact_row<KS::kSignedLo>(a, k, t);
      }
      const size_t groups = (size_t)nb * V;  // the slab's WGroups, then (kMin16) as many WMins
      WGroup* slab = (WGroup*)scratch(1, (sizeof(WGroup) + (KS::kMin16 ? sizeof(WMins) : 0)) * groups);
      WMins* mins = KS::kMin16 ? (WMins*)(slab + groups) : nullptr;
#pragma omp for schedule(static)
      for (int i = 0; i < ntiles; ++i) {
        const int n0 = i * 16 * V;
        ks_rl_prep<KS, V>(W, rb, nsb, n0, N, slab, mins);
        ks_rl_rows<KS, V, C>(slab, mins, nb, a, k, n0, N, y, ldy);
      }
    }
    return;
  }
  quantize_act16_row<KSAct>(x, K, a, 0, qmax);
  kact_row<KS::kSignedLo>(a, k, 0);
  constexpr int R = kGemvRows;
  const int ntiles = (N + R - 1) / R;
#pragma omp parallel for schedule(static) if (par)
  for (int i = 0; i < ntiles; ++i) {
    const int n0 = i * R;
    if (n0 + R <= N) {
      ks_gemv_tile<KS, R>(W, rb, nsb, n0, a, k, y);
    } else {
      for (int n = n0; n < N; ++n) ks_gemv_tile<KS, 1>(W, rb, nsb, n, a, k, y);
    }
  }
}

}  // namespace detail
#endif  // HIPC_ISA_AVX512

}  // namespace hipc
