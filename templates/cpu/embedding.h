// embedding.h -- embedding row gathers (dequantize one row to f32).
// Serial and O(K): a token's row is read once per step, no kernel to tune.
#pragma once

namespace hipc {

// ====================================================================================
// Embedding row gather: out[k] = W[row, k] dequantized to f32, k < K.
//   One row of K/32 blocks (quantized) or K elements (dense); serial, O(K).
//   Used for token embeddings (e.g. a Q8_0 token_embd shared with the LM head).
// ====================================================================================
inline void embed_row_q4_0(const void* W, int K, int64_t row, float* out) {
  const int nb = K / 32;
  const block_q4_0* b = (const block_q4_0*)W + row * nb;
  for (int i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < 16; ++j) {
      out[32 * i + j] = (float)((b[i].qs[j] & 15) - 8) * d;
      out[32 * i + j + 16] = (float)((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

inline void embed_row_q4_1(const void* W, int K, int64_t row, float* out) {
  const int nb = K / 32;
  const block_q4_1* b = (const block_q4_1*)W + row * nb;
  for (int i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
    for (int j = 0; j < 16; ++j) {
      out[32 * i + j] = (float)(b[i].qs[j] & 15) * d + m;
      out[32 * i + j + 16] = (float)(b[i].qs[j] >> 4) * d + m;
    }
  }
}

inline void embed_row_q8_0(const void* W, int K, int64_t row, float* out) {
  const int nb = K / 32;
  const block_q8_0* b = (const block_q8_0*)W + row * nb;
  for (int i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < 32; ++j) out[32 * i + j] = (float)b[i].qs[j] * d;
  }
}

inline void embed_row_f32(const void* W, int K, int64_t row, float* out) {
  std::memcpy(out, (const float*)W + row * K, sizeof(float) * (size_t)K);
}

inline void embed_row_f16(const void* W, int K, int64_t row, float* out) {
  const uint16_t* p = (const uint16_t*)W + row * K;
  for (int k = 0; k < K; ++k) out[k] = fp16_to_fp32(p[k]);
}

inline void embed_row_bf16(const void* W, int K, int64_t row, float* out) {
  const uint16_t* p = (const uint16_t*)W + row * K;
  for (int k = 0; k < K; ++k) out[k] = bf16_to_fp32(p[k]);
}

}  // namespace hipc
