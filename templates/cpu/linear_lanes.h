// linear_lanes.h -- quantized matmuls on weights the compiler stored in row lanes.
//
// The "lanes" layout (compiler/passes/repack.py, lane_quant_blocks) keeps every byte of
// the GGUF blocks but orders them for vector lanes = output rows (AVX512's 16 lanes; AVX2
// reads a group as two halves of 8, linear_lanes_avx2.h): rows in groups of 16
// (the last group padded with zero rows), and per group and block along K:
//   quants  [Q4/Q5: 4, Q8_0: 8] x 16 dwords   dword r of vector c: row r's quant dword c
//                                              (Q8_0: chunk c's 4 bytes, as u = q + 128)
//   fifth   64 bytes (Q5 only)                 the fifth bit of row r's element
//                                              chunk_elem(j) + i: bit 4r + i of qword j
//                                              (AVX512: chunk j's k-mask), or bit j of byte
//                                              4r + i (AVX2; kLaneFifthBytes)
//   scales  16 f16 d (Q4_1/Q5_1: d, m pairs)   lane r: row r's block scale
// with the blocks in pairs (the pair's quants, then its fifth bits, then its scales; a last
// odd block alone), so a group is one sequential stream. A block of 16 rows unpacks with no
// gathers or permutes (a nibble split, plus one masked add a chunk for Q5; Q8_0: nothing),
// and the GEMV needs no horizontal sums: lane r accumulates y[r]. Against the file's blocks
// (linear_vnni.h, whose transposed groups cost ~20 byte permutes and a horizontal sum a row)
// this is the shape of short rows: SmolLM2's 576-wide Q5_0 rows are 18 blocks, one
// transposed group and a 2-block tail.
//
// The GEMV (T <= 7: decode and a batch's decode step) takes int16 activations as a balanced
// split q = 256 * hi + lo with hi and lo both signed bytes (|q| <= 32639), so both planes are
// vpdpbusd's signed, broadcast memory operand against the unsigned weight bytes u = w + off:
//     I = 256 * sum(u * hi) + sum(u * lo) - off * sum(q)        (exact in int32)
// Prefill (T > 7) unpacks each block of 16 rows once into a slab and runs the row-lane GEMM
// of linear_vnni.h (rl_rows) over every token.
#pragma once

