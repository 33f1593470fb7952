// linear_lanes_avx2.h -- linear_lanes.h's and linear_lanes_k.h's row-lanes matmuls for AVX2
// machines (no AVX512): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q3_K, Q4_K, Q5_K, Q6_K on the same
// layout (compiler/passes/repack.py; the Q5 types' fifth bits in the AVX2 arrangement).
//
// A 16-row group is two halves of 8 rows: the upper 32 bytes of each 64-byte lanes vector
// are rows 8..15. A half's block (a K-quant's 32-element unit) unpacks with a nibble split
// (Q5: a chunk's fifth bits a shift and a mask from the block's bytes of them, in the AVX2
// arrangement, kLaneFifthBytes; Q6_K: its high bits shifted on) into 8 chunk vectors, lane
// r (a dword) = row r's 4 bytes of that chunk; each chunk meets the token's 4 activation
// bytes broadcast, by vpmaddubsw (u8 x s8 pairs to int16) and
// vpmaddwd (pairs to int32): lane r accumulates row r, no horizontal sums. On the file's
// blocks (linear_kquant.h's kq_tile, linear_a16.h's matmul_deq: a row's block at a time,
// unpacked through memory) SmolLM2's Q4_K_M file decoded at half llama.cpp's rate on an AVX2
// EPYC; here at its rate (cpu-amd-epyc-avx2.md).
//
// vpmaddubsw saturates int16 pair sums: with weight bytes u <= 31 (Q4, Q5) and |x| <= 128 a
// pair is at most 7,936, so four chunks' pairs add up in int16 (31,744) before vpmaddwd; two
// for Q6_K's u <= 63. Q8_0's bytes (u = q + 128 <= 255) go through as two nibbles, 16 *
// dot(u >> 4) + dot(u & 15), or with int16 activations by vpmaddwd on the bytes widened.
// Activations as linear_lanes.h's GEMV takes them: int16 as the balanced split q = 256 * hi
// + lo (|q| <= 32639, both planes signed bytes), or int8; I = sum(u * q) - off * sum(q).
// Prefills take both halves at once (lane2_pair, lk2_pair: a chunk's activation bytes
// broadcast once for 16 rows, a block unpacked once a chunk of tokens; kLane2Pair says which
// calls); the rest take one half at a time over chunks of HIPC_LANE2_CHUNK.
#pragma once

namespace hipc {

#if defined(HIPC_ISA_AVX2)
#ifndef HIPC_LANE2_CHUNK
#define HIPC_LANE2_CHUNK 6  // tokens a half-block is unpacked for (4..8; 6 read fastest, T = 128)
#endif
#ifndef HIPC_LANE2_PREFETCH
#define HIPC_LANE2_PREFETCH 2048  // bytes ahead along a group (0: none; A/B runs)
#endif
namespace detail {

// The pair kernels take whole chunks of 8 tokens, the one-half kernels the rest (T % 8,
// decode, Q8_0 on int16 activations): one pair kernel a type, since the lanes entries are
// compiled into every artifact (a pair kernel for every chunk size to 8 doubled their compile
// time).
// The pair kernels are always_inline: out of line (one call site left GCC that choice) the
// 128-token SmolLM2 prefill read 11% slower.
#ifdef HIPC_NOPAIR  // the one-half kernels for every T (bench_cpu_lanes_prefill.py's base)
constexpr bool kLane2Pair = false;
#else
constexpr bool kLane2Pair = true;
#endif
constexpr int kLane2PairChunk = 8;

// Every byte's bit `from` moved to bit `to` (the bits around it too: mask after). Unrolled
// callers pass constants, so it is one immediate shift.
inline __m256i lane2_move_bit(__m256i v, int from, int to) {
  return from < to ? _mm256_slli_epi16(v, to - from) : _mm256_srli_epi16(v, from - to);
}

// Rows 8h..8h+7 of 4 nibble vectors at q (64 bytes apart): w[2c] the low nibbles of vector c,
// w[2c + 1] the high ones; with `fifth` (the block's 64 bytes of fifth bits) bit 4 or'ed on
inline void lane2_nibbles(const uint8_t* q, const uint8_t* fifth, int h, __m256i (&w)[8]) {
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 64 * c + 32 * h));
    w[2 * c] = _mm256_and_si256(v, m4);
    w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  }
  if (fifth) {  // byte 4r + i, bit j: chunk j's (kLaneFifthBytes), moved to bit 4
    static_assert(kLaneFifthBytes);
    const __m256i f = _mm256_loadu_si256((const __m256i*)(fifth + 32 * h)), sixteen = _mm256_set1_epi8(16);
    for (int j = 0; j < 8; ++j) w[j] = _mm256_or_si256(w[j], _mm256_and_si256(lane2_move_bit(f, j, 4), sixteen));
  }
}

// Half h (rows 8h..8h+7) of a block: w[j] lane r = row 8h + r's 4 weight bytes of chunk j
template <class L>
inline void lane2_unpack(const LaneBlock<L>& B, int h, __m256i (&w)[8]) {
  if constexpr (L::kQuant == 256) {
    lane2_nibbles(B.q, L::kFifth ? B.h : nullptr, h, w);
  } else {
    for (int j = 0; j < 8; ++j) w[j] = _mm256_loadu_si256((const __m256i*)(B.q + 64 * j + 32 * h));
  }
}

