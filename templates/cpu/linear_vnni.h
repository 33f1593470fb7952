// linear_vnni.h -- quantized matmuls on AVX512-VNNI (decode GEMV, prefill GEMM).
// The fast path on current x86 servers; its register layouts (transposed groups,
// row lanes) have nothing in common with the AVX2 ones, so it stands alone.
#pragma once

namespace hipc {

// ====================================================================================
// AVX512-VNNI quantized kernels
//
// Per 32-element block b of weight row n and token t the exact integer dot product
//     I[b] = sum_{e<32} u[n, 32b+e] * q[t, 32b+e]        (u: unsigned weight byte)
// is computed with vpdpbusd (u8 x s8, 4 products per int32 lane), then scaled:
//     y[t, n] = sum_b ( I[b] * dw[b] * dx[b]  +  mw[b] * s[b] )
// where per type
//   Q4_1: u = nibble (0..15), w = u*d + m       -> mw = m
//   Q4_0: u = nibble (0..15), w = (u - 8)*d     -> mw = -8*d   (or int32 "-8*isum")
//   Q8_0: u = q + 128 (0..255), w = (u - 128)*d -> mw = -128*d (or int32 "-128*isum")
// (s = dx * sum(q) carries the offset; isum = sum(q) does it exactly in int32.)
//
// Decode (T == 1) uses two register layouts for the weight bytes of one row:
// 1. "transposed group" (16 blocks = 512 weights): prep() turns the group into 8
//    vectors w[j] (chunk j, lane l = the 4 bytes of block l at chunk_elem(j)), so that
//        I[l] = sum_j vpdpbusd(w[j], xq[j])[l]       (8 instructions, 16 blocks)
//    and one f32 FMA per group applies all 16 block scales. For Q4 types prep is ~20
//    permutes (vpermt2d / vpermt2b) + nibble masks. Used for the Q4 GEMVs.
// 2. "natural pairs": one zmm holds two consecutive blocks in element order (two
//    broadcast loads + nibble split), one vpdpbusd gives 8 int32 partial sums per block,
//    and each lane is scaled by its block's dw*dx (one vpermps from the 16 scales of the
//    surrounding 16-block window). Used for the Q8_0 GEMV (no gathers) and for short
//    K tails (K/32 % 16 <= 8), which would otherwise pay for a whole transposed group.
// A batch's decode step (T = 2..7) uses the transposed groups too, each prepared group
// against every token (q_gemv_batch). Prefill (T > 7) uses "row lanes" (lane = output
// row, activations broadcast), see rl_tile below.
// ====================================================================================
#if defined(HIPC_ISA_AVX512)
namespace detail {

#ifndef HIPC_PREFETCH_BYTES
#define HIPC_PREFETCH_BYTES 2048  // GEMV software prefetch distance (into L1) along the weights
#endif
#ifndef HIPC_PREFETCH_HINT
#define HIPC_PREFETCH_HINT _MM_HINT_T0
#endif
constexpr int kNatTailMax = 8;  // K tails of <= 8 blocks use natural pairs

// Permute / gather tables (built at compile time).
struct PrepTables {
  // Q4_1: 16 blocks = 80 dwords in 5 zmm; out o = 0..3 is qs dword o of each block
  // (dword 5l+1+o), out 4 is the (d, m) dword (5l). Built as
  //   P = perm2(r0,r1); Q = perm2(r2,r3); M = blend(kb, P, Q); O = mask_perm(M, kc, r4).
  alignas(64) int32_t q41_idx[5][3][16];
  uint16_t q41_kb[5], q41_kc[5];
  // Q4_0 (VBMI): 16 blocks = 288 bytes in r0..r3 + 32 bytes of r4; same scheme on bytes.
  // out o = 0..3: bytes 18l+2+4o+i; out 4: bytes 18l+i (d in the low half).
  alignas(64) uint8_t q40_idx[5][3][64];
  uint64_t q40_kb[5], q40_kc[5];
  // gather offsets (bytes, relative to the group start): Q4_0 qs dwords and d (no-VBMI
  // prep), Q8_0 d, Q4_1 (d, m).
  alignas(64) int32_t q40_gather[5][16];
  alignas(64) int32_t q80_gather_d[16];
  alignas(64) int32_t q41_gather_dm[16];
  // Q5_0 d, Q5_1 (d, m)
  alignas(64) int32_t q50_gather_d[16];
  alignas(64) int32_t q51_gather_dm[16];
  // Q5_0 / Q5_1 (VBMI): 16 blocks = 352 / 384 bytes in r0..r5; out o = 0..3: qs dword o of
  // each block, 4: its qh, 5: its scale dword. Sources < 128 in r0:r1, < 256 in r2:r3, the
  // rest in r4:r5 (kb: from r2:r3, kc: from r4:r5).
  alignas(64) uint8_t q5_idx[2][6][3][64];
  uint64_t q5_kb[2][6], q5_kc[2][6];
  // bit selectors (vpshufbitqmb) of chunk j: byte 4l' + i of a qword (l' = its 2 lanes) picks
  // bit chunk_elem(j) + i of that lane's qh dword
  alignas(64) uint8_t q5_bits[8][64];
  // vpermw: low 16 words <- even words (d), high 16 words <- odd words (m).
  alignas(64) int16_t dm_words[32];
  // natural pairs: lane l of pair p belongs to block 2p + (l >= 8)
  alignas(64) int32_t pair_idx[8][16];
  // natural pairs, Q4: per-qword shift that turns [qs, qs, qs', qs'] into
  // [lo, hi, lo', hi'] nibbles
  alignas(64) int64_t nib_shift[8];
  // 4-row GEMV tail (<= 4 blocks per row): lane 4r+i = row r, tail block i.
  // tail_pair_idx[r][p]: lanes of pair p of row r; tail_rep: lane -> block i.
  alignas(64) int32_t tail_pair_idx[4][2][16];
  alignas(64) int32_t tail_rep[16];
};

constexpr PrepTables make_prep_tables() {
  PrepTables t{};
  for (int o = 0; o < 5; ++o) {
    t.q41_kb[o] = 0;
    t.q41_kc[o] = 0;
    for (int l = 0; l < 16; ++l) {
      const int s = o < 4 ? 5 * l + 1 + o : 5 * l;
      t.q41_idx[o][0][l] = s < 32 ? s : 0;
      t.q41_idx[o][1][l] = (s >= 32 && s < 64) ? s - 32 : 0;
      t.q41_idx[o][2][l] = s >= 64 ? s - 64 : 0;
      if (s >= 32 && s < 64) t.q41_kb[o] |= (uint16_t)(1u << l);
      if (s >= 64) t.q41_kc[o] |= (uint16_t)(1u << l);
    }
    t.q40_kb[o] = 0;
    t.q40_kc[o] = 0;
    for (int l = 0; l < 16; ++l) {
      for (int i = 0; i < 4; ++i) {
        const int L = 4 * l + i;
        const int s = o < 4 ? 18 * l + 2 + 4 * o + i : 18 * l + (i & 1);
        t.q40_idx[o][0][L] = (uint8_t)(s < 128 ? s : 0);
        t.q40_idx[o][1][L] = (uint8_t)((s >= 128 && s < 256) ? s - 128 : 0);
        t.q40_idx[o][2][L] = (uint8_t)(s >= 256 ? s - 256 : 0);
        if (s >= 128 && s < 256) t.q40_kb[o] |= 1ull << L;
        if (s >= 256) t.q40_kc[o] |= 1ull << L;
      }
      t.q40_gather[o][l] = o < 4 ? 18 * l + 2 + 4 * o : 18 * l;
    }
  }
  for (int l = 0; l < 16; ++l) {
    t.q80_gather_d[l] = 34 * l;
    t.q41_gather_dm[l] = 20 * l;
    t.q50_gather_d[l] = 22 * l;
    t.q51_gather_dm[l] = 24 * l;
  }
  for (int v = 0; v < 2; ++v) {  // 0: Q5_0 (22 bytes: d, qh, qs), 1: Q5_1 (24: d m, qh, qs)
    const int B = v ? 24 : 22, qh = v ? 4 : 2, qs = v ? 8 : 6;
    for (int o = 0; o < 6; ++o) {
      t.q5_kb[v][o] = t.q5_kc[v][o] = 0;
      for (int L = 0; L < 64; ++L) {
        const int l = L / 4, i = L % 4;
        const int s = o < 4 ? B * l + qs + 4 * o + i : o == 4 ? B * l + qh + i : B * l + (v ? i : i & 1);
        for (int r = 0; r < 3; ++r) t.q5_idx[v][o][r][L] = (uint8_t)(s >= 128 * r && s < 128 * (r + 1) ? s - 128 * r : 0);
        if (s >= 128 && s < 256) t.q5_kb[v][o] |= 1ull << L;
        if (s >= 256) t.q5_kc[v][o] |= 1ull << L;
      }
    }
  }
  for (int j = 0; j < 8; ++j)
    for (int b = 0; b < 64; ++b) t.q5_bits[j][b] = (uint8_t)(32 * ((b % 8) / 4) + chunk_elem(j) + b % 4);
  for (int i = 0; i < 16; ++i) {
    t.dm_words[i] = (int16_t)(2 * i);
    t.dm_words[16 + i] = (int16_t)(2 * i + 1);
  }
  for (int p = 0; p < 8; ++p)
    for (int l = 0; l < 16; ++l) t.pair_idx[p][l] = 2 * p + (l >= 8 ? 1 : 0);
  for (int i = 0; i < 8; ++i) t.nib_shift[i] = (i & 2) ? 4 : 0;
  for (int r = 0; r < 4; ++r)
    for (int p = 0; p < 2; ++p)
      for (int l = 0; l < 16; ++l) t.tail_pair_idx[r][p][l] = 4 * r + 2 * p + (l >= 8 ? 1 : 0);
  for (int l = 0; l < 16; ++l) t.tail_rep[l] = l & 3;
  return t;
}

inline constexpr PrepTables kPrep = make_prep_tables();

inline __m512i ld_idx(const void* p) { return _mm512_load_si512(p); }

// dword mask with the low n (0..16) bits set
inline __mmask16 mask16(int n) {
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}
inline __mmask64 mask64(int n) {
  return n >= 64 ? ~(__mmask64)0 : n <= 0 ? (__mmask64)0 : (__mmask64)((1ull << n) - 1);
}

#ifndef HIPC_PREFETCH2_BYTES
#define HIPC_PREFETCH2_BYTES 8192  // second, farther prefetch into L2 (0 = off)
#endif
// Prefetch [p, p+bytes) (p is already HIPC_PREFETCH_BYTES ahead of the current reads).
inline void prefetch_range(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) {
    _mm_prefetch((const char*)(p + o), HIPC_PREFETCH_HINT);
    if (HIPC_PREFETCH2_BYTES > 0)
      _mm_prefetch((const char*)(p + o + HIPC_PREFETCH2_BYTES - HIPC_PREFETCH_BYTES), _MM_HINT_T1);
  }
}

// A prepared transposed group: 8 chunks of unsigned weight bytes + block scales.
struct WGroup {
  __m512i w[8];
  __m512 dw;
  __m512 mw;  // read only where Q::kMin (Q4_1, Q5_1)
};
// A group of rows past N: read as zero weights.
inline void clear(WGroup& z) {
  for (int j = 0; j < 8; ++j) z.w[j] = _mm512_setzero_si512();
  z.dw = z.mw = _mm512_setzero_ps();
}
// The row-lane tiles' outputs: V groups of 16 rows from n0 (masked at N) for C tokens from t0.
template <int V, int C>
inline void store_tile(const __m512 (&facc)[V][C], int t0, int n0, int N, float* y, int ldy) {
  for (int v = 0; v < V; ++v) {
    const int n = n0 + 16 * v;
    const __mmask16 k = mask16(N - n);
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(y + (size_t)(t0 + c) * ldy + n, k, facc[v][c]);
  }
}
// Split 16 qs dwords Q (8 nibbles each) into low-nibble and high-nibble chunks.
inline void split_nibbles(__m512i q, __m512i& lo, __m512i& hi) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(q, m4);
  hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
}
// Same, but the high nibbles stay in place (hi16 = 16 * nibble): one op cheaper; the
// caller accumulates them separately and shifts the int32 sum right by 4 (exact).
inline void split_nibbles16(__m512i q, __m512i& lo, __m512i& hi16) {
  lo = _mm512_and_si512(q, _mm512_set1_epi8(0x0F));
  hi16 = _mm512_and_si512(q, _mm512_set1_epi8((char)0xF0));
}