namespace hipc {

namespace detail {

// Per type: bytes a block of 16 rows takes in each region, the offset the unsigned weight
// bytes carry, and whether a block has a min (Q4_1/Q5_1: (d, m) f16 pairs). The AVX512
// kernels here and the AVX2 ones (linear_lanes_avx2.h) read the same bytes.
template <int Quant, int Fifth, int Scale, int Off, bool Min>
struct LaneLayout {
  static constexpr int kQuant = Quant, kFifth = Fifth, kScale = Scale, kOff = Off;
  static constexpr bool kMin = Min;
};
using LayQ4_0 = LaneLayout<256, 0, 32, 8, false>;
using LayQ4_1 = LaneLayout<256, 0, 64, 0, true>;
using LayQ5_0 = LaneLayout<256, 64, 32, 16, false>;
using LayQ5_1 = LaneLayout<256, 64, 64, 0, true>;
using LayQ8_0 = LaneLayout<512, 0, 32, 128, false>;

// The fifth bits' arrangement this build reads (repack.py FIFTH_FORMS; passes/lanes.py
// fifth_form gives the compiler the same answer for the build machine): AVX512 takes a chunk's
// 64 bits as one k-mask; AVX2 a byte's 8 chunks, one shift from bit 4 a chunk.
#if defined(HIPC_ISA_AVX512)
inline constexpr bool kLaneFifthBytes = false;
#else
inline constexpr bool kLaneFifthBytes = true;
#endif

// The fifth bit of row r's element chunk_elem(j) + i in a block's (a Q5_K unit's) 64 bytes
inline int lane_fifth_bit(const uint8_t* h, int j, int r, int i) {
  return kLaneFifthBytes ? (h[4 * r + i] >> j) & 1 : (h[8 * j + (4 * r + i) / 8] >> ((4 * r + i) % 8)) & 1;
}

// A group's block b: its quants, fifth bits and scales (blocks in pairs, see the top).
template <class L>
struct LaneBlock {
  const uint8_t* q;
  const uint8_t* h;
  const uint8_t* s;
};
template <class L>
inline LaneBlock<L> lane_block(const uint8_t* group, int nb, int b) {
  constexpr int C = L::kQuant + L::kFifth + L::kScale;
  const int m = std::min(2, nb - (b & ~1)), o = b & 1;
  const uint8_t* pair = group + (size_t)(b & ~1) * C;
  return {pair + o * L::kQuant, pair + m * L::kQuant + o * L::kFifth, pair + m * (L::kQuant + L::kFifth) + o * L::kScale};
}
template <class L>
inline const uint8_t* lane_group(const uint8_t* W, int nb, int g) {
  return W + (size_t)g * nb * (L::kQuant + L::kFifth + L::kScale);
}

// Row `row` of a lanes matrix, dequantized (the embedding gather of a tied output matrix).
template <class L>
inline void lane_embed_row(const void* W, int K, int64_t row, float* out) {
  const int nb = K / 32, r = (int)(row & 15);
  const uint8_t* group = lane_group<L>((const uint8_t*)W, nb, (int)(row >> 4));
  for (int b = 0; b < nb; ++b) {
    const LaneBlock<L> B = lane_block<L>(group, nb, b);
    uint16_t h[2] = {0, 0};
    std::memcpy(h, B.s + (L::kMin ? 4 : 2) * r, L::kMin ? 4 : 2);
    const float d = fp16_to_fp32(h[0]), m = L::kMin ? fp16_to_fp32(h[1]) : 0.f;
    for (int j = 0; j < 8; ++j) {
      for (int i = 0; i < 4; ++i) {
        int u;
        if constexpr (L::kQuant == 256) {
          const uint8_t q = B.q[64 * (j >> 1) + 4 * r + i];
          u = (j & 1) ? q >> 4 : q & 15;
          if constexpr (L::kFifth) u |= lane_fifth_bit(B.h, j, r, i) << 4;
        } else {
          u = B.q[64 * j + 4 * r + i];
        }
        out[32 * b + chunk_elem(j) + i] = (float)(u - L::kOff) * d + m;
      }
    }
  }
}

}  // namespace detail

#if defined(HIPC_ISA_AVX512)
namespace detail {

// The linear_vnni.h type whose epilogue (offset, min) and activation planes the slab GEMM
// uses, and whether the GEMV prefetches along a group (cold, one EPYC core: the 4- and 5-bit
// types faster with it, the Q8_0 LM head 1.14-1.25 ms without against 1.40-1.68 with:
// cpu-amd-epyc.md "Session 29").
template <class Lay, class Q_, bool Prefetch>
struct LaneType : Lay {
  using Q = Q_;
  static constexpr bool kPrefetch = Prefetch;
};
using LQ4_0 = LaneType<LayQ4_0, KQ4_0, true>;
using LQ4_1 = LaneType<LayQ4_1, KQ4_1, true>;
using LQ5_0 = LaneType<LayQ5_0, KQ5_0, true>;
using LQ5_1 = LaneType<LayQ5_1, KQ5_1, true>;
using LQ8_0 = LaneType<LayQ8_0, KQ8_0, false>;

// Block b of a group: w[j] lane r = the 4 unsigned weight bytes of row r at chunk j (the
// WGroup of linear_vnni.h's row-lane prep), dw / mw its scales.
template <class L>
inline void lane_unpack(const LaneBlock<L>& B, WGroup& out) {
  if constexpr (L::kQuant == 256) {  // nibbles (Q4, Q5), the fifth bits added on (Q5)
    for (int c = 0; c < 4; ++c) split_nibbles(_mm512_loadu_si512(B.q + 64 * c), out.w[2 * c], out.w[2 * c + 1]);
    if constexpr (L::kFifth) {
      static_assert(!kLaneFifthBytes);
      __mmask64* h = (__mmask64*)B.h;  // _load_mask64 takes no const
      const __m512i sixteen = _mm512_set1_epi8(16);
      for (int j = 0; j < 8; ++j) out.w[j] = _mm512_mask_add_epi8(out.w[j], _load_mask64(h + j), out.w[j], sixteen);
    }
  } else {
    for (int j = 0; j < 8; ++j) out.w[j] = _mm512_loadu_si512(B.q + 64 * j);
  }
  if constexpr (L::Q::kMin) {
    cvt_dm(_mm512_loadu_si512(B.s), out.dw, out.mw);
  } else {  // mw unread: the offset comes off in int32 (kOff * isum) in every kernel here
    out.dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)B.s));
  }
}

