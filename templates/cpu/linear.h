// linear.h -- the public matmul_<type> entry points (int8 activations).
// One name per weight type, picking the ISA's driver, so generated code never
// spells an ISA.
#pragma once

namespace hipc {

// ====================================================================================
// Public matmuls
//
//   y[t*ldy + n] = sum_{k<K} x[t*K + k] * W[n, k]      for t < T, n < N   (ldy >= N)
//
//   x : f32 [T, K] row-major (activations, one row per token)
//   W : [N, K] in the named layout (GGUF blocks of 32 along K for q4_0/q4_1/q8_0, which
//       need K % 32 == 0; plain row-major for f32/f16/bf16)
//   y : f32, row t starts at y + t*ldy; columns N..ldy-1 are not touched
//
// Quantized types: x is quantized once per token row to 8-bit blocks, products are
// integer per 32-element block, scaled in f32 (see the kernel sections above).
// T == 1 is the decode GEMV (weight-bandwidth bound); T > 1 unpacks each weight block
// once per row tile and reuses it for all T tokens (prefill; on AVX512 a batch's decode
// step of T = 2..7 runs the GEMV's layouts over all T tokens instead, linear_vnni.h).
// Parallel: one OpenMP region, rows split statically across threads. Call from a
// single thread; the call returns when y is complete.
// ====================================================================================
// Q4_0: W row n = K/32 blocks {f16 d; u8 qs[16]}, w = (nibble - 8) * d.
//   y[t,n] = sum_b d[n,b] * dx[t,b] * (sum_e nib[n,b,e] * q[t,b,e] - 8 * sum_e q[t,b,e])
inline void matmul_q4_0(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
#if defined(HIPC_ISA_AVX512)
  detail::q_matmul<detail::KQ4_0>(x, T, K, W, N, y, ldy);
#else
  detail::q_matmul<detail::BQ4_0>(x, T, K, W, N, y, ldy);
#endif
}

// Q4_1: W row n = K/32 blocks {f16 d; f16 m; u8 qs[16]}, w = nibble * d + m.
//   y[t,n] = sum_b ( d[n,b] * dx[t,b] * sum_e nib[n,b,e] * q[t,b,e] + m[n,b] * s[t,b] )
inline void matmul_q4_1(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
#if defined(HIPC_ISA_AVX512)
  detail::q_matmul<detail::KQ4_1>(x, T, K, W, N, y, ldy);
#else
  detail::q_matmul<detail::BQ4_1>(x, T, K, W, N, y, ldy);
#endif
}

// Q8_0: W row n = K/32 blocks {f16 d; i8 qs[32]}, w = qs * d.
//   y[t,n] = sum_b d[n,b] * dx[t,b] * sum_e qs[n,b,e] * q[t,b,e]
inline void matmul_q8_0(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
#if defined(HIPC_ISA_AVX512)
  detail::q_matmul<detail::KQ8_0>(x, T, K, W, N, y, ldy);
#else
  detail::q_matmul<detail::BQ8_0>(x, T, K, W, N, y, ldy);
#endif
}

// f32: W is float[N][K]; f32 FMA accumulation, no quantization (any K).
inline void matmul_f32(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  detail::d_matmul<detail::DF32>(x, T, K, W, N, y, ldy);
}

// f16: W is IEEE half [N][K], widened to f32 on load (vcvtph2ps); x stays f32 (any K).
inline void matmul_f16(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  detail::d_matmul<detail::DF16>(x, T, K, W, N, y, ldy);
}

// bf16: W is bfloat16 [N][K], widened to f32 on load (<< 16); x stays f32 (any K).
inline void matmul_bf16(const float* x, int T, int K, const void* W, int N, float* y, int ldy) {
  detail::d_matmul<detail::DBF16>(x, T, K, W, N, y, ldy);
}

}  // namespace hipc