// natural pair of Q4 blocks: qs at p (16 bytes) and p + stride -> [lo, hi, lo', hi']
inline __m512i q4_pair(const uint8_t* p, size_t stride, bool two) {
  __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p));
  if (two) {
    v = _mm512_mask_broadcast_i32x4(v, 0xFF00, _mm_loadu_si128((const __m128i*)(p + stride)));
  } else {
    v = _mm512_maskz_mov_epi32(0x00FF, v);
  }
  v = _mm512_srlv_epi64(v, ld_idx(kPrep.nib_shift));
  return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
}

// masked dword gather p[idx[l]] (zero where k is clear)
inline __m512i gather32(const uint8_t* p, __m512i idx, __mmask16 k) {
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, idx, p, 1);
}

// f16 pairs (d in the low word of each dword of v) -> f32 d, and m from the high words
inline void cvt_dm(__m512i v, __m512& d, __m512& m) {
  const __m512i dm = _mm512_permutexvar_epi16(ld_idx(kPrep.dm_words), v);
  d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
  m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
}

struct KQ4_1 {
  static constexpr size_t kBlockBytes = 20;
  static constexpr int kOffShift = 0;  // no int offset
  static constexpr bool kMin = true;
  static constexpr bool kGemvTransposed = true;
  static constexpr bool kPrepShifted = true;  // prep's odd chunks: 16 * nibble
  // int16 activations: nibbles (0..15) are valid signed bytes too, so the low-byte
  // plane uses the same weight bytes as the signed operand (and keeps no offset).
  static constexpr bool kLoOffset = false;
  static inline __m512i lo_w(__m512i u) { return u; }
  // g: pointer to the first block of the group; nrem: valid blocks (1..16)
  static inline void prep(const uint8_t* g, int nrem, WGroup& out) {
    __m512i r[5];
    if (nrem == 16) {
      for (int k = 0; k < 5; ++k) r[k] = _mm512_loadu_si512(g + 64 * k);
    } else {
      for (int k = 0; k < 5; ++k) r[k] = _mm512_maskz_loadu_epi32(mask16(5 * nrem - 16 * k), g + 64 * k);
    }
    __m512i o[5];
    for (int i = 0; i < 5; ++i) {
      const __m512i p = _mm512_permutex2var_epi32(r[0], ld_idx(kPrep.q41_idx[i][0]), r[1]);
      const __m512i q = _mm512_permutex2var_epi32(r[2], ld_idx(kPrep.q41_idx[i][1]), r[3]);
      const __m512i m = _mm512_mask_blend_epi32(kPrep.q41_kb[i], p, q);
      o[i] = _mm512_mask_permutexvar_epi32(m, kPrep.q41_kc[i], ld_idx(kPrep.q41_idx[i][2]), r[4]);
    }
    for (int c = 0; c < 4; ++c) split_nibbles16(o[c], out.w[2 * c], out.w[2 * c + 1]);
    cvt_dm(o[4], out.dw, out.mw);
  }
  static inline __m512i pair(const uint8_t* b, bool two) { return q4_pair(b + 4, 20, two); }
  // row-lane prep: lane r = block at p + ridx[r] (16 rows, same block index)
  static inline void prep_rows(const uint8_t* p, __m512i ridx, __mmask16 k, WGroup& out) {
    for (int c = 0; c < 4; ++c)
      split_nibbles(gather32(p + 4 + 4 * c, ridx, k), out.w[2 * c], out.w[2 * c + 1]);
    cvt_dm(gather32(p, ridx, k), out.dw, out.mw);
  }
  // scales of 16 blocks at g + idx[l] (zero where k is clear)
  static inline void dm16_idx(const uint8_t* g, __mmask16 k, __m512i idx, __m512& dw, __m512& mw) {
    cvt_dm(gather32(g, idx, k), dw, mw);
  }
  static inline void dm16(const uint8_t* g, int nv, __m512& dw, __m512& mw) {
    dm16_idx(g, mask16(nv), ld_idx(kPrep.q41_gather_dm), dw, mw);
  }
};