// Token t's int16 activations (x: its row) as the balanced split (see the top);
// d = max|x| / 32639 per block, isum = sum(q), s = sum(x).
inline void quantize_lane_row(const float* x, int K, const QAct& a, int t) {
  int8_t* hr = a.q + (size_t)t * a.nbp * 32;
  int8_t* lr = (int8_t*)a.lo + (size_t)t * a.nbp * 32;
  float* d = a.d + (size_t)t * a.nbp;
  float* s = a.s + (size_t)t * a.nbp;
  int32_t* isum = a.isum + (size_t)t * a.nbp;
  for (int b = 0; b < K / 32; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32639.f / amax : 0.f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    const __m512i r = _mm512_set1_epi32(128);
    const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(q0, r), 8);
    const __m512i h1 = _mm512_srai_epi32(_mm512_add_epi32(q1, r), 8);
    const __m512i l0 = _mm512_sub_epi32(q0, _mm512_slli_epi32(h0, 8));
    const __m512i l1 = _mm512_sub_epi32(q1, _mm512_slli_epi32(h1, 8));
    _mm_storeu_si128((__m128i*)(hr + 32 * b), _mm512_cvtepi32_epi8(h0));
    _mm_storeu_si128((__m128i*)(hr + 32 * b + 16), _mm512_cvtepi32_epi8(h1));
    _mm_storeu_si128((__m128i*)(lr + 32 * b), _mm512_cvtepi32_epi8(l0));
    _mm_storeu_si128((__m128i*)(lr + 32 * b + 16), _mm512_cvtepi32_epi8(l1));
    d[b] = amax / 32639.f;
    isum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    s[b] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
  }
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// A block of 16 rows (w: its 8 chunks, lane = row) against one token's planes at xh (and xl,
// P = 2: I = 256 * hi + lo): i0 the even chunks' sums (elements 0..15), i1 the odd ones' (16..31)
template <int P>
inline void lane_dot(const __m512i (&w)[8], const int8_t* xh, const int8_t* xl, __m512i& i0, __m512i& i1) {
  i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(xh + chunk_elem(0)));
  i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], bcast4(xh + chunk_elem(1)));
  for (int j = 2; j < 8; j += 2) {
    i0 = _mm512_dpbusd_epi32(i0, w[j], bcast4(xh + chunk_elem(j)));
    i1 = _mm512_dpbusd_epi32(i1, w[j + 1], bcast4(xh + chunk_elem(j + 1)));
  }
  if constexpr (P == 2) {
    i0 = _mm512_slli_epi32(i0, 8);
    i1 = _mm512_slli_epi32(i1, 8);
    for (int j = 0; j < 8; j += 2) {
      i0 = _mm512_dpbusd_epi32(i0, w[j], bcast4(xl + chunk_elem(j)));
      i1 = _mm512_dpbusd_epi32(i1, w[j + 1], bcast4(xl + chunk_elem(j + 1)));
    }
  }
}

#ifndef HIPC_LANE_PREFETCH
#define HIPC_LANE_PREFETCH 1  // 0: no software prefetch in any lanes GEMV (A/B benchmarks)
#endif

