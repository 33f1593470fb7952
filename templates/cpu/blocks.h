// blocks.h -- GGUF block structs, the byte layouts the weight files store.
// Apart because the matmuls, the int16-activation kernels and the embedding gather
// all read the same blocks.
#pragma once

namespace hipc {

// ------------------------------------------------------------------------------------
// GGUF block layouts (little-endian, no padding); 32 elements per block:
//
//   Q4_0 (18 B): f16 d; u8 qs[16]          w[j] = ((qs[j] & 15) - 8) * d,  w[j+16] = ((qs[j] >> 4) - 8) * d
//   Q4_1 (20 B): f16 d; f16 m; u8 qs[16]   w[j] = (qs[j] & 15) * d + m,    w[j+16] = (qs[j] >> 4) * d + m
//   Q8_0 (34 B): f16 d; i8 qs[32]          w[j] = qs[j] * d
//
//   Q5_0 (22 B): f16 d; u8 qh[4]; u8 qs[16]        q = nibble | (bit j of qh) << 4, w = (q - 16) * d
//   Q5_1 (24 B): f16 d; f16 m; u8 qh[4]; u8 qs[16]  the same q, w = q * d + m
//     (nibbles as Q4_0: element j < 16 is qs[j] & 15, element j + 16 is qs[j] >> 4)
//   IQ4_NL (18 B): f16 d; u8 qs[16]        nibbles as Q4_0, w = kIq4nlValues[nibble] * d
//     (a fixed non-linear table of 16 int8 values, llama.cpp's kvalues_iq4nl)
//   IQ4_XS (136 B, 256 elements): f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]
//     8 sub-blocks of 32, each an IQ4_NL block's nibbles (qs[16j ..]) with the 6-bit scale
//     ls = nibble j of scales_l | bits 2j.. of scales_h << 4: w = d * (ls - 32) * value
//
// K-quants: super-blocks of 256 elements (K % 256 == 0)
//   Q4_K (144 B): f16 d; f16 dmin; u8 scales[12]; u8 qs[128]
//     8 sub-blocks of 32, each with a 6-bit scale sc and min mn packed in scales[12]:
//     j < 4: sc = scales[j] & 63, mn = scales[j+4] & 63; j >= 4: the low 4 bits come from
//     scales[j+4] (sc: low nibble, mn: high nibble), the top 2 from scales[j-4] >> 6 (sc)
//     and scales[j] >> 6 (mn). Sub-block j = 2c + h is nibble h of qs[32c .. 32c+31].
//     w = d * sc * q - dmin * mn
//   Q5_K (176 B): f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]
//     as Q4_K, plus bit j of qh[i] as the fifth bit of element i of sub-block j
//   Q6_K (210 B): u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d
//     16 sub-blocks of 16, w = d * scales[e / 16] * (q - 32) with q = lo | hi << 4; in each
//     half h of 128 elements, element r takes lo = nibble (r / 64) of ql[64h + r % 64]
//     and hi = bits 2 * (r / 32) of qh[32h + r % 32]
//   Q3_K (110 B): u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d
//     16 sub-blocks of 16, w = d * (sc - 32) * q with q = lo - (hi ? 0 : 4) in -4..3; 32-unit
//     u = 4h + k (h the half of 128) takes lo = bits 2k of qs[32h + i] and hi = bit u of
//     hmask[i] (i = 0..31); sub-block 2u + i / 16's 6-bit sc: low 4 bits scales[n] & 15
//     (n < 8) or scales[n - 8] >> 4, top 2 bits scales[8 + n % 4] >> (2 * (n / 4)) & 3
//   Q2_K (84 B): u8 scales[16]; u8 qs[64]; f16 d; f16 dmin
//     16 sub-blocks of 16, each with a 4-bit scale (scales[n] & 15) and a 4-bit min
//     (scales[n] >> 4): w = d * sc * q - dmin * mn, q in 0..3 packed as Q3_K's low bits
//     (32-unit u = 4h + k: bits 2k of qs[32h + i])
//
// A weight matrix W[N, K] is N rows of K/QK consecutive blocks (K % QK == 0).
// ------------------------------------------------------------------------------------
struct block_q4_0 {
  uint16_t d;
  uint8_t qs[16];
};
struct block_q4_1 {
  uint16_t d, m;
  uint8_t qs[16];
};
struct block_q8_0 {
  uint16_t d;
  int8_t qs[32];
};
static_assert(sizeof(block_q4_0) == 18, "Q4_0 block must be 18 bytes");
static_assert(sizeof(block_q4_1) == 20, "Q4_1 block must be 20 bytes");
static_assert(sizeof(block_q8_0) == 34, "Q8_0 block must be 34 bytes");
struct block_q5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct block_q5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct block_q4_k {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
struct block_q5_k {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
struct block_q6_k {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
struct block_iq4_nl {
  uint16_t d;
  uint8_t qs[16];
};
alignas(16) inline constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                        1,    13,   25,  38,  53,  69,  89,  113};
static_assert(sizeof(block_q5_0) == 22, "Q5_0 block must be 22 bytes");
static_assert(sizeof(block_iq4_nl) == 18, "IQ4_NL block must be 18 bytes");
struct block_iq4_xs {
  uint16_t d, scales_h;
  uint8_t scales_l[4];
  uint8_t qs[128];
};
static_assert(sizeof(block_iq4_xs) == 136, "IQ4_XS block must be 136 bytes");
static_assert(sizeof(block_q5_1) == 24, "Q5_1 block must be 24 bytes");
static_assert(sizeof(block_q4_k) == 144, "Q4_K block must be 144 bytes");
static_assert(sizeof(block_q5_k) == 176, "Q5_K block must be 176 bytes");
static_assert(sizeof(block_q6_k) == 210, "Q6_K block must be 210 bytes");
struct block_q3_k {
  uint8_t hmask[32];
  uint8_t qs[64];
  uint8_t scales[12];
  uint16_t d;
};
static_assert(sizeof(block_q3_k) == 110, "Q3_K block must be 110 bytes");
struct block_q2_k {
  uint8_t scales[16];
  uint8_t qs[64];
  uint16_t d, dmin;
};
static_assert(sizeof(block_q2_k) == 84, "Q2_K block must be 84 bytes");

}  // namespace hipc