struct KQ4_0 {
  static constexpr size_t kBlockBytes = 18;
  static constexpr int kOffShift = 3;  // off = 8
  static constexpr bool kMin = false;
  static constexpr bool kGemvTransposed = true;
  static constexpr bool kPrepShifted = true;
  // the low-byte plane also multiplies the nibbles u = w + 8, so it carries the offset
  static constexpr bool kLoOffset = true;
  static inline __m512i lo_w(__m512i u) { return u; }
  static inline void prep(const uint8_t* g, int nrem, WGroup& out) {
    __m512i o[5];
#if defined(__AVX512VBMI__)
    __m512i r[5];
    if (nrem == 16) {
      for (int k = 0; k < 4; ++k) r[k] = _mm512_loadu_si512(g + 64 * k);
      r[4] = _mm512_maskz_loadu_epi8(mask64(32), g + 256);
    } else {
      for (int k = 0; k < 5; ++k) r[k] = _mm512_maskz_loadu_epi8(mask64(18 * nrem - 64 * k), g + 64 * k);
    }
    for (int i = 0; i < 5; ++i) {
      const __m512i p = _mm512_permutex2var_epi8(r[0], ld_idx(kPrep.q40_idx[i][0]), r[1]);
      const __m512i q = _mm512_permutex2var_epi8(r[2], ld_idx(kPrep.q40_idx[i][1]), r[3]);
      const __m512i m = _mm512_mask_blend_epi8(kPrep.q40_kb[i], p, q);
      o[i] = _mm512_mask_permutexvar_epi8(m, kPrep.q40_kc[i], ld_idx(kPrep.q40_idx[i][2]), r[4]);
    }
#else
    for (int i = 0; i < 5; ++i) o[i] = gather32(g, ld_idx(kPrep.q40_gather[i]), mask16(nrem));
#endif
    for (int c = 0; c < 4; ++c) split_nibbles16(o[c], out.w[2 * c], out.w[2 * c + 1]);
    __m512 unused;
    cvt_dm(o[4], out.dw, unused);
  }
  static inline __m512i pair(const uint8_t* b, bool two) { return q4_pair(b + 2, 18, two); }
  static inline void prep_rows(const uint8_t* p, __m512i ridx, __mmask16 k, WGroup& out) {
    for (int c = 0; c < 4; ++c)
      split_nibbles(gather32(p + 2 + 4 * c, ridx, k), out.w[2 * c], out.w[2 * c + 1]);
    cvt_dm(gather32(p, ridx, k), out.dw, out.mw);
  }
  static inline void dm16_idx(const uint8_t* g, __mmask16 k, __m512i idx, __m512& dw, __m512& mw) {
    __m512 unused;
    cvt_dm(gather32(g, idx, k), dw, unused);
    mw = _mm512_mul_ps(dw, _mm512_set1_ps(-8.0f));
  }
  static inline void dm16(const uint8_t* g, int nv, __m512& dw, __m512& mw) {
    dm16_idx(g, mask16(nv), ld_idx(kPrep.q40_gather[4]), dw, mw);
  }
};

struct KQ8_0 {
  static constexpr size_t kBlockBytes = 34;
  static constexpr int kOffShift = 7;  // off = 128
  static constexpr bool kMin = false;
  static constexpr bool kGemvTransposed = false;  // no prep(): the GEMV uses natural pairs
  // the low-byte plane is the unsigned operand, so it takes the weights as stored
  // (u ^ 0x80 = w) and needs no offset
  static constexpr bool kLoOffset = false;
  static inline __m512i lo_w(__m512i u) { return _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80)); }
  static inline __m512i pair(const uint8_t* b, bool two) {
    __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 2)));
    if (two) {
      v = _mm512_mask_broadcast_i64x4(v, 0xF0, _mm256_loadu_si256((const __m256i*)(b + 36)));
    } else {
      v = _mm512_maskz_mov_epi64(0x0F, v);
    }
    return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
  }
  static inline void prep_rows(const uint8_t* p, __m512i ridx, __mmask16 k, WGroup& out) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int j = 0; j < 8; ++j) out.w[j] = _mm512_xor_si512(gather32(p + 2 + chunk_elem(j), ridx, k), flip);
    cvt_dm(gather32(p, ridx, k), out.dw, out.mw);
  }
  static inline void dm16_idx(const uint8_t* g, __mmask16 k, __m512i idx, __m512& dw, __m512& mw) {
    __m512 unused;
    cvt_dm(gather32(g, idx, k), dw, unused);
    mw = _mm512_mul_ps(dw, _mm512_set1_ps(-128.0f));
  }
  static inline void dm16(const uint8_t* g, int nv, __m512& dw, __m512& mw) {
    dm16_idx(g, mask16(nv), ld_idx(kPrep.q80_gather_d), dw, mw);
  }
};

// IQ4_NL's 16 table values as u = v + 128 in every 128-bit lane (a vpshufb table for nibbles;
// IQ4_XS's too, linear_vnni_k.h)
inline __m512i iq4_u_table() {
  return _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)kIq4nlValues)),
                         _mm512_set1_epi8((char)0x80));
}

// IQ4_NL (blocks.h: d, then Q4_0's nibble layout indexing a table of 16 signed values): each
// nibble is looked up as u = v + 128 (one byte shuffle), then everything is Q8_0's: offset
// 128, the low plane on v = u ^ 0x80.
struct KIQ4NL {
  static constexpr size_t kBlockBytes = 18;
  static constexpr int kOffShift = 7;  // u = v + 128
  static constexpr bool kMin = false;
  static constexpr bool kGemvTransposed = false;  // natural pairs
  static constexpr bool kLoOffset = false;
  static inline __m512i lo_w(__m512i u) { return _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80)); }
  static inline __m512i table() { return iq4_u_table(); }
  static inline __m512i pair(const uint8_t* b, bool two) {
    const __m512i u = _mm512_shuffle_epi8(table(), q4_pair(b + 2, 18, two));
    return two ? u : _mm512_mask_blend_epi32(0x00FF, _mm512_set1_epi8((char)0x80), u);  // v = 0 past the block
  }
  // Q4_0's nibbles and scales (the same block layout), then the table and offset 128
  static inline void prep_rows(const uint8_t* p, __m512i ridx, __mmask16 k, WGroup& out) {
    KQ4_0::prep_rows(p, ridx, k, out);
    const __m512i tab = table();
    for (int j = 0; j < 8; ++j) out.w[j] = _mm512_shuffle_epi8(tab, out.w[j]);
  }
  static inline void dm16_idx(const uint8_t* g, __mmask16 k, __m512i idx, __m512& dw, __m512& mw) {
    KQ4_0::dm16_idx(g, k, idx, dw, mw);
    mw = _mm512_mul_ps(dw, _mm512_set1_ps(-128.0f));
  }
  static inline void dm16(const uint8_t* g, int nv, __m512& dw, __m512& mw) {
    KQ4_0::dm16(g, nv, dw, mw);
    mw = _mm512_mul_ps(dw, _mm512_set1_ps(-128.0f));
  }
};