inline __m256i lane2_bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// sum_j w[j] * x (chunk j's 4 bytes of the block's 32 activations x), lane r: row r. Weight
// bytes <= 31 (see the top).
inline __m256i lane2_dot(const __m256i (&w)[8], const int8_t* x) {
  __m256i s0 = _mm256_maddubs_epi16(w[0], lane2_bcast4(x + chunk_elem(0)));
  __m256i s1 = _mm256_maddubs_epi16(w[1], lane2_bcast4(x + chunk_elem(1)));
  for (int j = 2; j < 8; j += 2) {
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[j], lane2_bcast4(x + chunk_elem(j))));
    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[j + 1], lane2_bcast4(x + chunk_elem(j + 1))));
  }
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
}

// sum(u * x) of one activation plane: Q8_0's bytes as two nibbles (see the top)
template <class L>
inline __m256i lane2_plane(const __m256i (&w)[8], const __m256i (&wh)[8], const int8_t* x) {
  if constexpr (L::kQuant == 256) {
    (void)wh;
    return lane2_dot(w, x);
  } else {
    return _mm256_add_epi32(_mm256_slli_epi32(lane2_dot(wh, x), 4), lane2_dot(w, x));
  }
}

// Q8_0's bytes (u <= 255) against int16 activations x: vpmaddwd on the bytes widened, rows
// 0..3 and 4..7 apart, the pairs summed at the end (hadd, then the lanes in row order)
inline __m256i lane2_dot16(const __m256i (&w)[8], const int16_t* x) {
  __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    long long v;
    std::memcpy(&v, x + chunk_elem(j), 8);
    const __m256i xb = _mm256_set1_epi64x(v);
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(w[j])), xb));
    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(w[j], 1)), xb));
  }
  return _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo, hi), 0xD8);
}

// Token t's int16 activations as the balanced split (linear_lanes.h quantize_lane_row, the
// same rounding): d = max|x| / 32639 per block, isum = sum(q), s = sum(x).
inline void quantize_lane2_row(const float* x, int K, const QAct& a, int t, int16_t* q16 = nullptr) {
  int8_t* hr = a.q + (size_t)t * a.nbp * 32;
  int8_t* lr = (int8_t*)a.lo + (size_t)t * a.nbp * 32;
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), r128 = _mm256_set1_epi32(128);
  for (int b = 0; b < K / 32; ++b) {
    __m256 xv[4], m = _mm256_setzero_ps(), sx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      xv[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, xv[i]));
      sx = _mm256_add_ps(sx, xv[i]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32639.f / amax : 0.f);
    __m256i q[4], hi[4], lo[4], qs = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(xv[i], inv));
      hi[i] = _mm256_srai_epi32(_mm256_add_epi32(q[i], r128), 8);
      lo[i] = _mm256_sub_epi32(q[i], _mm256_slli_epi32(hi[i], 8));
      qs = _mm256_add_epi32(qs, q[i]);
    }
    if (q16)  // (Q8_0's kernel: q itself as int16, in element order)
      for (int i = 0; i < 4; i += 2)
        _mm256_storeu_si256((__m256i*)(q16 + (size_t)t * a.nbp * 32 + 32 * b + 8 * i),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(q[i], q[i + 1]), 0xD8));
    // int32 -> int8 in element order: the packs interleave 128-bit lanes, the permute undoes it
    const __m256i hb = _mm256_packs_epi16(_mm256_packs_epi32(hi[0], hi[1]), _mm256_packs_epi32(hi[2], hi[3]));
    const __m256i lb = _mm256_packs_epi16(_mm256_packs_epi32(lo[0], lo[1]), _mm256_packs_epi32(lo[2], lo[3]));
    _mm256_storeu_si256((__m256i*)(hr + 32 * b), _mm256_permutevar8x32_epi32(hb, order));
    _mm256_storeu_si256((__m256i*)(lr + 32 * b), _mm256_permutevar8x32_epi32(lb, order));
    alignas(32) int32_t qv[8];
    _mm256_store_si256((__m256i*)qv, qs);
    a.d[(size_t)t * a.nbp + b] = amax / 32639.f;
    a.isum[(size_t)t * a.nbp + b] = qv[0] + qv[1] + qv[2] + qv[3] + qv[4] + qv[5] + qv[6] + qv[7];
    a.s[(size_t)t * a.nbp + b] = hsum256(sx);
  }
}

// Rows n0..n0+7 (those below N) of tokens t0..t0+C-1 from the accumulators
template <int C>
inline void lane2_store(const __m256 (&facc)[C], float* y, int ldy, int t0, int n0, int N) {
  const int nr = std::min(8, N - n0);
  for (int c = 0; c < C; ++c) {
    float* yr = y + (size_t)(t0 + c) * ldy + n0;
    if (nr == 8) {
      _mm256_storeu_ps(yr, facc[c]);
    } else if (nr > 0) {
      alignas(32) float v[8];
      _mm256_store_ps(v, facc[c]);
      std::memcpy(yr, v, sizeof(float) * nr);
    }
  }
}

