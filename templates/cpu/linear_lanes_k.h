// linear_lanes_k.h -- Q3_K / Q4_K / Q5_K / Q6_K matmuls on weights the compiler stored in row lanes.
//
// linear_vnni_k.h reads the file's super-blocks a row at a time: each 64 weights cost a
// nibble unpack, a scale permute, a horizontal sum at the end of the row and (int16
// activations) two vpdpbusd. Here, as in linear_lanes.h, lane r of every vector is row r
// of a group of 16: a 32-element unit of 16 rows is a Q4_1 block of linear_lanes.h (a
// nibble split, then 8 vpdpbusd a plane against broadcast activations), and the unit's
// 16 scales are one vector.
//
// The layout (compiler/passes/repack.py, lane_kquant_blocks) keeps every byte of the
// GGUF blocks: rows in groups of 16 (the last padded with zero rows), and per group and
// super-block (256 elements of K) one cell, the 16 rows' blocks:
//   Q4_K, Q5_K   d [16 f16] | dmin [16 f16] | scales: 3 vectors (dword r of vector k: row
//                r's scale bytes 4k..4k+3) | 8 units: (Q5_K: fifth bits, 64 bytes as
//                linear_lanes.h's blocks') quants, 4 vectors
//   Q6_K         d [16 f16] | scales: 4 vectors (dword r of vector k: row r's int8 scales
//                of 16-groups 4k..4k+3) | 8 units: high bits, 2 vectors; low nibbles, 4
//   Q3_K         d [16 f16] | scales: 3 vectors (row r's 12 packed scale bytes) | 8 units:
//                high bits, 1 vector (bit k of byte 4r + i: chunk k's element i); the
//                2-bit fields, 2 vectors (as Q6_K's high bits)
// (one sequential stream a cell: a unit's bytes together)
// Quants of unit j (elements 32j..32j+31 of the super-block): dword r of vector c holds row
// r's elements 4c..4c+3 in its low nibbles and 16+4c..16+4c+3 in its high ones. Q6_K's two
// high bits of chunk j (linear_vnni.h chunk_elem) element i: bits 2(j % 4) of byte 4r + i
// of the unit's vector j / 4.
//
// The GEMV (T <= kSmallBatchMax) runs linear_lanes.h's planes (P = 2: the balanced int16
// split, 1: int8). Prefill unpacks each cell once into a slab of WGroups (one a unit) and
// runs the row-lane GEMMs: Q4_K / Q5_K as Q4_1 blocks (dw = d * sc, mw = -dmin * mn),
// Q6_K and Q3_K as linear_vnni_k.h's (dw / mw: the scales of the unit's two 16-groups).
#pragma once