// Q5_0 / Q5_1: u = nibble | (bit e of qh) << 4 (0..31), folded into the weight bytes as
// the block is unpacked, so the Q4 machinery runs unchanged on 5-bit values. Natural
// pairs keep element order (bytes 0..15 = elements 0..15 of the first block, 16..31 its
// elements 16..31, then the second block), so qh of two blocks is directly the byte mask.
inline uint32_t qh_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
template <size_t kBytes, size_t kQh>
inline __m512i q5_pair(const uint8_t* b, bool two) {
  const __m512i v = q4_pair(b + kQh + 4, kBytes, two);
  uint64_t hb;
  if (two) {
    hb = (uint64_t)qh_u32(b + kQh) | ((uint64_t)qh_u32(b + kBytes + kQh) << 32);
  } else {
    hb = qh_u32(b + kQh);
  }
  return _mm512_mask_add_epi8(v, (__mmask64)hb, v, _mm512_set1_epi8(16));  // v <= 15: + 16 sets bit 4
}
// Row lanes: qh dword per lane; chunk j holds elements chunk_elem(j)..+3, whose 4 high
// bits go to bit 4 of bytes 0..3: x * 0x00204081 puts bit k of x at bit 8k (the other
// products land on bits 7m+k, none of them at a multiple of 8 and none overlapping).
inline void q5_rows(const uint8_t* qh, const uint8_t* qs, __m512i ridx, __mmask16 k, WGroup& out) {
  for (int c = 0; c < 4; ++c) split_nibbles(gather32(qs + 4 * c, ridx, k), out.w[2 * c], out.w[2 * c + 1]);
  const __m512i h = gather32(qh, ridx, k);
  for (int j = 0; j < 8; ++j) {
    const __m512i b4 = _mm512_and_si512(_mm512_srli_epi32(h, chunk_elem(j)), _mm512_set1_epi32(15));
    const __m512i spread = _mm512_and_si512(_mm512_mullo_epi32(b4, _mm512_set1_epi32(0x00204081)),
                                            _mm512_set1_epi32(0x01010101));
    out.w[j] = _mm512_or_si512(out.w[j], _mm512_slli_epi32(spread, 4));
  }
}

// Transposed group of 16 Q5 blocks (V 0: Q5_0, 1: Q5_1): byte permutes gather each block's
// qs dwords, qh and scale dword into lane = block (as KQ4_0::prep), the nibbles split in
// place (no 16 * nibble chunks: kPrepShifted false), and bit 4 of every byte set from qh by
// one vpshufbitqmb and one masked add per chunk. Gathering the same by vpgatherdd (q5_rows,
// lane = block) made the SmolLM2 Q4_K_M decode slower than natural pairs (88.9 against
// 92.7 tok/s, one core of the AMD EPYC machine).
#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define HIPC_Q5_TRANSPOSED 1
template <int V>
inline void q5_prep(const uint8_t* g, int nrem, WGroup& out) {
  constexpr int B = V ? 24 : 22;
  __m512i r[6];
  for (int k = 0; k < 6; ++k) r[k] = _mm512_maskz_loadu_epi8(mask64(B * nrem - 64 * k), g + 64 * k);
  __m512i o[6];
  for (int i = 0; i < 6; ++i) {
    const __m512i p = _mm512_permutex2var_epi8(r[0], ld_idx(kPrep.q5_idx[V][i][0]), r[1]);
    const __m512i q = _mm512_permutex2var_epi8(r[2], ld_idx(kPrep.q5_idx[V][i][1]), r[3]);
    const __m512i u = _mm512_permutex2var_epi8(r[4], ld_idx(kPrep.q5_idx[V][i][2]), r[5]);
    o[i] = _mm512_mask_blend_epi8(kPrep.q5_kc[V][i], _mm512_mask_blend_epi8(kPrep.q5_kb[V][i], p, q), u);
  }
  for (int c = 0; c < 4; ++c) split_nibbles(o[c], out.w[2 * c], out.w[2 * c + 1]);
  const __m512i sixteen = _mm512_set1_epi8(16);
  for (int j = 0; j < 8; ++j) {
    const __mmask64 h = _mm512_bitshuffle_epi64_mask(o[4], ld_idx(kPrep.q5_bits[j]));
    out.w[j] = _mm512_mask_add_epi8(out.w[j], h, out.w[j], sixteen);
  }
  cvt_dm(o[5], out.dw, out.mw);  // Q5_0's dword is (d, d): mw unread there (kMin false)
}
#else
#define HIPC_Q5_TRANSPOSED 0
#endif

struct KQ5_0 {
  static constexpr size_t kBlockBytes = 22;
  static constexpr int kOffShift = 4;  // off = 16
  static constexpr bool kMin = false;
  // transposed groups where the ISA has byte permutes and bit shuffles, else natural pairs
  // (the 5th bit is one mask op there)
  static constexpr bool kGemvTransposed = HIPC_Q5_TRANSPOSED;
  static constexpr bool kPrepShifted = false;
  static constexpr bool kLoOffset = true;  // as Q4_0: u <= 31 is its own signed view
  static inline __m512i lo_w(__m512i u) { return u; }
  static inline __m512i pair(const uint8_t* b, bool two) { return q5_pair<22, 2>(b, two); }
#if HIPC_Q5_TRANSPOSED
  static inline void prep(const uint8_t* g, int nrem, WGroup& out) { q5_prep<0>(g, nrem, out); }
#endif
  static inline void prep_rows(const uint8_t* p, __m512i ridx, __mmask16 k, WGroup& out) {
    q5_rows(p + 2, p + 6, ridx, k, out);
    cvt_dm(gather32(p, ridx, k), out.dw, out.mw);
    out.mw = _mm512_mul_ps(out.dw, _mm512_set1_ps(-16.0f));
  }
  static inline void dm16_idx(const uint8_t* g, __mmask16 k, __m512i idx, __m512& dw, __m512& mw) {
    __m512 unused;
    cvt_dm(gather32(g, idx, k), dw, unused);
    mw = _mm512_mul_ps(dw, _mm512_set1_ps(-16.0f));
  }
  static inline void dm16(const uint8_t* g, int nv, __m512& dw, __m512& mw) {
    dm16_idx(g, mask16(nv), ld_idx(kPrep.q50_gather_d), dw, mw);
  }
};

struct KQ5_1 {
  static constexpr size_t kBlockBytes = 24;
  static constexpr int kOffShift = 0;
  static constexpr bool kMin = true;
  static constexpr bool kGemvTransposed = HIPC_Q5_TRANSPOSED;
  static constexpr bool kPrepShifted = false;
  static constexpr bool kLoOffset = false;
  static inline __m512i lo_w(__m512i u) { return u; }
  static inline __m512i pair(const uint8_t* b, bool two) { return q5_pair<24, 4>(b, two); }
#if HIPC_Q5_TRANSPOSED
  static inline void prep(const uint8_t* g, int nrem, WGroup& out) { q5_prep<1>(g, nrem, out); }
#endif
  static inline void prep_rows(const uint8_t* p, __m512i ridx, __mmask16 k, WGroup& out) {
    q5_rows(p + 4, p + 8, ridx, k, out);
    cvt_dm(gather32(p, ridx, k), out.dw, out.mw);
  }
  static inline void dm16_idx(const uint8_t* g, __mmask16 k, __m512i idx, __m512& dw, __m512& mw) {
    cvt_dm(gather32(g, idx, k), dw, mw);
  }
  static inline void dm16(const uint8_t* g, int nv, __m512& dw, __m512& mw) {
    dm16_idx(g, mask16(nv), ld_idx(kPrep.q51_gather_dm), dw, mw);
  }
};

