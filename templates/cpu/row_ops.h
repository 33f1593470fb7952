// row_ops.h -- the small row operations the linear and attention kernels share:
// scratch buffers, RMSNorm, RoPE. Apart because they are plain loops, not matmuls.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace hipc {

// Per-thread scratch, grown on demand and kept: kernels run every step, so
// allocating once and reusing keeps malloc out of the decode loop.
inline float* scratch_f32(int slot, size_t n) {
  thread_local std::vector<float> buf[4];
  std::vector<float>& v = buf[slot];
  if (v.size() < n + 16) v.resize(n + 16);
  return v.data();
}

// y = x / sqrt(mean(x^2) + eps) * w over one row of n.
inline void rmsnorm_row(const float* x, const float* w, int n, float eps, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / n + eps);
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

// RoPE on one head of D values at one position; cs/sn hold D/2 angles' cos/sin.
// "half": pairs (i, i + D/2) as in HF Llama. "interleaved": pairs (2i, 2i+1), the
// layout GGUF llama files are permuted for.
inline void rope_half(float* x, int D, const float* cs, const float* sn) {
  const int h = D / 2;
  for (int i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    x[i] = a * cs[i] - b * sn[i];
    x[i + h] = b * cs[i] + a * sn[i];
  }
}

inline void rope_interleaved(float* x, int D, const float* cs, const float* sn) {
  for (int i = 0; i < D / 2; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * cs[i] - b * sn[i];
    x[2 * i + 1] = b * cs[i] + a * sn[i];
  }
}

}  // namespace hipc
