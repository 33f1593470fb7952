// convert.h -- f16/bf16 <-> f32 conversions.
// Apart because dense weights, GGUF block scales and embeddings all read halves.
#pragma once

namespace hipc {

// ------------------------------------------------------------------------------------
// f16 / bf16 <-> f32
//
// f16 is IEEE binary16 (1 sign, 5 exponent, 10 mantissa bits). bf16 is the upper 16
// bits of an IEEE binary32. With F16C the conversions are single instructions; the
// portable versions are exact (f32->f16 and f32->bf16 round to nearest even, NaN stays
// NaN, f16 subnormals handled).
// ------------------------------------------------------------------------------------
namespace detail {
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace detail

inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  // Re-bias the exponent with one multiply (normal numbers) or build subnormals with a
  // magic-number subtraction; both exact.
  const uint32_t w = (uint32_t)h << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = detail::f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = detail::f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t r = sign | (two_w < (1u << 27) ? detail::f32_bits(denormalized)
                                                 : detail::f32_bits(normalized));
  return detail::f32_from_bits(r);
#endif
}

inline uint16_t fp32_to_fp16(float f) {
#if defined(__F16C__)
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = detail::f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = detail::f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = detail::f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

inline float bf16_to_fp32(uint16_t h) { return detail::f32_from_bits((uint32_t)h << 16); }

inline uint16_t fp32_to_bf16(float f) {
  const uint32_t u = detail::f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);  // quiet NaN
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace hipc