// ------------------------------------------------------------------------------------
// int16 activations as two int8 planes
//
// q = round(x * 32767 / max|x|) per 32-block is bit for bit what quantize_act16
// (linear_a16.h) computes; it is stored as hi = q >> 8 (signed, -128..127) in a.q and
// lo = q & 255 (unsigned) in a.lo, so q = 256*hi + lo. vpdpbusd multiplies unsigned by
// signed bytes, so hi is the signed operand against the unsigned weight bytes u (as in
// the int8 kernels) and lo the unsigned operand against Q::lo_w(u), a signed view of the
// same weights. Per block, with u = w + off:
//     I = 256 * sum(u*hi) + sum(lo_w(u)*lo) - off * isum,
//     isum = 256 * sum(hi) + (Q::kLoOffset ? sum(lo) : 0)
// equals sum(w*q) exactly: every term is an integer, and for 32 values |q| <= 32767,
// |u| <= 255 the largest, 256 * 32*255*128 = 2.7e8, is far inside int32. The kernels
// below run the hi plane, shift its int32 sums left by 8 and keep accumulating the lo
// plane on top, so the epilogue (scales, offset, Q4_1's m * sum(x)) is the int8 one.
// d = max|x| / 32767 and s = sum(x) (the float sum, as quantize_act16 has it). With qmax
// 127 the same planes carry int8 activations (hi is 0 or -1): the K-quant kernels then
// give --activations int8's numerics at their int16 speed.
// ------------------------------------------------------------------------------------
inline float quantize_block16(const float* x, int8_t* hi, uint8_t* lo, int32_t& hsum, int32_t& lsum, float& xsum,
                              float qmax = 32767.f) {
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? qmax / amax : 0.f);
  // round to nearest even, as std::lrint in quantize_act16
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
  const __m512i h0 = _mm512_srai_epi32(q0, 8), h1 = _mm512_srai_epi32(q1, 8);
  const __m512i m8 = _mm512_set1_epi32(255);
  const __m512i l0 = _mm512_and_si512(q0, m8), l1 = _mm512_and_si512(q1, m8);
  _mm_storeu_si128((__m128i*)hi, _mm512_cvtepi32_epi8(h0));
  _mm_storeu_si128((__m128i*)(hi + 16), _mm512_cvtepi32_epi8(h1));
  _mm_storeu_si128((__m128i*)lo, _mm512_cvtepi32_epi8(l0));
  _mm_storeu_si128((__m128i*)(lo + 16), _mm512_cvtepi32_epi8(l1));
  hsum = _mm512_reduce_add_epi32(_mm512_add_epi32(h0, h1));
  lsum = _mm512_reduce_add_epi32(_mm512_add_epi32(l0, l1));
  xsum = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
  return amax / qmax;
}

template <class Q>
inline void quantize_act16_row(const float* x, int K, const QAct& a, int t, float qmax = 32767.f) {
  const float* xr = x + (size_t)t * K;
  uint8_t* hr = (uint8_t*)a.q + (size_t)t * a.nbp * 32;
  uint8_t* lr = a.lo + (size_t)t * a.nbp * 32;
  float* dr = a.d + (size_t)t * a.nbp;
  float* sr = a.s + (size_t)t * a.nbp;
  int32_t* ir = a.isum + (size_t)t * a.nbp;
  const int nbt = std::min(a.nb, 16 * a.ntg);
  for (int b = 0; b < a.nb; ++b) {
    int8_t hi[32];
    uint8_t lo[32];
    int32_t hsum, lsum;
    dr[b] = quantize_block16(xr + 32 * b, hi, lo, hsum, lsum, sr[b], qmax);
    ir[b] = 256 * hsum + (Q::kLoOffset ? lsum : 0);
    put_block(hr, b, b < nbt, hi);
    put_block(lr, b, b < nbt, lo);
  }
  for (int b = a.nb; b < a.nbp; ++b) {
    dr[b] = 0.0f;
    sr[b] = 0.0f;
    ir[b] = 0;
  }
  pad_plane_row(hr, a);
  pad_plane_row(lr, a);
}

// One natural pair (two blocks, 8 int32 lanes each) against the activations at xh (and
// xl, the low-byte plane, when P == 2).
template <class Q, int P>
inline __m512i pair_dot(__m512i u, const int8_t* xh, const uint8_t* xl) {
  const __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_load_si512(xh));
  if constexpr (P == 1) {
    (void)xl;
    return h;
  } else {
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 8), _mm512_load_si512(xl), Q::lo_w(u));
  }
}

// With int16 activations the natural pairs subtract the integer offset off * isum too
// (the int8 ones fold it into f32 as mw * s): for Q8_0 it reaches 128 * 256 * 4096, past
// f32's 24 exact bits. Each block's term goes into the first of its 8 lanes; isum16 holds
// the offsets of the 16 blocks of the window.
template <class Q>
inline __m512i pair_offset(__m512i I, __m512i isum16, int p) {
  if constexpr (Q::kOffShift == 0) return I;
  return _mm512_sub_epi32(I, _mm512_maskz_permutexvar_epi32(0x0101, ld_idx(kPrep.pair_idx[p]), isum16));
}

// Number of transposed activation groups for the GEMV (the rest: natural pairs). The
// prefill GEMM reads natural-order activations.
#ifndef HIPC_SMALL_BATCH_MAX
#define HIPC_SMALL_BATCH_MAX 7  // T = 2..7: q_gemv_batch, not the row-lane GEMM (1 = off)
#endif
constexpr int kSmallBatchMax = HIPC_SMALL_BATCH_MAX;
static_assert(kSmallBatchMax >= 1 && kSmallBatchMax <= 7, "small batches are 2..7 tokens");
template <class Q>
inline int transposed_groups(int nb, int T) {
  if (T > kSmallBatchMax || !Q::kGemvTransposed) return 0;
  return nb / 16 + ((nb % 16) > kNatTailMax ? 1 : 0);
}

// Epilogue for one (row, token, transposed group):
//   acc += float(I - off*isum) * dw*dx (+ mw*sx)
template <class Q>
inline __m512 group_epilogue(__m512 acc, __m512i I, const WGroup& wg, __m512 dx, __m512 sx, __m512i offsum) {
  if (Q::kOffShift) I = _mm512_sub_epi32(I, offsum);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(wg.dw, dx), acc);
  if (Q::kMin) acc = _mm512_fmadd_ps(wg.mw, sx, acc);
  return acc;
}

// Transposed group against int16 activations (P == 2): I = 256*dot(u, hi) + dot(lo, u)
// per block, four int32 chains per plane.
template <class Q>
inline __m512i group_dot16_unshifted(const WGroup& wg, const __m512i* xh, const __m512i* xl) {
  __m512i h[4], l[4];
  for (int i = 0; i < 4; ++i) {
    h[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wg.w[i], _mm512_load_si512(xh + i));
    l[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(xl + i), Q::lo_w(wg.w[i]));
  }
  for (int i = 0; i < 4; ++i) {
    h[i] = _mm512_dpbusd_epi32(h[i], wg.w[4 + i], _mm512_load_si512(xh + 4 + i));
    l[i] = _mm512_dpbusd_epi32(l[i], _mm512_load_si512(xl + 4 + i), Q::lo_w(wg.w[4 + i]));
  }
  const __m512i hs = _mm512_add_epi32(_mm512_add_epi32(h[0], h[1]), _mm512_add_epi32(h[2], h[3]));
  const __m512i ls = _mm512_add_epi32(_mm512_add_epi32(l[0], l[1]), _mm512_add_epi32(l[2], l[3]));
  return _mm512_add_epi32(_mm512_slli_epi32(hs, 8), ls);
}

// prep leaves the odd chunks as 16 * nibble (0..240), fine as vpdpbusd's unsigned
// operand but not as its signed one; a 16-bit shift brings each byte back to 0..15
// (its low nibble is zero, so nothing crosses into the byte below)
inline void unshift_odd_chunks(WGroup& wg) {
  for (int c = 1; c < 8; c += 2) wg.w[c] = _mm512_srli_epi16(wg.w[c], 4);
}
template <class Q>
inline __m512i group_dot16(WGroup& wg, const __m512i* xh, const __m512i* xl) {
  if constexpr (Q::kPrepShifted) unshift_odd_chunks(wg);
  return group_dot16_unshifted<Q>(wg, xh, xl);
}
// Transposed group against int8 activations (P == 1): even chunks hold low nibbles, odd
// ones 16 * high nibbles (prep's layout where Q::kPrepShifted), four int32 chains.
template <class Q>
inline __m512i group_dot8(const WGroup& wg, const __m512i* xq) {
  __m512i i[4];
  for (int c = 0; c < 4; ++c) i[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wg.w[c], _mm512_load_si512(xq + c));
  for (int c = 0; c < 4; ++c) i[c] = _mm512_dpbusd_epi32(i[c], wg.w[4 + c], _mm512_load_si512(xq + 4 + c));
  const __m512i lo = _mm512_add_epi32(i[0], i[2]), hi = _mm512_add_epi32(i[1], i[3]);
  return _mm512_add_epi32(lo, Q::kPrepShifted ? _mm512_srai_epi32(hi, 4) : hi);
}