namespace hipc {

namespace detail {

// Bytes: a row's super-block; a cell's head; a unit's before its low bits, and its low bits.
// kHalves: a scale per 16-group (the unit's even / odd chunks), the offset kOff16 per 16-group
// sum of q (the AVX512 prefill's row-lane types: LKS below).
struct LKQ4K {
  static constexpr int kBytes = 144, kHead = 256, kMid = 0, kLow = 256, kOff16 = 0;
  static constexpr bool kFifth = false, kQ6 = false, kQ3 = false, kHalves = false;
};
struct LKQ5K {
  static constexpr int kBytes = 176, kHead = 256, kMid = 64, kLow = 256, kOff16 = 0;
  static constexpr bool kFifth = true, kQ6 = false, kQ3 = false, kHalves = false;
};
struct LKQ6K {
  static constexpr int kBytes = 210, kHead = 288, kMid = 128, kLow = 256, kOff16 = 32;
  static constexpr bool kFifth = false, kQ6 = true, kQ3 = false, kHalves = true;
};
struct LKQ3K {
  static constexpr int kBytes = 110, kHead = 224, kMid = 64, kLow = 128, kOff16 = 4;
  static constexpr bool kFifth = false, kQ6 = false, kQ3 = true, kHalves = true;
};

template <class L>
inline const uint8_t* lk_cell(const uint8_t* W, int nsb, int g, int s) {
  return W + ((size_t)g * nsb + s) * 16 * L::kBytes;
}

template <class L>
inline void lk_embed_row(const void* W, int K, int64_t row, float* out) {
  const int nsb = K / 256, r = (int)(row & 15);
  for (int s = 0; s < nsb; ++s) {
    const uint8_t* c = lk_cell<L>((const uint8_t*)W, nsb, (int)(row >> 4), s);
    uint16_t h16;
    std::memcpy(&h16, c + 2 * r, 2);
    const float d = fp16_to_fp32(h16);
    float sc[16], mn[8] = {};  // per 16-group (kHalves) or per unit (sc[0..7]; mn: -dmin * mn)
    uint8_t q[16];             // the row's scale bytes
    for (int k = 0; k < (L::kQ6 ? 4 : 3); ++k) std::memcpy(q + 4 * k, c + (L::kHead == 256 ? 64 : 32) + 64 * k + 4 * r, 4);
    if constexpr (L::kQ6) {
      for (int g = 0; g < 16; ++g) sc[g] = d * (float)(int8_t)q[g];
    } else if constexpr (L::kQ3) {
      for (int g = 0; g < 16; ++g) {
        const int lo = g < 8 ? q[g] & 15 : q[g - 8] >> 4, hi = (q[8 + g % 4] >> (2 * (g / 4))) & 3;
        sc[g] = d * (float)((lo | hi << 4) - 32);
      }
    } else {
      std::memcpy(&h16, c + 32 + 2 * r, 2);
      const float dmin = fp16_to_fp32(h16);
      for (int j = 0; j < 8; ++j) {
        const int s6 = j < 4 ? q[j] & 63 : (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        const int m6 = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        sc[j] = d * (float)s6;
        mn[j] = -dmin * (float)m6;
      }
    }
    for (int j = 0; j < 8; ++j) {
      const uint8_t* un = c + L::kHead + (L::kMid + L::kLow) * j;
      const uint8_t* qs = un + L::kMid;
      for (int k = 0; k < 8; ++k)
        for (int i = 0; i < 4; ++i) {
          const int e = chunk_elem(k) + i;
          if constexpr (L::kQ3) {
            const int u = ((qs[64 * (k >> 2) + 4 * r + i] >> (2 * (k & 3))) & 3) | ((un[4 * r + i] >> k) & 1) << 2;
            out[256 * s + 32 * j + e] = sc[2 * j + e / 16] * (float)(u - 4);
            continue;
          }
          int u = (qs[64 * (k >> 1) + 4 * r + i] >> (4 * (k & 1))) & 15;
          if constexpr (L::kFifth) u |= lane_fifth_bit(un, k, r, i) << 4;
          if constexpr (L::kQ6) {
            const uint8_t hb = un[64 * (k >> 2) + 4 * r + i];
            u |= ((hb >> (2 * (k & 3))) & 3) << 4;
            out[256 * s + 32 * j + e] = sc[2 * j + e / 16] * (float)(u - 32);
          } else {
            out[256 * s + 32 * j + e] = sc[j] * (float)u + mn[j];
          }
        }
    }
  }
}

}  // namespace detail

#if defined(HIPC_ISA_AVX512)
namespace detail {

// linear_vnni_k.h's type for a kHalves type's prefill row lanes
template <class L> struct LKS;
template <> struct LKS<LKQ6K> { using KS = KSQ6K; };
template <> struct LKS<LKQ3K> { using KS = KSQ3K; };

// The cell's scales per unit j: Q4_K / Q5_K dw[j] = d * sc_j, mw[j] = -dmin * mn_j; Q6_K,
// Q3_K dw[j] / mw[j] = d * sc of 16-groups 2j / 2j + 1.
template <class L>
inline void lk_scales(const uint8_t* c, __m512* dw, __m512* mw) {
  const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)c));
  if constexpr (L::kQ3) {  // d * (sc - 32) of 16-group g
    const __m512i w0 = _mm512_loadu_si512(c + 32), w1 = _mm512_loadu_si512(c + 96), w2 = _mm512_loadu_si512(c + 160);
    for (int g = 0; g < 16; ++g) (g & 1 ? mw : dw)[g >> 1] = _mm512_mul_ps(_mm512_cvtepi32_ps(q3_scale(w0, w1, w2, g)), D);
  } else if constexpr (L::kQ6) {
    for (int k = 0; k < 4; ++k) {
      const __m512i sc = _mm512_loadu_si512(c + 32 + 64 * k);
      for (int e = 0; e < 4; ++e) {
        const int g = 4 * k + e;
        (g & 1 ? mw : dw)[g >> 1] = _mm512_mul_ps(_mm512_cvtepi32_ps(lane_sbyte(sc, e)), D);
      }
    }
  } else {
    const __m512 M = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(c + 32))));
    __m512i sc[2], mn[2];
    k4_fields(_mm512_loadu_si512(c + 64), _mm512_loadu_si512(c + 128), _mm512_loadu_si512(c + 192), sc, mn);
    for (int j = 0; j < 8; ++j) {
      dw[j] = k4_unit(sc, j, D);
      mw[j] = k4_unit(mn, j, M);
    }
  }
}