// Half h's (rows 8h..8h+7) scales of a block: dw, and mw the Q4_1 / Q5_1 minimums (else 0)
template <class L>
inline void lane2_scales(const LaneBlock<L>& B, int h, __m256& dw, __m256& mw) {
  if constexpr (L::kMin) {  // (d, m) pairs: evens and odds apart, in row order
    const __m256 p0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(B.s + 32 * h)));
    const __m256 p1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(B.s + 32 * h + 16)));
    dw = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(p0, p1, 0x88)), 0xD8));
    mw = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(p0, p1, 0xDD)), 0xD8));
  } else {
    dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(B.s + 16 * h)));
    mw = _mm256_setzero_ps();
  }
}

// Rows 8h..8h+7 of group g against tokens t0..t0+C-1 (P = 2: int16 planes, 1: int8)
template <class L, int C, int P>
inline void lane2_half(const uint8_t* W, int nb, int g, int h, const QAct& a, const int16_t* x16, int t0, float* y,
                       int ldy, int N) {
  constexpr bool kWide = L::kQuant == 512 && P == 2;  // Q8_0 on int16 x (lane2_dot16)
  __m256 facc[C];
  for (int c = 0; c < C; ++c) facc[c] = _mm256_setzero_ps();
  const uint8_t* G = lane_group<L>(W, nb, g);
  const size_t xs = (size_t)a.nbp * 32, ss = (size_t)a.nbp;
  constexpr int C2 = L::kQuant + L::kFifth + L::kScale;
  for (int b = 0; b < nb; ++b) {
#if HIPC_LANE2_PREFETCH
    if (h == 0)
      for (int o = 0; o < C2; o += 64) _mm_prefetch((const char*)(G + (size_t)b * C2 + HIPC_LANE2_PREFETCH + o), _MM_HINT_T0);
#endif
    const LaneBlock<L> B = lane_block<L>(G, nb, b);
    __m256i w[8], wh[8];
    lane2_unpack<L>(B, h, w);
    if constexpr (L::kQuant != 256 && !kWide) {
      const __m256i m4 = _mm256_set1_epi8(15);
      for (int j = 0; j < 8; ++j) wh[j] = _mm256_and_si256(_mm256_srli_epi16(w[j], 4), m4), w[j] = _mm256_and_si256(w[j], m4);
    }
    __m256 dw, mw;
    lane2_scales<L>(B, h, dw, mw);
    for (int c = 0; c < C; ++c) {
      const size_t t = (size_t)(t0 + c), so = t * ss + b;
      __m256i I;
      if constexpr (kWide) {
        I = lane2_dot16(w, x16 + t * xs + 32 * (size_t)b);
      } else {
        I = lane2_plane<L>(w, wh, a.q + t * xs + 32 * (size_t)b);
        if constexpr (P == 2) I = _mm256_add_epi32(_mm256_slli_epi32(I, 8), lane2_plane<L>(w, wh, (const int8_t*)a.lo + t * xs + 32 * (size_t)b));
      }
      if constexpr (L::kOff != 0) I = _mm256_sub_epi32(I, _mm256_set1_epi32(a.isum[so] * L::kOff));
      facc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[so])), facc[c]);
      if constexpr (L::kMin) facc[c] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[so]), facc[c]);
    }
  }
  lane2_store<C>(facc, y, ldy, t0, 16 * g + 8 * h, N);
}

// Chunks 4q..4q+3 of half h of a 4/5-bit block (lane2_nibbles' vectors 2q and 2q + 1)
inline void lane2_nibbles4(const uint8_t* q, const uint8_t* fifth, int h, int part, __m256i (&w)[4]) {
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int c = 0; c < 2; ++c) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 64 * (2 * part + c) + 32 * h));
    w[2 * c] = _mm256_and_si256(v, m4);
    w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  }
  if (fifth) {
    const __m256i f = _mm256_loadu_si256((const __m256i*)(fifth + 32 * h)), sixteen = _mm256_set1_epi8(16);
    for (int k = 0; k < 4; ++k) w[k] = _mm256_or_si256(w[k], _mm256_and_si256(lane2_move_bit(f, 4 * part + k, 4), sixteen));
  }
}

// Block B's integer sums for both halves against tokens t0..t0+C-1 (I[h][c]), a 4/5-bit
// type: the block's chunks four at a time, so that the 8 weight vectors stay in registers.
// P = 2: the high plane's pairs weighted 256 by vpmaddwd.
template <class L, int C, int P>
inline void lane2_pair_nibbles(const LaneBlock<L>& B, const QAct& a, int t0, int b, __m256i (&I)[2][C]) {
  const size_t xs = (size_t)a.nbp * 32;
  for (int part = 0; part < 2; ++part) {
    __m256i w0[4], w1[4];
    lane2_nibbles4(B.q, L::kFifth ? B.h : nullptr, 0, part, w0);
    lane2_nibbles4(B.q, L::kFifth ? B.h : nullptr, 1, part, w1);
    for (int c = 0; c < C; ++c) {
      for (int plane = 0; plane < P; ++plane) {
        const int8_t* x = (plane ? (const int8_t*)a.lo : a.q) + (size_t)(t0 + c) * xs + 32 * (size_t)b;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int k = 0; k < 4; ++k) {
          const __m256i xb = lane2_bcast4(x + chunk_elem(4 * part + k));
          s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w0[k], xb));
          s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w1[k], xb));
        }
        const __m256i m = _mm256_set1_epi16(P == 2 && plane == 0 ? 256 : 1);
        const __m256i i0 = _mm256_madd_epi16(s0, m), i1 = _mm256_madd_epi16(s1, m);
        I[0][c] = part + plane ? _mm256_add_epi32(I[0][c], i0) : i0;
        I[1][c] = part + plane ? _mm256_add_epi32(I[1][c], i1) : i1;
      }
    }
  }
}