// GEMV of group g (16 rows) against T tokens' planes (T > 1: a batch's decode step; each
// block of 16 rows unpacked once for all of them). One group a task, as one sequential
// stream: two groups at once read 13-16 GB/s cold on one EPYC core where one group reads
// 20-28 (bench_cpu_lanes.py, docs/benchmarks/cpu-amd-epyc.md "Session 29").
template <class L, int T, int P>
inline void lane_gemv_group(const uint8_t* W, int nb, int g, const QAct& a, float* y, int ldy, int N) {
  using Q = typename L::Q;
  __m512 facc[T];
  for (int t = 0; t < T; ++t) facc[t] = _mm512_setzero_ps();
  const uint8_t* G = lane_group<L>(W, nb, g);
  constexpr int C = L::kQuant + L::kFifth + L::kScale;
  const size_t xs = (size_t)a.nbp * 32, ss = (size_t)a.nbp;
  for (int b = 0; b < nb; ++b) {
    if constexpr (L::kPrefetch && HIPC_LANE_PREFETCH) prefetch_range(G + (size_t)b * C + HIPC_PREFETCH_BYTES, C);
    WGroup wg;
    lane_unpack<L>(lane_block<L>(G, nb, b), wg);
    for (int t = 0; t < T; ++t) {
      const int8_t* xh = a.q + t * xs + 32 * (size_t)b;
      const int8_t* xl = (const int8_t*)a.lo + t * xs + 32 * (size_t)b;
      __m512i i0, i1;
      lane_dot<P>(wg.w, xh, xl, i0, i1);
      const size_t so = t * ss + b;
      __m512i I = _mm512_add_epi32(i0, i1);
      if constexpr (L::kOff != 0) I = _mm512_sub_epi32(I, _mm512_set1_epi32(a.isum[so] * L::kOff));
      facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(wg.dw, _mm512_set1_ps(a.d[so])), facc[t]);
      if constexpr (Q::kMin) facc[t] = _mm512_fmadd_ps(wg.mw, _mm512_set1_ps(a.s[so]), facc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + (size_t)t * ldy + 16 * g, mask16(N - 16 * g), facc[t]);
}

template <class L, int T, int P>
inline void lane_gemv(const uint8_t* W, int nb, int ngroups, const QAct& a, float* y, int ldy, int N, bool par) {
#pragma omp parallel for schedule(static) if (par)
  for (int g = 0; g < ngroups; ++g) lane_gemv_group<L, T, P>(W, nb, g, a, y, ldy, N);
}

// A prefill over slabs of kRlVecs 16-row groups: fill(i, slab) unpacks tile i's groups into
// the slab (unit b of group v at slab[b * kRlVecs + v]), once; linear_vnni.h's row-lane GEMM
// with type Q's epilogue then runs every token against it.
template <class Q, int P, class Fill>
inline void lane_prefill(const float* x, int T, int K, int N, float* y, int ldy, int ngroups, bool par, Fill fill) {
  const QAct a = alloc_qact(T, K, 0, P);
  constexpr int V = kRlVecs, C = kRlCols;
  const int nb = K / 32, ntiles = (ngroups + V - 1) / V;
#pragma omp parallel if (par)
  {
#pragma omp for schedule(static)
    for (int t = 0; t < T; ++t) {
      if constexpr (P == 1) {
        quantize_act_row(x, K, a, t);
      } else {
        quantize_act16_row<Q>(x, K, a, t);
      }
    }
    WGroup* slab = (WGroup*)scratch(1, sizeof(WGroup) * (size_t)nb * V);
#pragma omp for schedule(static)
    for (int i = 0; i < ntiles; ++i) {
      fill(i, slab);
      rl_rows<Q, V, C, P>(slab, nb, a, 16 * V * i, N, y, ldy);
    }
  }
}

// Driver: P = 2 (int16 activations) or 1 (int8). W: the lanes layout of [N, K].
template <class L, int P>
inline void lane_matmul(const float* x, int T, int K, const void* Wv, int N, float* y, int ldy) {
  using Q = typename L::Q;
  if (T <= 0 || N <= 0) return;
  const uint8_t* W = (const uint8_t*)Wv;
  const int nb = K / 32, ngroups = (N + 15) / 16;
  const bool par = (long long)T * N * K >= kParallelMinWork;
  if (T <= kSmallBatchMax) {  // decode (T == 1) or a batch's decode step
    const QAct a = alloc_qact(T, K, 0, P);
    for (int t = 0; t < T; ++t) {
      if constexpr (P == 2) {
        quantize_lane_row(x + (size_t)t * K, K, a, t);
      } else {
        quantize_act_row(x, K, a, t);
      }
    }
    switch (T) {
      case 1: return lane_gemv<L, 1, P>(W, nb, ngroups, a, y, ldy, N, par);
      case 2: return lane_gemv<L, 2, P>(W, nb, ngroups, a, y, ldy, N, par);
      case 3: return lane_gemv<L, 3, P>(W, nb, ngroups, a, y, ldy, N, par);
      case 4: return lane_gemv<L, 4, P>(W, nb, ngroups, a, y, ldy, N, par);
      case 5: return lane_gemv<L, 5, P>(W, nb, ngroups, a, y, ldy, N, par);
      case 6: return lane_gemv<L, 6, P>(W, nb, ngroups, a, y, ldy, N, par);
      default: return lane_gemv<L, kSmallBatchMax, P>(W, nb, ngroups, a, y, ldy, N, par);
    }
  }
  // prefill: the slab of kRlVecs groups unpacked once, then every token (linear_vnni.h)
  lane_prefill<Q, P>(x, T, K, N, y, ldy, ngroups, par, [&](int i, WGroup* slab) {
    for (int v = 0; v < kRlVecs; ++v) {
      const int g = i * kRlVecs + v;
      for (int b = 0; b < nb; ++b) {
        if (g < ngroups) {
          lane_unpack<L>(lane_block<L>(lane_group<L>(W, nb, g), nb, b), slab[(size_t)b * kRlVecs + v]);
        } else {
          clear(slab[(size_t)b * kRlVecs + v]);
        }
      }
    }
  });
}

}  // namespace detail
#endif  // HIPC_ISA_AVX512

