// blocks.h -- GGUF block structs, the byte layouts the weight files store.
// Apart because the matmuls, the int16-activation kernels and the embedding gather
// all read the same blocks.
#pragma once

namespace hipc {

// ------------------------------------------------------------------------------------
// GGUF block layouts (32 elements per block, little-endian, no padding)
//
//   Q4_0 (18 B): f16 d; u8 qs[16]          w[j] = ((qs[j] & 15) - 8) * d,  w[j+16] = ((qs[j] >> 4) - 8) * d
//   Q4_1 (20 B): f16 d; f16 m; u8 qs[16]   w[j] = (qs[j] & 15) * d + m,    w[j+16] = (qs[j] >> 4) * d + m
//   Q8_0 (34 B): f16 d; i8 qs[32]          w[j] = qs[j] * d
//
// A weight matrix W[N, K] is N rows of K/32 consecutive blocks (K % 32 == 0).
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

}  // namespace hipc