// The same for Q8_0 on int8 activations: a chunk's bytes (u = q + 128 <= 255) as two
// nibbles, 16 * dot(u >> 4) + dot(u & 15) (lane2_plane's split), two chunks at a time (8
// nibble vectors for the two halves)
template <class L, int C>
inline void lane2_pair_bytes(const LaneBlock<L>& B, const QAct& a, int t0, int b, __m256i (&I)[2][C]) {
  const size_t xs = (size_t)a.nbp * 32;
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  for (int part = 0; part < 4; ++part) {  // chunks 2 part, 2 part + 1
    __m256i lo[2][2], hi[2][2];           // [half][chunk]
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 2; ++k) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(B.q + 64 * (2 * part + k) + 32 * h));
        lo[h][k] = _mm256_and_si256(v, m4);
        hi[h][k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      }
    for (int c = 0; c < C; ++c) {
      const int8_t* x = a.q + (size_t)(t0 + c) * xs + 32 * (size_t)b;
      __m256i sl[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, sh[2] = {sl[0], sl[0]};
      for (int k = 0; k < 2; ++k) {
        const __m256i xb = lane2_bcast4(x + chunk_elem(2 * part + k));
        for (int h = 0; h < 2; ++h) {
          sl[h] = _mm256_add_epi16(sl[h], _mm256_maddubs_epi16(lo[h][k], xb));
          sh[h] = _mm256_add_epi16(sh[h], _mm256_maddubs_epi16(hi[h][k], xb));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256i i = _mm256_add_epi32(_mm256_madd_epi16(sh[h], sixteen), _mm256_madd_epi16(sl[h], ones));
        I[h][c] = part ? _mm256_add_epi32(I[h][c], i) : i;
      }
    }
  }
}

// Both halves of group g (rows 16g..16g+15) against tokens t0..t0+C-1, the prefill form of
// lane2_half: each chunk's 4 activation bytes are broadcast once for the two halves (the
// broadcasts were a fifth of lane2_half's vector operations). The 4/5-bit types, and Q8_0 on
// int8 activations.
template <class L, int C, int P>
__attribute__((always_inline)) inline void lane2_pair(const uint8_t* W, int nb, int g, const QAct& a, int t0, float* y, int ldy, int N) {
  static_assert(L::kQuant == 256 || P == 1);
  __m256 facc[2][C];
  for (int c = 0; c < C; ++c) facc[0][c] = facc[1][c] = _mm256_setzero_ps();
  const uint8_t* G = lane_group<L>(W, nb, g);
  const size_t ss = (size_t)a.nbp;
  constexpr int C2 = L::kQuant + L::kFifth + L::kScale;
  for (int b = 0; b < nb; ++b) {
#if HIPC_LANE2_PREFETCH
    for (int o = 0; o < C2; o += 64) _mm_prefetch((const char*)(G + (size_t)b * C2 + HIPC_LANE2_PREFETCH + o), _MM_HINT_T0);
#endif
    const LaneBlock<L> B = lane_block<L>(G, nb, b);
    __m256i I[2][C];
    if constexpr (L::kQuant == 256) {
      lane2_pair_nibbles<L, C, P>(B, a, t0, b, I);
    } else {
      lane2_pair_bytes<L, C>(B, a, t0, b, I);
    }
    for (int h = 0; h < 2; ++h) {
      __m256 dw, mw;
      lane2_scales<L>(B, h, dw, mw);
      for (int c = 0; c < C; ++c) {
        const size_t so = (size_t)(t0 + c) * ss + b;
        __m256i i = I[h][c];
        if constexpr (L::kOff != 0) i = _mm256_sub_epi32(i, _mm256_set1_epi32(a.isum[so] * L::kOff));
        facc[h][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[so])), facc[h][c]);
        if constexpr (L::kMin) facc[h][c] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[so]), facc[h][c]);
      }
    }
  }
  lane2_store<C>(facc[0], y, ldy, t0, 16 * g, N);
  lane2_store<C>(facc[1], y, ldy, t0, 16 * g + 8, N);
}

// x's T rows quantized for the lanes kernels: the balanced int16 split (P = 2) or int8
// (q16: an int16 copy of the split's values too, T x nbp * 32)
template <int P>
inline QAct lane2_quantize(const float* x, int T, int K, size_t ext_bytes = 0, int16_t* q16 = nullptr) {
  const QAct a = alloc_qact(T, K, 0, P, ext_bytes);
#pragma omp parallel for schedule(static) if (T > 1 && (long long)T * K >= kParallelMinWork)
  for (int t = 0; t < T; ++t) {
    if constexpr (P == 2) {
      quantize_lane2_row(x + (size_t)t * K, K, a, t, q16);
    } else {
      quantize_act_row(x, K, a, t);
    }
  }
  return a;
}

