// quantize_act.h -- activation quantization and the scratch it lives in.
// Every quantized matmul rounds x to integer blocks once per token row first; the
// AVX512 and the AVX2/scalar kernels read the same pack (QAct).
#pragma once

namespace hipc {

// ------------------------------------------------------------------------------------
// Activation quantization: float row -> Q8 blocks with per-block scale and sum
//
//   For each block of 32 floats x[0..31]:
//     d = max_j |x[j]| / 127,   q[j] = round_to_nearest_even(x[j] / d)   (q in [-127, 127])
//     s = d * sum_j q[j]
//   so x[j] ~= q[j] * d.  The sum makes offset terms cheap: for a Q4_1 weight block
//   (w = n*dw + m) the block dot product is  sum_j w[j] x[j] ~= dw*d*sum_j n[j] q[j] + m*s.
//   (Same idea as ggml's q8_0/q8_1, but d and s are kept in f32.)
//
// block_q8a is the public, natural-order format. The matmuls use an internal copy of the
// same numbers (see detail::QAct); on AVX512 its int8 values are stored "transposed" in
// groups of 16 blocks so that one vpdpbusd covers 4 bytes of each of 16 blocks.
// ------------------------------------------------------------------------------------
struct block_q8a {
  float d;        // block scale
  float s;        // d * sum(qs)
  int8_t qs[32];  // quantized values, natural order
};
static_assert(sizeof(block_q8a) == 40, "block_q8a must be 40 bytes");

namespace detail {

// Quantize 32 floats: writes q[32] in natural order, returns d, and the integer sum.
// All ISA variants compute the bit-identical result (same scale, same rounding).
inline float quantize_block32(const float* x, int8_t* q, int32_t* isum) {
#if defined(HIPC_ISA_AVX512)
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const __m512 ax = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1));
  const float amax = _mm512_reduce_max_ps(ax);
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(q1));
  *isum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  return d;
#elif defined(HIPC_ISA_AVX2)
  const __m256 sgn = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 ax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    ax = _mm256_max_ps(ax, _mm256_andnot_ps(sgn, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(ax), _mm256_extractf128_ps(ax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i qi[4];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
    sum = _mm256_add_epi32(sum, qi[i]);
  }
  // pack 32 x i32 -> 32 x i8 (packs interleave 128-bit lanes; fix with a permute)
  const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]);
  const __m256i p23 = _mm256_packs_epi32(qi[2], qi[3]);
  __m256i p = _mm256_packs_epi16(p01, p23);
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)q, p);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *isum = _mm_cvtsi128_si32(s4);
  return d;
#else
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  int32_t s = 0;
  for (int j = 0; j < 32; ++j) {
    q[j] = (int8_t)std::nearbyint(x[j] * id);
    s += q[j];
  }
  *isum = s;
  return d;
#endif
}

}  // namespace detail

// quantize_row_q8a: x[K] (K % 32 == 0) -> K/32 blocks of block_q8a. Serial; one row.
inline void quantize_row_q8a(const float* x, int K, block_q8a* y) {
  for (int b = 0; b < K / 32; ++b) {
    int32_t isum;
    y[b].d = detail::quantize_block32(x + 32 * b, y[b].qs, &isum);
    y[b].s = y[b].d * (float)isum;
  }
}