// Natural-pair dot of one row window (nv <= 16 blocks, scales dw/mw, pair p from
// pair_at(p, two)) with one token window (xq, and xl when P == 2).
//   acc += sum_p cvt(vpdpbusd(pair_p, x_p)) * perm(dw*dx) + mw*sx
template <class Q, int P, class PairAt>
inline __m512 nat_window_with(PairAt pair_at, int nv, __m512 dw, __m512 mw, const int8_t* xq, const uint8_t* xl,
                              const int32_t* xi, __m512 dx, __m512 sx, __m512 acc) {
  const __m512 dwdx = _mm512_mul_ps(dw, dx);
  const __m512i offs = P == 2 ? _mm512_slli_epi32(_mm512_loadu_si512(xi), Q::kOffShift) : _mm512_setzero_si512();
  __m512 f0 = _mm512_setzero_ps(), f1 = _mm512_setzero_ps();
  int p = 0;
  for (; 2 * p + 3 < nv; p += 2) {
    __m512i i0 = pair_dot<Q, P>(pair_at(p, true), xq + 64 * p, xl + 64 * p);
    __m512i i1 = pair_dot<Q, P>(pair_at(p + 1, true), xq + 64 * (p + 1), xl + 64 * (p + 1));
    if constexpr (P == 2) {
      i0 = pair_offset<Q>(i0, offs, p);
      i1 = pair_offset<Q>(i1, offs, p + 1);
    }
    f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_permutexvar_ps(ld_idx(kPrep.pair_idx[p]), dwdx), f0);
    f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_permutexvar_ps(ld_idx(kPrep.pair_idx[p + 1]), dwdx), f1);
  }
  for (; 2 * p < nv; ++p) {
    __m512i i0 = pair_dot<Q, P>(pair_at(p, 2 * p + 1 < nv), xq + 64 * p, xl + 64 * p);
    if constexpr (P == 2) i0 = pair_offset<Q>(i0, offs, p);
    f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_permutexvar_ps(ld_idx(kPrep.pair_idx[p]), dwdx), f0);
  }
  if constexpr (P == 2 && !Q::kMin) return _mm512_add_ps(acc, _mm512_add_ps(f0, f1));
  return _mm512_fmadd_ps(mw, sx, _mm512_add_ps(acc, _mm512_add_ps(f0, f1)));
}

// The same, reading the window's scales and pairs from the weights at gp.
template <class Q, int P>
inline __m512 nat_window(const uint8_t* gp, int nv, const int8_t* xq, const uint8_t* xl, const int32_t* xi,
                         __m512 dx, __m512 sx, __m512 acc) {
  __m512 dw, mw;
  Q::dm16(gp, nv, dw, mw);
  const auto pair_at = [gp](int p, bool two) { return Q::pair(gp + 2 * p * Q::kBlockBytes, two); };
  return nat_window_with<Q, P>(pair_at, nv, dw, mw, xq, xl, xi, dx, sx, acc);
}

// Horizontal sums of 4 vectors -> [sum(a), sum(b), sum(c), sum(d)]
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
  const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Per-call constants of the 4-row GEMV tail (tail of nn <= 4 blocks after b0).
struct GemvTail {
  int b0 = 0, nn = 0;
  __m512i vidx;     // gather offsets: lane 4r+i -> r*rb + i*block_bytes
  __mmask16 valid;  // lanes with i < nn
  __m512 dx, sx;    // activation scale / sum of tail block i in lane 4r+i
  __m512i offs;     // int16 activations: off * isum of tail block i in lane i
};

template <class Q>
inline GemvTail make_gemv_tail(const QAct& a, int nb, size_t rb) {
  GemvTail t;
  t.b0 = 16 * a.ntg;
  t.nn = nb - t.b0;
  if (t.nn <= 0 || t.nn > 4) return t;
  alignas(64) int32_t idx[16];
  uint32_t valid = 0;
  for (int l = 0; l < 16; ++l) {
    idx[l] = (int32_t)((l >> 2) * rb + (l & 3) * Q::kBlockBytes);
    if ((l & 3) < t.nn) valid |= 1u << l;
  }
  t.vidx = _mm512_load_si512(idx);
  t.valid = (__mmask16)valid;
  const __m512i rep = ld_idx(kPrep.tail_rep);
  t.dx = _mm512_permutexvar_ps(rep, _mm512_load_ps(a.d + t.b0));
  t.sx = _mm512_permutexvar_ps(rep, _mm512_load_ps(a.s + t.b0));
  t.offs = _mm512_slli_epi32(_mm512_load_si512(a.isum + t.b0), Q::kOffShift);
  return t;
}

// GEMV tile (one token): rows n0..n0+R-1,  y[n] = sum over the row's blocks (see above).
//   transposed groups g < ntg: prep in registers, 8 vpdpbusd (four int32 chains), epilogue
//   natural windows of 16 blocks from 16*ntg on: nat_window; a short tail (<= 4 blocks)
//   is done for 4 rows at once (one gather of the 16 block scales of the tile).
// Weights are prefetched HIPC_PREFETCH_BYTES ahead (rows are contiguous in memory, so
// this runs into the next rows of the same thread's range).
template <class Q, int R, int P>
inline void q_gemv_tile(const uint8_t* W, size_t rb, int nb, int n0, const QAct& a, const GemvTail& tail, float* y) {
  __m512 facc[R];
  for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
  const int ntg = a.ntg;
  constexpr size_t gbytes = 16 * Q::kBlockBytes;
  if constexpr (Q::kGemvTransposed) {
    for (int g = 0; g < ntg; ++g) {
      const int nrem = std::min(16, nb - 16 * g);
      const __m512i* xq = (const __m512i*)(a.q + (size_t)g * 512);
      const __m512i* xl = P == 2 ? (const __m512i*)(a.lo + (size_t)g * 512) : nullptr;
      const __m512 dx = _mm512_load_ps(a.d + 16 * g);
      const __m512 sx = Q::kMin ? _mm512_load_ps(a.s + 16 * g) : _mm512_setzero_ps();
      const __m512i offsum = Q::kOffShift ? _mm512_slli_epi32(_mm512_load_si512(a.isum + 16 * g), Q::kOffShift)
                                          : _mm512_setzero_si512();
      for (int r = 0; r < R; ++r) {
        const uint8_t* gp = W + (size_t)(n0 + r) * rb + (size_t)g * gbytes;
        prefetch_range(gp + HIPC_PREFETCH_BYTES, gbytes);
        WGroup wg;
        Q::prep(gp, nrem, wg);
        if constexpr (P == 2) {
          facc[r] = group_epilogue<Q>(facc[r], group_dot16<Q>(wg, xq, xl), wg, dx, sx, offsum);
          continue;
        }
        facc[r] = group_epilogue<Q>(facc[r], group_dot8<Q>(wg, xq), wg, dx, sx, offsum);
      }
    }
  }
  const bool tile_tail = R == 4 && tail.nn > 0 && tail.nn <= 4;
  const int nat_end = tile_tail ? tail.b0 : nb;
  for (int b0 = 16 * ntg; b0 < nat_end; b0 += 16) {
    const int nv = std::min(16, nb - b0);
    const __m512 dx = _mm512_load_ps(a.d + b0);
    const __m512 sx = _mm512_load_ps(a.s + b0);
    for (int r = 0; r < R; ++r) {
      const uint8_t* gp = W + (size_t)(n0 + r) * rb + (size_t)b0 * Q::kBlockBytes;
      prefetch_range(gp + HIPC_PREFETCH_BYTES, (size_t)nv * Q::kBlockBytes);
      facc[r] = nat_window<Q, P>(gp, nv, a.q + 32 * (size_t)b0, a.lo + 32 * (size_t)b0, a.isum + b0, dx, sx, facc[r]);
    }
  }
  if (tile_tail) {
    const uint8_t* tp = W + (size_t)n0 * rb + (size_t)tail.b0 * Q::kBlockBytes;
    __m512 dw, mw;
    Q::dm16_idx(tp, tail.valid, tail.vidx, dw, mw);
    const __m512 dwdx = _mm512_mul_ps(dw, tail.dx);
    const int8_t* xn = a.q + 32 * (size_t)tail.b0;
    const uint8_t* xln = a.lo + 32 * (size_t)tail.b0;
    for (int r = 0; r < R; ++r) {
      __m512 f = facc[r];
      if (P == 1 || Q::kMin) f = _mm512_mask3_fmadd_ps(mw, tail.sx, f, (__mmask16)(0xFu << (4 * r)));
      for (int p = 0; 2 * p < tail.nn; ++p) {
        const __m512i w = Q::pair(tp + (size_t)r * rb + 2 * p * Q::kBlockBytes, 2 * p + 1 < tail.nn);
        __m512i I = pair_dot<Q, P>(w, xn + 64 * p, xln + 64 * p);
        if constexpr (P == 2) I = pair_offset<Q>(I, tail.offs, p);
        f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_permutexvar_ps(ld_idx(kPrep.tail_pair_idx[r & 3][p]), dwdx), f);
      }
      facc[r] = f;
    }
  }
  if constexpr (R == 4) {
    _mm_storeu_ps(y + n0, hsum4(facc[0], facc[1], facc[2], facc[3]));
  } else {
    for (int r = 0; r < R; ++r) y[n0 + r] = _mm512_reduce_add_ps(facc[r]);
  }
}