// The T tokens in chunks of up to HIPC_LANE2_CHUNK: chunk(size as a constant, t0). A switch: a
// recursive dispatch measured ~10% slower kernels (Q8_0's int16 prefill).
template <class F>
inline void lane2_chunks(int T, F chunk) {
  constexpr int M = HIPC_LANE2_CHUNK;
  static_assert(M >= 1 && M <= 8);
  using std::integral_constant;
  for (int t0 = 0; t0 < T; t0 += M) switch (std::min(M, T - t0)) {
      case 1: chunk(integral_constant<int, 1>{}, t0); break;
      case 2: chunk(integral_constant<int, 2 <= M ? 2 : 1>{}, t0); break;
      case 3: chunk(integral_constant<int, 3 <= M ? 3 : 1>{}, t0); break;
      case 4: chunk(integral_constant<int, 4 <= M ? 4 : 1>{}, t0); break;
      case 5: chunk(integral_constant<int, 5 <= M ? 5 : 1>{}, t0); break;
      case 6: chunk(integral_constant<int, 6 <= M ? 6 : 1>{}, t0); break;
      case 7: chunk(integral_constant<int, 7 <= M ? 7 : 1>{}, t0); break;
      default: chunk(integral_constant<int, M>{}, t0); break;
    }
}

// Group g's halves over the T tokens in chunks: half(chunk size, h, t0)
template <class F>
inline void lane2_tokens(int T, int g, int N, F half) {
  lane2_chunks(T, [&](auto c, int t0) {
    for (int h = 0; h < 2 && 16 * g + 8 * h < N; ++h) half(c, h, t0);
  });
}

// Driver: P = 2 (int16 activations) or 1 (int8). W: the lanes layout of [N, K]. One group
// (both halves) a task; tokens in chunks of HIPC_LANE2_CHUNK.
template <class L, int P>
inline void lane2_matmul(const float* x, int T, int K, const void* Wv, int N, float* y, int ldy) {
  if (T <= 0 || N <= 0) return;
  const uint8_t* W = (const uint8_t*)Wv;
  const int nb = K / 32, ngroups = (N + 15) / 16;
  constexpr bool kWide = L::kQuant == 512 && P == 2;
  int16_t* x16 = kWide ? (int16_t*)scratch_f32(2, (size_t)T * nb * 16 + 16) : nullptr;
  const QAct a = lane2_quantize<P>(x, T, K, 0, x16);
  constexpr bool kPair = kLane2Pair && (L::kQuant == 256 || P == 1);  // (Q8_0 on int16: lane2_dot16)
#pragma omp parallel for schedule(static) if ((long long)T * N * K >= kParallelMinWork)
  for (int g = 0; g < ngroups; ++g) {
    int t0 = 0;
    if constexpr (kPair)
      for (; t0 + kLane2PairChunk <= T; t0 += kLane2PairChunk) lane2_pair<L, kLane2PairChunk, P>(W, nb, g, a, t0, y, ldy, N);
    lane2_tokens(T - t0, g, N, [&](auto c, int h, int t) {
      lane2_half<L, decltype(c)::value, P>(W, nb, g, h, a, x16, t0 + t, y, ldy, N);
    });
  }
}

// ---- the K-quants (linear_lanes_k.h's cells): Q3_K, Q4_K, Q5_K, Q6_K ----

// sum_j w[j] * x as the even chunks' (elements 0..15) and odd chunks' (16..31) sums; G
// chunks' int16 pairs added before vpmaddwd (4 for bytes <= 31, 2 for Q6_K's <= 63)
template <int G>
inline void lane2_dot_halves(const __m256i (&w)[8], const int8_t* x, __m256i& i0, __m256i& i1) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int p = 0; p < 2; ++p)
    for (int j0 = p; j0 < 8; j0 += 2 * G) {
      __m256i s16 = _mm256_maddubs_epi16(w[j0], lane2_bcast4(x + chunk_elem(j0)));
      for (int j = j0 + 2; j < j0 + 2 * G; j += 2) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], lane2_bcast4(x + chunk_elem(j))));
      acc[p] = _mm256_add_epi32(acc[p], _mm256_madd_epi16(s16, ones));
    }
  i0 = acc[0];
  i1 = acc[1];
}