// Unit j of a cell: w[k] lane r = row r's 4 unsigned weight bytes of chunk k
template <class L>
inline void lk_quants(const uint8_t* c, int j, __m512i* w) {
  const uint8_t* u = c + L::kHead + (L::kMid + L::kLow) * j;
  const uint8_t* q = u + L::kMid;
  if constexpr (L::kQ3) {  // 2-bit fields (4 chunks a byte) | the high bit (8 chunks a byte) << 2
    const __m512i h = _mm512_loadu_si512(u), m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi8(4);
    for (int half = 0; half < 2; ++half) {
      const __m512i v = _mm512_loadu_si512(q + 64 * half);
      for (int e = 0; e < 4; ++e) {
        const int k = 4 * half + e;
        const __m512i hb = k < 2 ? _mm512_slli_epi16(h, 2 - k) : _mm512_srli_epi16(h, k - 2);
        // (a & 3) | b, b = the high bit at bit 2 alone
        w[k] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 2 * e), _mm512_and_si512(hb, m4), m3, 0xEC);
      }
    }
    return;
  }
  for (int v = 0; v < 4; ++v) split_nibbles(_mm512_loadu_si512(q + 64 * v), w[2 * v], w[2 * v + 1]);
  if constexpr (L::kFifth) {
    static_assert(!kLaneFifthBytes);
    __mmask64* h = (__mmask64*)u;  // _load_mask64 takes no const
    const __m512i sixteen = _mm512_set1_epi8(16);
    for (int k = 0; k < 8; ++k) w[k] = _mm512_mask_add_epi8(w[k], _load_mask64(h + k), w[k], sixteen);
  }
  if constexpr (L::kQ6) {  // the high bits to bits 4..5, or'ed on (ternary logic: a | (b & c))
    const uint8_t* h = u;
    const __m512i m = _mm512_set1_epi8(0x30);
    for (int half = 0; half < 2; ++half) {
      const __m512i v = _mm512_loadu_si512(h + 64 * half);
      __m512i* o = w + 4 * half;
      o[0] = _mm512_ternarylogic_epi32(o[0], _mm512_slli_epi16(v, 4), m, 0xF8);
      o[1] = _mm512_ternarylogic_epi32(o[1], _mm512_slli_epi16(v, 2), m, 0xF8);
      o[2] = _mm512_ternarylogic_epi32(o[2], v, m, 0xF8);
      o[3] = _mm512_ternarylogic_epi32(o[3], _mm512_srli_epi16(v, 2), m, 0xF8);
    }
  }
}

// Token row t's sums of q per 16 elements (Q6_K's offset 32 comes off per 16-group): P = 2,
// q = 256 * hi + lo (quantize_lane_row's signed planes), P = 1: q.
template <int P>
inline void lk_isum16(const QAct& a, int t, int32_t* out) {
  const int8_t* hr = a.q + (size_t)t * a.nbp * 32;
  const int8_t* lr = (const int8_t*)a.lo + (size_t)t * a.nbp * 32;
  const __m512i ones = _mm512_set1_epi8(1);
  alignas(64) int32_t v[16];
  for (int b = 0; 2 * b < a.nb; ++b) {  // 64 elements a step (K is a multiple of 256)
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(hr + 64 * b));
    if constexpr (P == 2)
      s = _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 8), ones, _mm512_loadu_si512(lr + 64 * b));
    _mm512_store_si512(v, s);
    for (int g = 0; g < 4; ++g) out[4 * b + g] = v[4 * g] + v[4 * g + 1] + v[4 * g + 2] + v[4 * g + 3];
  }
}