// ------------------------------------------------------------------------------------
// Small-batch GEMV (T = 2..kSmallBatchMax: the decode step of a few sequences).
//
// The GEMV's layouts, with each prepared transposed group of a weight row dotted against
// every token's transposed activations: the group's prep (~20 permutes and masks on Q4,
// as much work as a token's dot products) and its weight reads are paid once per row,
// not once per token, and there is no per-call slab prep as in the row-lane GEMM, which
// costs as much as a whole GEMV and so dominated 2..7-row steps. Natural windows (short K
// tails, Q8_0) are re-read per token, from L1. One row per tile, T accumulators.
// ------------------------------------------------------------------------------------
template <class Q, int T, int R, int P>
inline void q_gemv_batch_rows(const uint8_t* W, size_t rb, int nb, int n0, const QAct& a, float* y, int ldy) {
  __m512 facc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) facc[r][t] = _mm512_setzero_ps();
  const size_t xs = (size_t)a.nbp * 32, ss = (size_t)a.nbp;
  constexpr size_t gbytes = 16 * Q::kBlockBytes;
  if constexpr (Q::kGemvTransposed) {
    for (int g = 0; g < a.ntg; ++g) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* gp = W + (size_t)(n0 + r) * rb + (size_t)g * gbytes;
        prefetch_range(gp + HIPC_PREFETCH_BYTES, gbytes);
        WGroup wg;
        Q::prep(gp, std::min(16, nb - 16 * g), wg);
        if constexpr (P == 2 && Q::kPrepShifted) unshift_odd_chunks(wg);
        for (int t = 0; t < T; ++t) {
          const size_t so = t * ss + 16 * (size_t)g;
          const __m512i* xq = (const __m512i*)(a.q + t * xs + (size_t)g * 512);
          const __m512 dx = _mm512_load_ps(a.d + so);
          const __m512 sx = Q::kMin ? _mm512_load_ps(a.s + so) : _mm512_setzero_ps();
          const __m512i offsum = Q::kOffShift ? _mm512_slli_epi32(_mm512_load_si512(a.isum + so), Q::kOffShift)
                                              : _mm512_setzero_si512();
          __m512i I;
          if constexpr (P == 2) {
            I = group_dot16_unshifted<Q>(wg, xq, (const __m512i*)(a.lo + t * xs + (size_t)g * 512));
          } else {
            I = group_dot8<Q>(wg, xq);
          }
          facc[r][t] = group_epilogue<Q>(facc[r][t], I, wg, dx, sx, offsum);
        }
      }
    }
  }
  for (int b0 = 16 * a.ntg; b0 < nb; b0 += 16) {
    // the window's scales (a gather) and pairs are the row's: read once for all tokens
    const int nv = std::min(16, nb - b0);
    for (int r = 0; r < R; ++r) {
      const uint8_t* gp = W + (size_t)(n0 + r) * rb + (size_t)b0 * Q::kBlockBytes;
      prefetch_range(gp + HIPC_PREFETCH_BYTES, (size_t)nv * Q::kBlockBytes);
      __m512 dw, mw;
      Q::dm16(gp, nv, dw, mw);
      __m512i pairs[8];
      for (int p = 0; 2 * p < nv; ++p) pairs[p] = Q::pair(gp + 2 * p * Q::kBlockBytes, 2 * p + 1 < nv);
      const auto pair_at = [&pairs](int p, bool) { return pairs[p]; };
      for (int t = 0; t < T; ++t) {
        const size_t so = t * ss + b0, xo = t * xs + 32 * (size_t)b0;
        facc[r][t] = nat_window_with<Q, P>(pair_at, nv, dw, mw, a.q + xo, a.lo + xo, a.isum + so,
                                           _mm512_load_ps(a.d + so), _mm512_load_ps(a.s + so), facc[r][t]);
      }
    }
  }
  // four (row, token) sums per hsum4
  constexpr int S = R * T;
  const __m512 zero = _mm512_setzero_ps();
  for (int i = 0; i < S; i += 4) {
    alignas(16) float s4[4];
    const auto f = [&](int k) { return i + k < S ? facc[(i + k) % R][(i + k) / R] : zero; };
    _mm_store_ps(s4, hsum4(f(0), f(1), f(2), f(3)));
    for (int k = 0; k < 4 && i + k < S; ++k) y[(size_t)((i + k) / R) * ldy + n0 + (i + k) % R] = s4[k];
  }
}

template <class Q, int T, int P>
inline void q_gemv_batch(const uint8_t* W, size_t rb, int nb, int N, const QAct& a, float* y, int ldy, bool par) {
  // 4 rows share each token's activation loads and horizontal sums; past 4 tokens, 4 x T
  // accumulators no longer fit the 32 registers
  constexpr int R = T <= 4 ? 4 : 2;
  const int ntiles = (N + R - 1) / R;
#pragma omp parallel for schedule(static) if (par)
  for (int i = 0; i < ntiles; ++i) {
    const int n0 = i * R;
    if (n0 + R <= N) {
      q_gemv_batch_rows<Q, T, R, P>(W, rb, nb, n0, a, y, ldy);
    } else {
      for (int n = n0; n < N; ++n) q_gemv_batch_rows<Q, T, 1, P>(W, rb, nb, n, a, y, ldy);
    }
  }
}