// A cell's (super-block's) scales for rows 8h..8h+7: Q4_K / Q5_K dw[j] = d * sc_j, mw[j] =
// -dmin * mn_j of unit j; Q6_K, Q3_K dw[j] / mw[j] = d * sc of 16-groups 2j / 2j + 1.
template <class L>
inline void lk2_scales(const uint8_t* c, int h, __m256 (&dw)[8], __m256 (&mw)[8]) {
  const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 16 * h)));
  if constexpr (L::kQ3) {  // d * (sc - 32) of 16-group g: row r's 12 scale bytes, dword k of them in vector k
    const __m256i w0 = _mm256_loadu_si256((const __m256i*)(c + 32 + 32 * h));
    const __m256i w1 = _mm256_loadu_si256((const __m256i*)(c + 96 + 32 * h));
    const __m256i w2 = _mm256_loadu_si256((const __m256i*)(c + 160 + 32 * h));
    const __m256i m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3), k32 = _mm256_set1_epi32(32);
    for (int g = 0; g < 16; ++g) {  // (linear_vnni_k.h q3_scale)
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(g % 8 < 4 ? w0 : w1, 8 * (g % 4) + 4 * (g / 8)), m15);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(w2, 8 * (g % 4) + 2 * (g / 4)), m3);
      const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), k32);
      (g & 1 ? mw : dw)[g >> 1] = _mm256_mul_ps(_mm256_cvtepi32_ps(sc), D);
    }
  } else if constexpr (L::kQ6) {
    for (int k = 0; k < 4; ++k) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(c + 32 + 64 * k + 32 * h));
      const __m256 s[4] = {
          _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24)),
          _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24)),
          _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24)),
          _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24)),
      };
      dw[2 * k] = _mm256_mul_ps(s[0], D), mw[2 * k] = _mm256_mul_ps(s[1], D);
      dw[2 * k + 1] = _mm256_mul_ps(s[2], D), mw[2 * k + 1] = _mm256_mul_ps(s[3], D);
    }
  } else {  // the 6-bit fields of k_scale_min (linear_kquant.h), a row a lane
    const __m256 M = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 32 + 16 * h))));
    const __m256i s0 = _mm256_loadu_si256((const __m256i*)(c + 64 + 32 * h));
    const __m256i s1 = _mm256_loadu_si256((const __m256i*)(c + 128 + 32 * h));
    const __m256i s2 = _mm256_loadu_si256((const __m256i*)(c + 192 + 32 * h));
    const __m256i m63 = _mm256_set1_epi32(63), m15 = _mm256_set1_epi32(15), m48 = _mm256_set1_epi32(48);
    for (int j = 0; j < 4; ++j) {
      const __m128i n = _mm_cvtsi32_si128(8 * j), top = _mm_cvtsi32_si128(8 * j + 2);
      dw[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(s0, n), m63)), D);
      mw[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(s1, n), m63)), M);
      const __m256i sc = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi32(s2, n), m15), _mm256_and_si256(_mm256_srl_epi32(s0, top), m48));
      const __m256i mn = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi32(s2, _mm_cvtsi32_si128(8 * j + 4)), m15),
                                         _mm256_and_si256(_mm256_srl_epi32(s1, top), m48));
      dw[4 + j] = _mm256_mul_ps(_mm256_cvtepi32_ps(sc), D);
      mw[4 + j] = _mm256_mul_ps(_mm256_cvtepi32_ps(mn), M);
    }
  }
}

// Unit j of a cell, rows 8h..8h+7: w[k] lane r = row 8h + r's 4 weight bytes of chunk k
template <class L>
inline void lk2_quants(const uint8_t* c, int j, int h, __m256i (&w)[8]) {
  const uint8_t* u = c + L::kHead + (L::kMid + L::kLow) * j;
  if constexpr (L::kQ3) {  // 2-bit fields (chunk 4 * half + e at bits 2e) | the high bit (chunk k at bit k) << 2
    const __m256i hb = _mm256_loadu_si256((const __m256i*)(u + 32 * h)), m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(u + L::kMid + 64 * half + 32 * h));
      for (int e = 0; e < 4; ++e) {
        const int k = 4 * half + e;
        w[k] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2 * e), m3), _mm256_and_si256(lane2_move_bit(hb, k, 2), m4));
      }
    }
    return;
  }
  lane2_nibbles(u + L::kMid, L::kFifth ? u : nullptr, h, w);
  if constexpr (L::kQ6) {  // the two high bits of chunk 4 * half + e at bits 2e, to bits 4..5
    const __m256i m = _mm256_set1_epi8(0x30);
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(u + 64 * half + 32 * h));
      for (int e = 0; e < 4; ++e) w[4 * half + e] = _mm256_or_si256(w[4 * half + e], _mm256_and_si256(lane2_move_bit(v, 2 * e, 4), m));
    }
  }
}

// Per-16 sums of token t's integer activations (P = 2: 256 * hi + lo), for Q6_K's and Q3_K's
// offsets
template <int P>
inline void lk2_isum16(const QAct& a, int t, int32_t* out) {
  const int8_t* hr = a.q + (size_t)t * a.nbp * 32;
  const int8_t* lr = (const int8_t*)a.lo + (size_t)t * a.nbp * 32;
  for (int g = 0; g < 2 * a.nb; ++g) {
    int32_t sh = 0, sl = 0;
    for (int e = 0; e < 16; ++e) sh += hr[16 * g + e], sl += P == 2 ? lr[16 * g + e] : 0;
    out[g] = P == 2 ? 256 * sh + sl : sh;
  }
}