namespace detail {

// ------------------------------------------------------------------------------------
// Scratch memory: per-thread, 64-byte aligned, grows on demand and is reused across
// calls (slot 0: activation pack of the calling thread, slot 1: per-thread weight slab).
// ------------------------------------------------------------------------------------
inline uint8_t* scratch(int slot, size_t bytes) {
  thread_local std::vector<uint8_t> buf[2];
  std::vector<uint8_t>& v = buf[slot];
  if (v.size() < bytes + 64) v.resize(bytes + 64);
  uint8_t* p = (uint8_t*)(((uintptr_t)v.data() + 63) & ~(uintptr_t)63);
#ifdef HIPC_POISON_SCRATCH
  // tests: every call starts from garbage (NaN floats, -1 bytes), so a kernel that reads
  // scratch it did not write this call fails at once instead of when a previous call
  // happened to leave something nonzero there
  std::memset(p, 0xFF, bytes);
#endif
  return p;
}

// Quantized activations for a [T, K] input, structure of arrays.
//   nbp     : blocks per row, padded (to a multiple of 16 on AVX512, = K/32 otherwise);
//             padding blocks are all zero (q = d = s = 0).
//   q       : [T][nbp*32] int8, block b at byte offset 32*b of its row.
//             AVX2/scalar: natural element order.
//             AVX512: blocks of the first `ntg` groups of 16 are stored "transposed":
//             group g (512 bytes) is 8 chunks of 64 bytes, chunk j holds for lane
//             l = 0..15 the 4 values of block 16g+l starting at element
//             chunk_elem(j) = 16*(j&1) + 4*(j>>1)  (j = 2c+h: the c-th dword of the low
//             (h=0) or high (h=1) half -- the nibble order of a Q4 qs dword c, which holds
//             elements 4c..4c+3 and 16+4c..16+4c+3). Blocks from 16*ntg on stay natural.
//   d, s    : [T][nbp] f32 scale and d*sum(q).   isum: [T][nbp] int32 sum(q).
//   lo      : int16 activations only (AVX512, see quantize_act16_row): q holds the high
//             bytes, lo the low bytes of each int16 value, in the same layout.
//   ext     : ext_bytes more (64-byte aligned) for what a kernel derives from the pack
//             (the K-quant kernels' per-lane scales and sums, linear_vnni_k.h).
struct QAct {
  int T = 0, nb = 0, nbp = 0, ntg = 0;
  int8_t* q = nullptr;
  uint8_t* lo = nullptr;
  float* d = nullptr;
  float* s = nullptr;
  int32_t* isum = nullptr;
  uint8_t* ext = nullptr;
};

inline constexpr int chunk_elem(int j) { return 16 * (j & 1) + 4 * (j >> 1); }

// planes: 1 (int8 activations) or 2 (int16 activations as high and low bytes).
inline QAct alloc_qact(int T, int K, int ntg, int planes = 1, size_t ext_bytes = 0) {
  QAct a;
  a.T = T;
  a.nb = K / 32;
  a.ntg = ntg;
#if defined(HIPC_ISA_AVX512)
  a.nbp = (a.nb + 15) / 16 * 16;
#else
  a.nbp = a.nb;
#endif
  const size_t nq = (size_t)T * a.nbp * 32, ns = (size_t)T * a.nbp * 4;
  const size_t nqa = (nq + 63) & ~(size_t)63;
  const size_t nsa = (ns + 63) & ~(size_t)63;
  uint8_t* p = scratch(0, planes * nqa + 3 * nsa + ext_bytes + 64);
  a.q = (int8_t*)p;
  a.lo = p;  // one plane: never read, but offsets from it stay well defined
  if (planes == 2) {
    a.lo = p + nqa;
    p += nqa;
  }
  a.d = (float*)(p + nqa);
  a.s = (float*)((uint8_t*)a.d + ((ns + 63) & ~(size_t)63));
  a.isum = (int32_t*)((uint8_t*)a.s + nsa);
  a.ext = (uint8_t*)a.isum + nsa;
  return a;
}

// Zero what one row of an activation plane holds past block nb: the unused lanes of a
// partial transposed group, or the natural-order padding blocks.
inline void pad_plane_row(uint8_t* row, const QAct& a) {
  if (a.nb < 16 * a.ntg) {
    uint8_t* gq = row + (size_t)(a.nb >> 4) * 512;
    for (int j = 0; j < 8; ++j) std::memset(gq + 64 * j + 4 * (a.nb & 15), 0, 4 * (16 - (a.nb & 15)));
  } else if (a.nb < a.nbp) {
    std::memset(row + 32 * (size_t)a.nb, 0, 32 * (size_t)(a.nbp - a.nb));
  }
}

// Store block b's 32 values v into one row of an activation plane (layout: see QAct).
inline void put_block(uint8_t* row, int b, bool transposed, const void* v) {
  if (transposed) {
    uint8_t* gq = row + (size_t)(b >> 4) * 512 + 4 * (b & 15);
    for (int j = 0; j < 8; ++j) std::memcpy(gq + 64 * j, (const uint8_t*)v + chunk_elem(j), 4);
  } else {
    std::memcpy(row + 32 * (size_t)b, v, 32);
  }
}

// Quantize token row t of x[T, K] into the pack (see QAct for the layout).
inline void quantize_act_row(const float* x, int K, const QAct& a, int t) {
  (void)K;
  const float* xr = x + (size_t)t * K;
  int8_t* qr = a.q + (size_t)t * a.nbp * 32;
  float* dr = a.d + (size_t)t * a.nbp;
  float* sr = a.s + (size_t)t * a.nbp;
  int32_t* ir = a.isum + (size_t)t * a.nbp;
  const int nbt = std::min(a.nb, 16 * a.ntg);  // blocks stored transposed
  for (int b = 0; b < a.nb; ++b) {
    int32_t isum;
    float d;
    if (b < nbt) {
      int8_t tmp[32];
      d = quantize_block32(xr + 32 * b, tmp, &isum);
      int8_t* gq = qr + (size_t)(b >> 4) * 512 + 4 * (b & 15);
      for (int j = 0; j < 8; ++j) std::memcpy(gq + 64 * j, tmp + chunk_elem(j), 4);
    } else {
      d = quantize_block32(xr + 32 * b, qr + 32 * b, &isum);
    }
    dr[b] = d;
    sr[b] = d * (float)isum;
    ir[b] = isum;
  }
  for (int b = a.nb; b < a.nbp; ++b) {
    dr[b] = 0.0f;
    sr[b] = 0.0f;
    ir[b] = 0;
  }
  pad_plane_row((uint8_t*)qr, a);
}

// Work below this many multiply-adds runs on the calling thread only (a parallel region
// costs a few microseconds).
constexpr long long kParallelMinWork = 1LL << 16;

}  // namespace detail

}  // namespace hipc