// ------------------------------------------------------------------------------------
// Prefill GEMM, "row lanes": a zmm lane is an output row.
//
// For a slab of 16*V rows, every block b is prepped once (gathers across the 16 rows of
// a vector) into WGroup-shaped data: w[j] lane r = the 4 unsigned weight bytes of row r,
// block b, chunk j; dw / mw lane r = scale / offset of row r, block b. Then for C tokens
//     acc[v][c]  += vpdpbusd(w[j], broadcast(xq[t, b, chunk j]))        (j = 0..7)
//     facc[v][c] += float(acc - off*isum[t,b]) * dw * dx[t,b] (+ mw * s[t,b])
// so y[t, 16 rows] comes out as one vector (no horizontal sums, no K-tail special case).
// Cost per (16 rows, token, block): 8 vpdpbusd + 4 epilogue ops for 512 MACs; the slab
// prep (5..9 gathers per 16 rows x block) is amortized over all T tokens.
// ------------------------------------------------------------------------------------
#ifndef HIPC_RL_VECS
#define HIPC_RL_VECS 3  // row vectors per slab (16 rows each)
#endif
#ifndef HIPC_RL_COLS
#define HIPC_RL_COLS 4  // tokens per micro-tile
#endif
constexpr int kRlVecs = HIPC_RL_VECS;
constexpr int kRlCols = HIPC_RL_COLS;
static_assert(kRlCols >= 1 && kRlCols <= 6, "token tile must be 1..6");

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <class Q, int V, int C, int P>
inline void rl_tile(const WGroup* slab, int nb, const QAct& a, int t0, int n0, int N, float* y, int ldy) {
  __m512 facc[V][C];
  for (int v = 0; v < V; ++v)
    for (int c = 0; c < C; ++c) facc[v][c] = _mm512_setzero_ps();
  const size_t xstride = (size_t)a.nbp * 32;
  const int8_t* x0 = a.q + (size_t)t0 * xstride;
  for (int b = 0; b < nb; ++b) {
    const WGroup* sb = slab + (size_t)b * V;
    __m512i acc[V][C];
    for (int v = 0; v < V; ++v)
      for (int c = 0; c < C; ++c) acc[v][c] = _mm512_setzero_si512();
    const int8_t* xb = x0 + 32 * (size_t)b;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i wv[V];
      for (int v = 0; v < V; ++v) wv[v] = sb[v].w[j];
      for (int c = 0; c < C; ++c) {
        const __m512i xv = _mm512_set1_epi32(load_i32(xb + c * xstride + chunk_elem(j)));
        for (int v = 0; v < V; ++v) acc[v][c] = _mm512_dpbusd_epi32(acc[v][c], wv[v], xv);
      }
    }
    if constexpr (P == 2) {  // acc = 256 * dot(u, hi) + dot(lo, lo_w(u)), see quantize_block16
      for (int v = 0; v < V; ++v)
        for (int c = 0; c < C; ++c) acc[v][c] = _mm512_slli_epi32(acc[v][c], 8);
      const int8_t* lb = (const int8_t*)a.lo + (size_t)t0 * xstride + 32 * (size_t)b;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m512i wv[V];
        for (int v = 0; v < V; ++v) wv[v] = Q::lo_w(sb[v].w[j]);
        for (int c = 0; c < C; ++c) {
          const __m512i xv = _mm512_set1_epi32(load_i32(lb + c * xstride + chunk_elem(j)));
          for (int v = 0; v < V; ++v) acc[v][c] = _mm512_dpbusd_epi32(acc[v][c], xv, wv[v]);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const size_t so = (size_t)(t0 + c) * a.nbp + b;
      const __m512 dx = _mm512_set1_ps(a.d[so]);
      for (int v = 0; v < V; ++v) {
        __m512i I = acc[v][c];
        if (Q::kOffShift) I = _mm512_sub_epi32(I, _mm512_set1_epi32(a.isum[so] * (1 << Q::kOffShift)));
        facc[v][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(sb[v].dw, dx), facc[v][c]);
        if (Q::kMin) facc[v][c] = _mm512_fmadd_ps(sb[v].mw, _mm512_set1_ps(a.s[so]), facc[v][c]);
      }
    }
  }
  store_tile<V, C>(facc, t0, n0, N, y, ldy);
}

// Prep the slab of rows n0 .. n0+16V-1 (rows >= N read as zero).
template <class Q, int V>
inline void rl_prep(const uint8_t* W, size_t rb, int nb, int n0, int N, WGroup* slab) {
  alignas(64) int32_t idx[16];
  for (int r = 0; r < 16; ++r) idx[r] = (int32_t)(r * rb);
  const __m512i ridx = _mm512_load_si512(idx);
  for (int v = 0; v < V; ++v) {
    const __mmask16 k = mask16(N - (n0 + 16 * v));
    const uint8_t* base = W + (size_t)(n0 + 16 * v) * rb;
    for (int b = 0; b < nb; ++b) {
      if (k) {
        Q::prep_rows(base + (size_t)b * Q::kBlockBytes, ridx, k, slab[(size_t)b * V + v]);
      } else {
        clear(slab[(size_t)b * V + v]);
      }
    }
  }
}

template <class Q, int V, int C, int P>
inline void rl_rows(const WGroup* slab, int nb, const QAct& a, int n0, int N, float* y, int ldy) {
  int t = 0;
  for (; t + C <= a.T; t += C) rl_tile<Q, V, C, P>(slab, nb, a, t, n0, N, y, ldy);
  switch (a.T - t) {  // token tail
    case 5: if constexpr (C > 5) rl_tile<Q, V, 5, P>(slab, nb, a, t, n0, N, y, ldy); break;
    case 4: if constexpr (C > 4) rl_tile<Q, V, 4, P>(slab, nb, a, t, n0, N, y, ldy); break;
    case 3: if constexpr (C > 3) rl_tile<Q, V, 3, P>(slab, nb, a, t, n0, N, y, ldy); break;
    case 2: if constexpr (C > 2) rl_tile<Q, V, 2, P>(slab, nb, a, t, n0, N, y, ldy); break;
    case 1: if constexpr (C > 1) rl_tile<Q, V, 1, P>(slab, nb, a, t, n0, N, y, ldy); break;
    default: break;
  }
}

// Decode GEMV row tile.
constexpr int kGemvRows = 4;

// Quantized matmul driver (AVX512).
//   T == 1 (decode): x is quantized by the calling thread; `omp parallel for
//   schedule(static)` over tiles of kGemvRows rows (q_gemv_tile).
//   T = 2..kSmallBatchMax (a batch's decode step): the same, every row against all T
//   tokens (q_gemv_batch).
//   T > kSmallBatchMax (prefill): one OpenMP region; `omp for` over tokens quantizes x, then
//   `omp for schedule(static)` over slabs of 16*kRlVecs rows: each thread preps its slab
//   once (K/32 * kRlVecs * 640 bytes, L2 resident) and sweeps all T tokens with it.
// P: activation planes, 1 = int8 activations, 2 = int16 ones (quantize_block16; qmax 127:
// int8 values in the two planes).
template <class Q, int P = 1>
inline void q_matmul(const float* x, int T, int K, const void* Wv, int N, float* y, int ldy, float qmax = 32767.f) {
  if (T <= 0 || N <= 0) return;
  const uint8_t* W = (const uint8_t*)Wv;
  const int nb = K / 32;
  const size_t rb = (size_t)nb * Q::kBlockBytes;
  const QAct a = alloc_qact(T, K, transposed_groups<Q>(nb, T), P);
  const auto quantize = [&](int t) {
    if constexpr (P == 1) {
      quantize_act_row(x, K, a, t);
    } else {
      quantize_act16_row<Q>(x, K, a, t, qmax);
    }
  };
  const bool par = (long long)T * N * K >= kParallelMinWork;
  if (T == 1) {
    quantize(0);
    const GemvTail tail = make_gemv_tail<Q>(a, nb, rb);
    constexpr int R = kGemvRows;
    const int ntiles = (N + R - 1) / R;
#pragma omp parallel for schedule(static) if (par)
    for (int i = 0; i < ntiles; ++i) {
      const int n0 = i * R;
      if (n0 + R <= N) {
        q_gemv_tile<Q, R, P>(W, rb, nb, n0, a, tail, y);
      } else {
        for (int n = n0; n < N; ++n) q_gemv_tile<Q, 1, P>(W, rb, nb, n, a, tail, y);
      }
    }
    return;
  }
  if (T <= kSmallBatchMax) {
    for (int t = 0; t < T; ++t) quantize(t);
    switch (T) {
      case 2: q_gemv_batch<Q, 2, P>(W, rb, nb, N, a, y, ldy, par); break;
      case 3: q_gemv_batch<Q, 3, P>(W, rb, nb, N, a, y, ldy, par); break;
      case 4: q_gemv_batch<Q, 4, P>(W, rb, nb, N, a, y, ldy, par); break;
      case 5: q_gemv_batch<Q, 5, P>(W, rb, nb, N, a, y, ldy, par); break;
      case 6: q_gemv_batch<Q, 6, P>(W, rb, nb, N, a, y, ldy, par); break;
      default: q_gemv_batch<Q, kSmallBatchMax, P>(W, rb, nb, N, a, y, ldy, par); break;
    }
    return;
  }
  constexpr int V = kRlVecs, C = kRlCols;
  const int ntiles = (N + 16 * V - 1) / (16 * V);
#pragma omp parallel if (par)
  {
#pragma omp for schedule(static)
    for (int t = 0; t < T; ++t) quantize(t);
    WGroup* slab = (WGroup*)scratch(1, sizeof(WGroup) * (size_t)nb * V);
#pragma omp for schedule(static)
    for (int i = 0; i < ntiles; ++i) {
      const int n0 = i * 16 * V;
      rl_prep<Q, V>(W, rb, nb, n0, N, slab);
      rl_rows<Q, V, C, P>(slab, nb, a, n0, N, y, ldy);
    }
  }
}

}  // namespace detail
#endif  // HIPC_ISA_AVX512

}  // namespace hipc