// facc plus token t's integer sums of unit (32-block) b, i0 of its elements 0..15 and i1 of
// 16..31, scaled: kHalves (Q6_K, Q3_K) dw / mw scale the two 16-groups, each less its offset
// kOff16 times the group's activation sum; else dw * (i0 + i1) plus the minimum mw times s
template <class L>
inline __m256 lk2_scaled(__m256 facc, __m256i i0, __m256i i1, __m256 dw, __m256 mw, const QAct& a, const int32_t* is16,
                         size_t t, int b) {
  const size_t so = t * (size_t)a.nbp + b;
  const __m256 dx = _mm256_set1_ps(a.d[so]);
  if constexpr (L::kHalves) {
    const int32_t* gs = is16 + t * (2 * a.nb) + 2 * b;
    i0 = _mm256_sub_epi32(i0, _mm256_set1_epi32(L::kOff16 * gs[0]));
    i1 = _mm256_sub_epi32(i1, _mm256_set1_epi32(L::kOff16 * gs[1]));
    facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(dw, dx), facc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(mw, dx), facc);
  } else {
    facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), _mm256_mul_ps(dw, dx), facc);
    return _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[so]), facc);
  }
}

// Rows 8h..8h+7 of group g against tokens t0..t0+C-1
template <class L, int C, int P>
inline void lk2_half(const uint8_t* W, int nsb, int g, int h, const QAct& a, const int32_t* is16, int t0, float* y,
                     int ldy, int N) {
  __m256 facc[C];
  for (int c = 0; c < C; ++c) facc[c] = _mm256_setzero_ps();
  const size_t xs = (size_t)a.nbp * 32;
  for (int s = 0; s < nsb; ++s) {
    const uint8_t* cell = lk_cell<L>(W, nsb, g, s);
#if HIPC_LANE2_PREFETCH
    if (h == 0)
      for (int o = 0; o < 16 * L::kBytes; o += 64) _mm_prefetch((const char*)(cell + HIPC_LANE2_PREFETCH + o), _MM_HINT_T0);
#endif
    __m256 dw[8], mw[8];
    lk2_scales<L>(cell, h, dw, mw);
    for (int j = 0; j < 8; ++j) {
      __m256i w[8];
      lk2_quants<L>(cell, j, h, w);
      const int b = 8 * s + j;
      for (int c = 0; c < C; ++c) {
        const size_t t = (size_t)(t0 + c);
        __m256i i0, i1;
        lane2_dot_halves<L::kQ6 ? 2 : 4>(w, a.q + t * xs + 32 * (size_t)b, i0, i1);
        if constexpr (P == 2) {
          __m256i l0, l1;
          lane2_dot_halves<L::kQ6 ? 2 : 4>(w, (const int8_t*)a.lo + t * xs + 32 * (size_t)b, l0, l1);
          i0 = _mm256_add_epi32(_mm256_slli_epi32(i0, 8), l0);
          i1 = _mm256_add_epi32(_mm256_slli_epi32(i1, 8), l1);
        }
        facc[c] = lk2_scaled<L>(facc[c], i0, i1, dw[j], mw[j], a, is16, t, b);
      }
    }
  }
  lane2_store<C>(facc, y, ldy, t0, 16 * g + 8 * h, N);
}

// Chunk k of unit j of a cell, rows 8h..8h+7 (lk2_quants' w[k] alone)
template <class L>
inline __m256i lk2_chunk(const uint8_t* c, int j, int h, int k) {
  const uint8_t* u = c + L::kHead + (L::kMid + L::kLow) * j;
  if constexpr (L::kQ3) {
    const __m256i hb = _mm256_loadu_si256((const __m256i*)(u + 32 * h));
    const __m256i v = _mm256_loadu_si256((const __m256i*)(u + L::kMid + 64 * (k / 4) + 32 * h));
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2 * (k % 4)), _mm256_set1_epi8(3)),
                           _mm256_and_si256(lane2_move_bit(hb, k, 2), _mm256_set1_epi8(4)));
  }
  const __m256i v = _mm256_loadu_si256((const __m256i*)(u + L::kMid + 64 * (k >> 1) + 32 * h));
  __m256i w = _mm256_and_si256(k & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
  if constexpr (L::kFifth) {
    const __m256i f = _mm256_loadu_si256((const __m256i*)(u + 32 * h));
    w = _mm256_or_si256(w, _mm256_and_si256(lane2_move_bit(f, k, 4), _mm256_set1_epi8(16)));
  }
  if constexpr (L::kQ6) {
    const __m256i hv = _mm256_loadu_si256((const __m256i*)(u + 64 * (k / 4) + 32 * h));
    w = _mm256_or_si256(w, _mm256_and_si256(lane2_move_bit(hv, 2 * (k % 4), 4), _mm256_set1_epi8(0x30)));
  }
  return w;
}