// y[t, n] = sum_k x[t, k] * W[n, k], W in the lanes layout of q5_0 / q5_1 / q8_0 blocks (see
// the top; K % 32 == 0). matmul_a16_lanes_*: int16 activations; matmul_lanes_*: int8.
// These entries are the AVX512-VNNI build's; AVX2 builds have linear_lanes_avx2.h's.
// (HIPC_LANES_ENTRY serves linear_lanes_k.h's and linear_lanes_avx2.h's types too; the
// latter undefines it.)
#define HIPC_LANES_ENTRY(name, L, MATMUL, EMBED)                                                            \
  inline void matmul_a16_lanes_##name(const float* x, int T, int K, const void* W, int N, float* y, int ldy) { \
    detail::MATMUL<detail::L, 2>(x, T, K, W, N, y, ldy);                                                     \
  }                                                                                                          \
  inline void matmul_lanes_##name(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {     \
    detail::MATMUL<detail::L, 1>(x, T, K, W, N, y, ldy);                                                     \
  }                                                                                                          \
  inline void embed_row_lanes_##name(const void* W, int K, int64_t row, float* out) {                        \
    detail::EMBED<detail::L>(W, K, row, out);                                                                \
  }
#if defined(HIPC_ISA_AVX512)
HIPC_LANES_ENTRY(q4_0, LQ4_0, lane_matmul, lane_embed_row)
HIPC_LANES_ENTRY(q4_1, LQ4_1, lane_matmul, lane_embed_row)
HIPC_LANES_ENTRY(q5_0, LQ5_0, lane_matmul, lane_embed_row)
HIPC_LANES_ENTRY(q5_1, LQ5_1, lane_matmul, lane_embed_row)
HIPC_LANES_ENTRY(q8_0, LQ8_0, lane_matmul, lane_embed_row)
#endif

}  // namespace hipc
