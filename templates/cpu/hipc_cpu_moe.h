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
// Threads: whole experts per thread when they balance, else inside mm (moe_experts).
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
  thread_local std::vector<float> buf[6];
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

// One expert over the n tokens routed to it (tok[i], weight wt[i]): y[tok[i]] += wt[i] *
// down(silu(gate x) * up x). Scratch is per thread, so threads may run experts at once.
inline void moe_expert(MatmulFn mm, MatmulFn mm_down, const float* x, int H, int F, const int* tok,
                       const float* wt, int n, const void* gate, const void* up, const void* down, float* y) {
  float* xs = moe_scratch(1, (size_t)n * H);
  float* g = moe_scratch(2, (size_t)n * F);
  float* u = moe_scratch(3, (size_t)n * F);
  float* d = moe_scratch(4, (size_t)n * H);
  for (int i = 0; i < n; ++i) std::copy_n(x + (size_t)tok[i] * H, H, xs + (size_t)i * H);
  mm(xs, n, H, gate, F, g, F);
  mm(xs, n, H, up, F, u, F);
  for (int i = 0; i < n; ++i) silu_mul_row(g + (size_t)i * F, u + (size_t)i * F, g + (size_t)i * F, F);
  mm_down(g, n, F, down, H, d, H);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < H; ++c) y[(size_t)tok[i] * H + c] += wt[i] * d[(size_t)i * H + c];
}

// Experts over threads when they balance: routed experts (most tokens first) go to the
// least-loaded thread; taken when the busiest thread gets at most kMoEImbalance times an
// even share, and the layer is worth a parallel region at all.
constexpr double kMoEImbalance = 1.15;
constexpr long long kMoEParallelWork = 1LL << 16;

// y[T, H] = sum over each token's k routed experts (accumulate: y += when `accumulate`,
// so a residual stream can be updated in place). x [T, H]; ids, w [T, k].
// Threads: one parallel region per layer with whole experts per thread (each expert's
// matmuls then run on its thread, their own regions inactive), partial sums added in
// thread order, so the result does not depend on timing; when the routed experts do not
// balance over the threads (fewer experts than threads, a prefill where a few experts
// take most tokens) the experts run one after another, threads inside the matmuls.
// `mm` multiplies by gate and up, `mm_down` by down (their types may differ: llama-quantize's
// Q4_K_M keeps some layers' down projections in Q6_K).
inline void moe_experts(MatmulFn mm, MatmulFn mm_down, const float* x, int T, int H, int F, int E, int k,
                        const int* ids, const float* w, const void* gate, const void* up,
                        const void* down, size_t gate_bytes, size_t down_bytes, float* y,
                        bool accumulate) {
  if (!accumulate)
    for (size_t i = 0; i < (size_t)T * H; ++i) y[i] = 0.f;
  // tokens grouped by expert (counting sort; tokens ascending within an expert)
  thread_local std::vector<int> first, tok, order, owner;
  thread_local std::vector<float> wt;
  first.assign((size_t)E + 1, 0);
  for (int i = 0; i < T * k; ++i) ++first[(size_t)ids[i] + 1];
  for (int e = 0; e < E; ++e) first[(size_t)e + 1] += first[e];
  tok.resize((size_t)T * k);
  wt.resize((size_t)T * k);
  {
    thread_local std::vector<int> at;
    at.assign(first.begin(), first.end() - 1);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) {
        const int e = ids[(size_t)t * k + j], i = at[e]++;
        tok[i] = t;
        wt[i] = w[(size_t)t * k + j];
      }
  }
  order.clear();
  for (int e = 0; e < E; ++e)
    if (first[(size_t)e + 1] > first[e]) order.push_back(e);  // never touch an unrouted expert
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return first[(size_t)a + 1] - first[a] > first[(size_t)b + 1] - first[b];
  });
  // thread_local names resolve per thread: other threads get these pointers instead
  const int* fst = first.data();
  const int* tk = tok.data();
  const float* tw = wt.data();
  const int* ord = order.data();
  const int nord = (int)order.size();
  const auto run = [=](int e, float* out) {
    const int i0 = fst[e], n = fst[e + 1] - i0;
    moe_expert(mm, mm_down, x, H, F, tk + i0, tw + i0, n, (const uint8_t*)gate + e * gate_bytes,
               (const uint8_t*)up + e * gate_bytes, (const uint8_t*)down + e * down_bytes, out);
  };
  int nt = 1;
#if defined(_OPENMP)
  nt = omp_in_parallel() ? 1 : omp_get_max_threads();
#endif
  bool by_expert = false;
  if (nt > 1 && (long long)T * k * 3 * F * H >= kMoEParallelWork && (int)order.size() >= nt) {
    thread_local std::vector<long long> load;
    load.assign(nt, 0);
    owner.assign(E, 0);
    for (int e : order) {
      const int th = (int)(std::min_element(load.begin(), load.end()) - load.begin());
      owner[e] = th;
      load[th] += first[(size_t)e + 1] - first[e];
    }
    const double even = (double)T * k / nt;
    by_expert = *std::max_element(load.begin(), load.end()) <= kMoEImbalance * even;
  }
  if (!by_expert) {
    for (int i = 0; i < nord; ++i) run(ord[i], y);
    return;
  }
  const int* own = owner.data();
  // thread 0 adds into y itself; the others into zeroed partials, added in thread order
  float* part = moe_scratch(5, (size_t)(nt - 1) * T * H);
#pragma omp parallel num_threads(nt)
  {
    int me = 0, team = 1;
#if defined(_OPENMP)
    me = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    float* out = me == 0 ? y : part + (size_t)(me - 1) * T * H;
    if (me > 0) std::fill_n(out, (size_t)T * H, 0.f);
    for (int i = 0; i < nord; ++i)
      if (own[ord[i]] % team == me) run(ord[i], out);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int c = 0; c < T * H; ++c)
      for (int p = 0; p < team - 1; ++p) y[c] += part[(size_t)p * T * H + c];
  }
}

}  // namespace hipc

#pragma GCC visibility pop