// lane2_pair for the K-quants: both halves of group g against tokens t0..t0+C-1, a unit's
// chunks taken by parity (part p: chunks p, p + 2, p + 4, p + 6, the 16-group of elements
// 16p..16p+15: kHalves' two sums), G chunks' int16 pairs added before vpmaddwd
template <class L, int C, int P>
__attribute__((always_inline)) inline void lk2_pair(const uint8_t* W, int nsb, int g, const QAct& a, const int32_t* is16, int t0, float* y, int ldy,
                     int N) {
  constexpr int G = L::kQ6 ? 2 : 4;
  __m256 facc[2][C];
  for (int c = 0; c < C; ++c) facc[0][c] = facc[1][c] = _mm256_setzero_ps();
  const size_t xs = (size_t)a.nbp * 32;
  for (int s = 0; s < nsb; ++s) {
    const uint8_t* cell = lk_cell<L>(W, nsb, g, s);
#if HIPC_LANE2_PREFETCH
    for (int o = 0; o < 16 * L::kBytes; o += 64) _mm_prefetch((const char*)(cell + HIPC_LANE2_PREFETCH + o), _MM_HINT_T0);
#endif
    __m256 dw[2][8], mw[2][8];
    lk2_scales<L>(cell, 0, dw[0], mw[0]);
    lk2_scales<L>(cell, 1, dw[1], mw[1]);
    for (int j = 0; j < 8; ++j) {
      const int b = 8 * s + j;
      __m256i I[2][2][C];  // [half][part][token]
      for (int part = 0; part < 2; ++part) {
        __m256i w0[4], w1[4];
        for (int k = 0; k < 4; ++k) w0[k] = lk2_chunk<L>(cell, j, 0, part + 2 * k), w1[k] = lk2_chunk<L>(cell, j, 1, part + 2 * k);
        for (int c = 0; c < C; ++c) {
          __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
          for (int plane = 0; plane < P; ++plane) {
            const int8_t* x = (plane ? (const int8_t*)a.lo : a.q) + (size_t)(t0 + c) * xs + 32 * (size_t)b;
            const __m256i m = _mm256_set1_epi16(P == 2 && plane == 0 ? 256 : 1);
            for (int k0 = 0; k0 < 4; k0 += G) {
              __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
              for (int k = k0; k < k0 + G; ++k) {
                const __m256i xb = lane2_bcast4(x + chunk_elem(part + 2 * k));
                s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w0[k], xb));
                s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w1[k], xb));
              }
              i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(s0, m));
              i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(s1, m));
            }
          }
          I[0][part][c] = i0, I[1][part][c] = i1;
        }
      }
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < C; ++c) {
          facc[h][c] = lk2_scaled<L>(facc[h][c], I[h][0][c], I[h][1][c], dw[h][j], mw[h][j], a, is16, t0 + c, 8 * s + j);
        }
    }
  }
  lane2_store<C>(facc[0], y, ldy, t0, 16 * g, N);
  lane2_store<C>(facc[1], y, ldy, t0, 16 * g + 8, N);
}

template <class L, int P>
inline void lk2_matmul(const float* x, int T, int K, const void* Wv, int N, float* y, int ldy) {
  if (T <= 0 || N <= 0) return;
  const uint8_t* W = (const uint8_t*)Wv;
  const int nsb = K / 256, ngroups = (N + 15) / 16;
  const QAct a = lane2_quantize<P>(x, T, K, L::kHalves ? (size_t)T * (K / 16) * 4 : 0);
  const int32_t* is16 = (const int32_t*)a.ext;
  if constexpr (L::kHalves)
    for (int t = 0; t < T; ++t) lk2_isum16<P>(a, t, (int32_t*)a.ext + (size_t)t * (K / 16));
#pragma omp parallel for schedule(static) if ((long long)T * N * K >= kParallelMinWork)
  for (int g = 0; g < ngroups; ++g) {
    int t0 = 0;
    if constexpr (kLane2Pair)
      for (; t0 + kLane2PairChunk <= T; t0 += kLane2PairChunk) lk2_pair<L, kLane2PairChunk, P>(W, nsb, g, a, is16, t0, y, ldy, N);
    lane2_tokens(T - t0, g, N, [&](auto c, int h, int t) {
      lk2_half<L, decltype(c)::value, P>(W, nsb, g, h, a, is16, t0 + t, y, ldy, N);
    });
  }
}

}  // namespace detail

// y[t, n] = sum_k x[t, k] * W[n, k], W in the lanes layout (linear_lanes.h); the compiler
// picks it on AVX2 for these nine types (passes/lanes.py).
HIPC_LANES_ENTRY(q4_0, LayQ4_0, lane2_matmul, lane_embed_row)
HIPC_LANES_ENTRY(q4_1, LayQ4_1, lane2_matmul, lane_embed_row)
HIPC_LANES_ENTRY(q5_0, LayQ5_0, lane2_matmul, lane_embed_row)
HIPC_LANES_ENTRY(q5_1, LayQ5_1, lane2_matmul, lane_embed_row)
HIPC_LANES_ENTRY(q8_0, LayQ8_0, lane2_matmul, lane_embed_row)
HIPC_LANES_ENTRY(q4_k, LKQ4K, lk2_matmul, lk_embed_row)
HIPC_LANES_ENTRY(q5_k, LKQ5K, lk2_matmul, lk_embed_row)
HIPC_LANES_ENTRY(q6_k, LKQ6K, lk2_matmul, lk_embed_row)
HIPC_LANES_ENTRY(q3_k, LKQ3K, lk2_matmul, lk_embed_row)
#endif  // HIPC_ISA_AVX2
#undef HIPC_LANES_ENTRY

}  // namespace hipc