// GEMV of 16-row group g against T tokens (each unit of 16 rows unpacked once for all of
// them); is16: the tokens' lk_isum16 (Q6_K, Q3_K), K/16 a token.
template <class L, int T, int P>
inline void lk_gemv_group(const uint8_t* W, int nsb, int g, const QAct& a, const int32_t* is16, float* y, int ldy,
                          int N) {
  __m512 facc[T];
  for (int t = 0; t < T; ++t) facc[t] = _mm512_setzero_ps();
  const size_t xs = (size_t)a.nbp * 32, ss = (size_t)a.nbp;
  for (int s = 0; s < nsb; ++s) {
    const uint8_t* c = lk_cell<L>(W, nsb, g, s);
    __m512 dw[8], mw[8];
    lk_scales<L>(c, dw, mw);
    for (int j = 0; j < 8; ++j) {
      __m512i w[8];
      lk_quants<L>(c, j, w);
      const int b = 8 * s + j;
      for (int t = 0; t < T; ++t) {
        __m512i i0, i1;  // the even chunks (elements 0..15), the odd ones (16..31)
        lane_dot<P>(w, a.q + t * xs + 32 * (size_t)b, (const int8_t*)a.lo + t * xs + 32 * (size_t)b, i0, i1);
        const size_t so = t * ss + b;
        const __m512 dx = _mm512_set1_ps(a.d[so]);
        if constexpr (L::kHalves) {  // u = q + kOff16 per 16-group
          const int32_t* gs = is16 + (size_t)t * (2 * a.nb) + 2 * b;
          i0 = _mm512_sub_epi32(i0, _mm512_set1_epi32(L::kOff16 * gs[0]));
          i1 = _mm512_sub_epi32(i1, _mm512_set1_epi32(L::kOff16 * gs[1]));
          facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(dw[j], dx), facc[t]);
          facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(mw[j], dx), facc[t]);
        } else {
          const __m512i I = _mm512_add_epi32(i0, i1);
          facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(dw[j], dx), facc[t]);
          facc[t] = _mm512_fmadd_ps(mw[j], _mm512_set1_ps(a.s[so]), facc[t]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + (size_t)t * ldy + 16 * g, mask16(N - 16 * g), facc[t]);
}

// One group a task and no software prefetch: a group's cells are one sequential stream, which
// the hardware prefetcher follows best. NOTE: measured with bench_cpu_lanes.py's cold reads
// (AMD EPYC, one core, int16, 2048 x 2048 Q4_K): 24 GB/s against 15-16 with two groups a tile
// or linear_lanes.h's prefetches; 2048 x 5632: 19 against 15.
template <class L, int T, int P>
inline void lk_gemv(const uint8_t* W, int nsb, int ngroups, const QAct& a, const int32_t* is16, float* y, int ldy,
                    int N, bool par) {
#pragma omp parallel for schedule(static) if (par)
  for (int g = 0; g < ngroups; ++g) lk_gemv_group<L, T, P>(W, nsb, g, a, is16, y, ldy, N);
}

// The slab of a prefill tile: groups g0 .. g0+V-1, unit b of the row at slab[b * V + v]
// (groups past the matrix: zero weights)
template <class L, int V>
inline void lk_slab(const uint8_t* W, int nsb, int g0, int ngroups, WGroup* slab) {
  for (int v = 0; v < V; ++v)
    for (int s = 0; s < nsb; ++s) {
      WGroup* out = slab + (size_t)(8 * s) * V + v;
      if (g0 + v >= ngroups) {
        for (int j = 0; j < 8; ++j) clear(out[(size_t)j * V]);
        continue;
      }
      const uint8_t* c = lk_cell<L>(W, nsb, g0 + v, s);
      __m512 dw[8], mw[8];
      lk_scales<L>(c, dw, mw);
      for (int j = 0; j < 8; ++j) {
        WGroup& g = out[(size_t)j * V];
        lk_quants<L>(c, j, g.w);
        g.dw = dw[j];
        g.mw = mw[j];
      }
    }
}

// Driver: P = 2 (int16 activations) or 1 (int8). W: the lanes layout of [N, K].
template <class L, int P>
inline void lk_matmul(const float* x, int T, int K, const void* Wv, int N, float* y, int ldy) {
  if (T <= 0 || N <= 0) return;
  const uint8_t* W = (const uint8_t*)Wv;
  const int nsb = K / 256, nb = K / 32, ngroups = (N + 15) / 16;
  const bool par = (long long)T * N * K >= kParallelMinWork;
  if (T <= kSmallBatchMax) {  // decode (T == 1) or a batch's decode step
    const QAct a = alloc_qact(T, K, 0, P, L::kHalves ? (size_t)T * (K / 16) * 4 : 0);
    int32_t* is16 = (int32_t*)a.ext;
    for (int t = 0; t < T; ++t) {
      if constexpr (P == 2) {
        quantize_lane_row(x + (size_t)t * K, K, a, t);
      } else {
        quantize_act_row(x, K, a, t);
      }
      if constexpr (L::kHalves) lk_isum16<P>(a, t, is16 + (size_t)t * (K / 16));
    }
    switch (T) {
      case 1: return lk_gemv<L, 1, P>(W, nsb, ngroups, a, is16, y, ldy, N, par);
      case 2: return lk_gemv<L, 2, P>(W, nsb, ngroups, a, is16, y, ldy, N, par);
      case 3: return lk_gemv<L, 3, P>(W, nsb, ngroups, a, is16, y, ldy, N, par);
      case 4: return lk_gemv<L, 4, P>(W, nsb, ngroups, a, is16, y, ldy, N, par);
      case 5: return lk_gemv<L, 5, P>(W, nsb, ngroups, a, is16, y, ldy, N, par);
      case 6: return lk_gemv<L, 6, P>(W, nsb, ngroups, a, is16, y, ldy, N, par);
      default: return lk_gemv<L, kSmallBatchMax, P>(W, nsb, ngroups, a, is16, y, ldy, N, par);
    }
  }
  if constexpr (L::kHalves) {
    // linear_vnni_k.h's Q6_K / Q3_K row lanes (its planes: int8 values in the int16 ones for P = 1)
    const float qmax = P == 2 ? 32767.f : 127.f;
    const QAct a = alloc_qact(T, K, 0, 2, kact_bytes(T, K));
    const KAct k = kact(a, T, K);
    constexpr int V = 2, C = 3;
    const int ntiles = (ngroups + V - 1) / V;
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
      for (int t = 0; t < T; ++t) {
        quantize_act16_row<KSAct>(x, K, a, t, qmax);
        kact_row<false>(a, k, t);
      }
      WGroup* slab = (WGroup*)scratch(1, sizeof(WGroup) * (size_t)nb * V);
#pragma omp for schedule(static)
      for (int i = 0; i < ntiles; ++i) {
        lk_slab<L, V>(W, nsb, i * V, ngroups, slab);
        ks_rl_rows<typename LKS<L>::KS, V, C>(slab, nullptr, nb, a, k, 16 * V * i, N, y, ldy);
      }
    }
  } else {  // each unit a Q4_1 block
    lane_prefill<KQ4_1, P>(x, T, K, N, y, ldy, ngroups, par,
                           [&](int i, WGroup* slab) { lk_slab<L, kRlVecs>(W, nsb, i * kRlVecs, ngroups, slab); });
  }
}

// Row `row` of a lanes matrix, dequantized (the embedding gather of a tied output matrix).
}  // namespace detail
#endif  // HIPC_ISA_AVX512

// y[t, n] = sum_k x[t, k] * W[n, k], W in the lanes layout of q3_k / q4_k / q5_k / q6_k blocks (see
// the top; K % 256 == 0). matmul_a16_lanes_*: int16 activations; matmul_lanes_*: int8
// (linear_lanes.h's entry points).
#if defined(HIPC_ISA_AVX512)
HIPC_LANES_ENTRY(q4_k, LKQ4K, lk_matmul, lk_embed_row)
HIPC_LANES_ENTRY(q5_k, LKQ5K, lk_matmul, lk_embed_row)
HIPC_LANES_ENTRY(q6_k, LKQ6K, lk_matmul, lk_embed_row)
HIPC_LANES_ENTRY(q3_k, LKQ3K, lk_matmul, lk_embed_row)
#endif

}  // namespace hipc
