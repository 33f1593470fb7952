// hipc_cpu_moe.h -- Mixture-of-Experts building blocks for hipc's CPU kernels.
//
// The maths of hipc::MoERouter and hipc::Experts (compiler/reference/ops.py):
//   route:   p = softmax(logits[t, :E]); ids = the k largest p; w = p[ids] (/ sum w)
//   experts: y[t] (+)= sum_j w[t,j] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = ids[t,j]
// Expert weights are E matrices back to back, each in the file's layout (GGUF blocks or
// dense rows): gate/up [F, H], down [H, F]; `mm` is one of hipc_cpu.h's matmuls for
// their type. Only the routed experts' rows are read: tokens are grouped by expert, and
// each expert with tokens runs three matmuls over just those tokens (decode: k experts,
// one token each; prefill: one GEMM per routed expert instead of one per token).
// Threads: inside mm (rows split statically), as for the dense kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#pragma GCC visibility push(hidden)  // see hipc_cpu.h

namespace hipc {

using MatmulFn = void (*)(const float* x, int T, int K, const void* W, int N, float* y, int ldy);

// Scratch of its own (scratch_f32's slots belong to the dense kernels), kept across steps.
inline float* moe_scratch(int slot, size_t n) {
  thread_local std::vector<float> buf[5];
  std::vector<float>& v = buf[slot];
  if (v.size() < n) v.resize(n);
  return v.data();
}

// One token's routing. The top-k is torch's CPU topk step for step (ATen topk_impl_loop):
// std::partial_sort when k * 64 <= E, else std::nth_element then std::sort of the first
// k - 1, on (probability, index) pairs compared by probability only. Built against the
// same libstdc++ algorithms, equal probabilities come out in torch's order, as the
// reference executor orders them (compiler/reference/topk.py).
inline void moe_route(const float* logits, int E, int k, bool normalize, int* ids, float* w) {
  float mx = logits[0];
  for (int e = 1; e < E; ++e) mx = std::max(mx, logits[e]);
  float* p = moe_scratch(0, (size_t)E);
  float sum = 0.f;
  for (int e = 0; e < E; ++e) sum += p[e] = std::exp(logits[e] - mx);
  for (int e = 0; e < E; ++e) p[e] /= sum;
  using Pair = std::pair<double, int64_t>;
  thread_local std::vector<Pair> q;
  q.resize(E);
  for (int e = 0; e < E; ++e) q[e] = {p[e], e};
  auto greater = [](const Pair& a, const Pair& b) { return a.first > b.first; };
  if ((int64_t)k * 64 <= E) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), greater);
  } else {
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), greater);
    std::sort(q.begin(), q.begin() + k - 1, greater);
  }
  float total = 0.f;
  for (int j = 0; j < k; ++j) {
    ids[j] = (int)q[j].second;
    total += w[j] = p[ids[j]];
  }
  if (normalize)
    for (int j = 0; j < k; ++j) w[j] /= total;
}

// y[T, H] = sum over each token's k routed experts (accumulate: y += when `accumulate`,
// so a residual stream can be updated in place). x [T, H]; ids, w [T, k].
inline void moe_experts(MatmulFn mm, const float* x, int T, int H, int F, int E, int k,
                        const int* ids, const float* w, const void* gate, const void* up,
                        const void* down, size_t gate_bytes, size_t down_bytes, float* y,
                        bool accumulate) {
  if (!accumulate)
    for (size_t i = 0; i < (size_t)T * H; ++i) y[i] = 0.f;
  thread_local std::vector<int> tok;
  thread_local std::vector<float> wt;
  float* xs = moe_scratch(1, (size_t)T * H);
  float* g = moe_scratch(2, (size_t)T * F);
  float* u = moe_scratch(3, (size_t)T * F);
  float* d = moe_scratch(4, (size_t)T * H);
  for (int e = 0; e < E; ++e) {
    tok.clear();
    wt.clear();
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j)
        if (ids[(size_t)t * k + j] == e) {
          tok.push_back(t);
          wt.push_back(w[(size_t)t * k + j]);
        }
    const int n = (int)tok.size();
    if (n == 0) continue;  // never touch an expert no token was routed to
    for (int i = 0; i < n; ++i) std::copy_n(x + (size_t)tok[i] * H, H, xs + (size_t)i * H);
    mm(xs, n, H, (const uint8_t*)gate + e * gate_bytes, F, g, F);
    mm(xs, n, H, (const uint8_t*)up + e * gate_bytes, F, u, F);
    for (size_t i = 0; i < (size_t)n * F; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    mm(g, n, F, (const uint8_t*)down + e * down_bytes, H, d, H);
    for (int i = 0; i < n; ++i)
      for (int c = 0; c < H; ++c) y[(size_t)tok[i] * H + c] += wt[i] * d[(size_t)i * H + c];
  }
}

}  // namespace hipc

#pragma GCC visibility pop
