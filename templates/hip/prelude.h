// hipc prelude: the small HIP kernel-language surface hipc's kernels use, mapped onto
//   - NVIDIA, compiled by nvcc (HIP names -> CUDA),
//   - AMD with ROCm's headers (hipcc / amdclang++, HIPC_ROCM defined),
//   - AMD with a bare `clang++ -x hip -nogpulib -nogpuinc` (clang builtins only).
// Kernels use only the hipc_* names below, so one template serves every platform.
// HIPC_WAVE (the wavefront width) is defined by the renderer before this header, and so is at
// most one of HIPC_MMA_NV / HIPC_MMA_WMMA / HIPC_MMA_MFMA: the target's matrix instruction,
// which the prefill GEMM (linear_mma) uses through the hipc_mma_* interface at the end.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
// ---- NVIDIA ------------------------------------------------------------------------
#define HIPC_KERNEL extern "C" __global__
#define HIPC_DEVICE __device__ __forceinline__
// n threads per block, and no occupancy target: ptxas then issues a loop's batch of loads
// before their first use instead of interleaving them with the math to save registers
#define HIPC_BOUNDS_LOADS_IN_FLIGHT(n) __launch_bounds__(n, 1)
__device__ __forceinline__ int hipc_thread() { return threadIdx.x; }
__device__ __forceinline__ int hipc_block_x() { return blockIdx.x; }
__device__ __forceinline__ int hipc_block_y() { return blockIdx.y; }
__device__ __forceinline__ int hipc_block_z() { return blockIdx.z; }
__device__ __forceinline__ int hipc_block_dim() { return blockDim.x; }
__device__ __forceinline__ void hipc_sync() { __syncthreads(); }
__device__ __forceinline__ float hipc_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ float hipc_shfl(float v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }
__device__ __forceinline__ float hipc_exp(float x) { return __expf(x); }
__device__ __forceinline__ float hipc_rsqrt(float x) { return rsqrtf(x); }

#elif defined(HIPC_ROCM)
// ---- AMD with ROCm headers ---------------------------------------------------------
#include <hip/hip_runtime.h>
#define HIPC_BOUNDS_LOADS_IN_FLIGHT(n) __launch_bounds__(n)
#define HIPC_KERNEL extern "C" __global__
#define HIPC_DEVICE __device__ __forceinline__
__device__ __forceinline__ int hipc_thread() { return threadIdx.x; }
__device__ __forceinline__ int hipc_block_x() { return blockIdx.x; }
__device__ __forceinline__ int hipc_block_y() { return blockIdx.y; }
__device__ __forceinline__ int hipc_block_z() { return blockIdx.z; }
__device__ __forceinline__ int hipc_block_dim() { return blockDim.x; }
__device__ __forceinline__ void hipc_sync() { __syncthreads(); }
__device__ __forceinline__ float hipc_shfl_xor(float v, int m) { return __shfl_xor(v, m, HIPC_WAVE); }
__device__ __forceinline__ float hipc_shfl(float v, int lane) { return __shfl(v, lane, HIPC_WAVE); }
__device__ __forceinline__ float hipc_exp(float x) { return __expf(x); }
__device__ __forceinline__ float hipc_rsqrt(float x) { return rsqrtf(x); }

#else
// ---- AMD, bare clang (no ROCm): attributes and builtins only -----------------------
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __launch_bounds__(n) __attribute__((amdgpu_flat_work_group_size(1, n)))
#define HIPC_BOUNDS_LOADS_IN_FLIGHT(n) __launch_bounds__(n)
#define HIPC_KERNEL extern "C" __global__
#define HIPC_DEVICE __device__ inline __attribute__((always_inline))
HIPC_DEVICE int hipc_thread() { return __builtin_amdgcn_workitem_id_x(); }
HIPC_DEVICE int hipc_block_x() { return __builtin_amdgcn_workgroup_id_x(); }
HIPC_DEVICE int hipc_block_y() { return __builtin_amdgcn_workgroup_id_y(); }
HIPC_DEVICE int hipc_block_z() { return __builtin_amdgcn_workgroup_id_z(); }
HIPC_DEVICE int hipc_block_dim() { return __builtin_amdgcn_workgroup_size_x(); }
HIPC_DEVICE void hipc_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
HIPC_DEVICE float hipc_shfl_xor(float v, int m) {
  // ds_bpermute addresses lanes in bytes
  const int lane = __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
  return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute((lane ^ m) << 2, __builtin_bit_cast(int, v)));
}
typedef __SIZE_TYPE__ size_t;
struct __attribute__((aligned(8))) uint2 { uint32_t x, y; };
struct __attribute__((aligned(16))) uint4 { uint32_t x, y, z, w; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
HIPC_DEVICE float hipc_shfl(float v, int src) {
  return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute(src << 2, __builtin_bit_cast(int, v)));
}
// NOTE: -nogpulib links no math library, so exp/rsqrt use the hardware instructions.
HIPC_DEVICE float hipc_exp(float x) { return __builtin_amdgcn_exp2f(x * 1.4426950408889634f); }
HIPC_DEVICE float hipc_rsqrt(float x) { return __builtin_amdgcn_rsqf(x); }
#endif

// ---- kernel overlap, L2 prefetch, cross-block hand-off ------------------------------
// Decode kernels are launched so the next one may start while this one finishes
// (programmatic dependent launch, sm_90+). A kernel touches nothing an earlier kernel
// writes before hipc_wait_prior() returns, which is when every earlier kernel has
// finished and its writes are visible; it calls hipc_let_next_start() right after, so
// at most the next kernel is resident early (prefetching its weights) while it runs.
// Elsewhere (AMD, sm_80/89) kernels run back to back and both are no-ops.
#if defined(__CUDACC__)
HIPC_DEVICE void hipc_wait_prior() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
HIPC_DEVICE void hipc_let_next_start() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
HIPC_DEVICE void hipc_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
// 16 bytes of weights through the read-only path, kept in program order. Issuing a
// batch before its first use also needs the kernel's HIPC_BOUNDS_LOADS_IN_FLIGHT: with an
// occupancy target ptxas moved each load next to its FMAs whatever the asm said.
HIPC_DEVICE uint4 hipc_load_weights16(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
// A block hands its results to whichever block counts last: every thread stores, then
// hipc_publish(); hipc_sync(); one thread calls hipc_count(), whose release covers the
// block's stores (they are ordered before it by the barrier) and whose acquire lets the
// last block read everyone's after the next hipc_sync().
HIPC_DEVICE void hipc_publish() {}
HIPC_DEVICE unsigned hipc_count(unsigned* p) {
  unsigned old;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  return old;
}
// another block's writes: read through L2, never a line this SM's L1 may hold
HIPC_DEVICE float hipc_load_coherent(const float* p) { return __ldcg(p); }
#else
HIPC_DEVICE void hipc_wait_prior() {}
HIPC_DEVICE void hipc_let_next_start() {}
HIPC_DEVICE void hipc_prefetch_l2(const void*) {}
HIPC_DEVICE uint4 hipc_load_weights16(const void* p) { return *(const uint4*)p; }
// every wave makes its own stores visible device-wide (a workgroup barrier does not)
HIPC_DEVICE void hipc_publish() { __builtin_amdgcn_fence(__ATOMIC_RELEASE, "agent"); }
HIPC_DEVICE unsigned hipc_count(unsigned* p) {
  return __hip_atomic_fetch_add(p, 1u, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
}
// the acquire in hipc_count invalidated this CU's vector L1
HIPC_DEVICE float hipc_load_coherent(const float* p) { return *p; }
#endif

// Pull `bytes` starting at p towards L2, one 128-byte line per lane and step (a wave's
// rows of weights, before waiting on the kernel before).
HIPC_DEVICE void hipc_prefetch_rows(const void* p, size_t bytes, int lane) {
  for (size_t o = (size_t)lane * 128; o < bytes; o += HIPC_WAVE * 128) hipc_prefetch_l2((const char*)p + o);
}

// ---- shared by every platform --------------------------------------------------------

HIPC_DEVICE float hipc_warp_sum(float v) {
#pragma unroll
  for (int m = HIPC_WAVE / 2; m > 0; m >>= 1) v += hipc_shfl_xor(v, m);
  return v;
}

HIPC_DEVICE float hipc_warp_max(float v) {
#pragma unroll
  for (int m = HIPC_WAVE / 2; m > 0; m >>= 1) {
    const float o = hipc_shfl_xor(v, m);
    v = v > o ? v : o;
  }
  return v;
}

// Sum over the block (blockDim a multiple of HIPC_WAVE, at most 32 waves); every
// thread gets the result. `red` is __shared__ float[32].
HIPC_DEVICE float hipc_block_sum(float v, float* red) {
  const int lane = hipc_thread() % HIPC_WAVE, wave = hipc_thread() / HIPC_WAVE;
  const int waves = hipc_block_dim() / HIPC_WAVE;
  v = hipc_warp_sum(v);
  hipc_sync();
  if (lane == 0) red[wave] = v;
  hipc_sync();
  v = lane < waves ? red[lane] : 0.f;
  return hipc_warp_sum(v);
}

HIPC_DEVICE float hipc_bf16_to_f32(uint16_t h) { return __builtin_bit_cast(float, (uint32_t)h << 16); }

HIPC_DEVICE float hipc_f16_to_f32(uint16_t h) {
  // IEEE half -> float, subnormals included, without a platform half type
  const uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
  if (e == 0) {
    const float f = (float)m * 5.9604644775390625e-08f;  // m * 2^-24
    return s ? -f : f;
  }
  const uint32_t bits = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112) << 23) | (m << 13));
  return __builtin_bit_cast(float, bits);
}

// KV-cache storage types: float32, or bfloat16 rounded to nearest even (half the bytes
// a step reads, twice the context per GiB). Values are float everywhere else.
HIPC_DEVICE float hipc_kv_load_f32(const float* p) { return *p; }
HIPC_DEVICE float hipc_kv_store_f32(float v) { return v; }
HIPC_DEVICE float hipc_kv_load_bf16(const uint16_t* p) { return hipc_bf16_to_f32(*p); }
HIPC_DEVICE uint16_t hipc_kv_store_bf16(float v) {
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// a value as the cache will hold it (the new token's k/v, used before it is read back)
HIPC_DEVICE float hipc_kv_round_f32(float v) { return v; }
HIPC_DEVICE float hipc_kv_round_bf16(float v) { return hipc_bf16_to_f32(hipc_kv_store_bf16(v)); }
// q . k for one cached key row; q (float) is in shared memory
HIPC_DEVICE float hipc_kv_dot_f32(const float* q, const float* k, int D) {
  float dot = 0.f;
  if (D % 4 == 0) {
#pragma unroll
    for (int d = 0; d < D; d += 4) {
      const float4 kv = *(const float4*)(k + d);
      dot += q[d] * kv.x + q[d + 1] * kv.y + q[d + 2] * kv.z + q[d + 3] * kv.w;
    }
  } else {
    for (int d = 0; d < D; ++d) dot += q[d] * k[d];
  }
  return dot;
}
HIPC_DEVICE float hipc_kv_dot_bf16(const float* q, const uint16_t* k, int D) {
  float dot = 0.f;
  if (D % 8 == 0) {
#pragma unroll
    for (int d = 0; d < D; d += 8) {
      const uint4 kv = *(const uint4*)(k + d);
      const uint32_t w[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dot += q[d + 2 * e] * __builtin_bit_cast(float, w[e] << 16) +
               q[d + 2 * e + 1] * __builtin_bit_cast(float, w[e] & 0xffff0000u);
    }
  } else {
    for (int d = 0; d < D; ++d) dot += q[d] * hipc_bf16_to_f32(k[d]);
  }
  return dot;
}

// GGUF blocks of 32 weights
struct hipc_block_q4_0 { uint16_t d; uint8_t qs[16]; };
struct hipc_block_q4_1 { uint16_t d, m; uint8_t qs[16]; };
struct hipc_block_q8_0 { uint16_t d; int8_t qs[32]; };

// One weight W[n, k] of a [N, K] matrix in its storage type (GEMM tile loads).
HIPC_DEVICE float hipc_w_f32(const void* W, int K, int n, int k) { return ((const float*)W)[(size_t)n * K + k]; }
HIPC_DEVICE float hipc_w_bf16(const void* W, int K, int n, int k) {
  return hipc_bf16_to_f32(((const uint16_t*)W)[(size_t)n * K + k]);
}
HIPC_DEVICE float hipc_w_f16(const void* W, int K, int n, int k) {
  return hipc_f16_to_f32(((const uint16_t*)W)[(size_t)n * K + k]);
}
HIPC_DEVICE float hipc_w_q8_0(const void* W, int K, int n, int k) {
  const hipc_block_q8_0& b = ((const hipc_block_q8_0*)W)[(size_t)n * (K / 32) + k / 32];
  return hipc_f16_to_f32(b.d) * (float)b.qs[k % 32];
}
HIPC_DEVICE float hipc_w_q4_0(const void* W, int K, int n, int k) {
  const hipc_block_q4_0& b = ((const hipc_block_q4_0*)W)[(size_t)n * (K / 32) + k / 32];
  const int j = k % 32, q = j < 16 ? (b.qs[j] & 15) : (b.qs[j - 16] >> 4);
  return hipc_f16_to_f32(b.d) * (float)(q - 8);
}
HIPC_DEVICE float hipc_w_q4_1(const void* W, int K, int n, int k) {
  const hipc_block_q4_1& b = ((const hipc_block_q4_1*)W)[(size_t)n * (K / 32) + k / 32];
  const int j = k % 32, q = j < 16 ? (b.qs[j] & 15) : (b.qs[j - 16] >> 4);
  return hipc_f16_to_f32(b.d) * (float)q + hipc_f16_to_f32(b.m);
}

// The GEMV inner loops, one per storage type: lane `lane` of a wave takes every
// HIPC_WAVE-th step of a weight row against x. Dense types read 8 values (16 bytes) per
// step; quantized types one 32-weight block. The kernels call the two-row hipc_dot2_*.
// Two rows against the same x. The loads of U steps are issued before any is used, so
// 2 x U x 16 bytes per lane are in flight (left to itself the compiler keeps ~2).
HIPC_DEVICE void hipc_fma_bf16x8(uint4 u, uint4 v, const float* x, float& a0, float& a1) {
  const float4 xa = *(const float4*)x, xb = *(const float4*)(x + 4);
  const float xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
  const uint32_t pu[4] = {u.x, u.y, u.z, u.w}, pv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    a0 += __builtin_bit_cast(float, pu[i] << 16) * xs[2 * i] + __builtin_bit_cast(float, pu[i] & 0xffff0000u) * xs[2 * i + 1];
    a1 += __builtin_bit_cast(float, pv[i] << 16) * xs[2 * i] + __builtin_bit_cast(float, pv[i] & 0xffff0000u) * xs[2 * i + 1];
  }
}
HIPC_DEVICE void hipc_dot2_bf16(const void* R0, const void* R1, const float* x, int K, int lane, float& a0, float& a1) {
  const uint16_t *w0 = (const uint16_t*)R0, *w1 = (const uint16_t*)R1;
  constexpr int U = 4, STEP = HIPC_WAVE * 8;
  int k = lane * 8;
  for (; k + (U - 1) * STEP < K; k += U * STEP) {
    uint4 u[U], v[U];
#pragma unroll
    for (int s = 0; s < U; ++s) {
      u[s] = hipc_load_weights16(w0 + k + s * STEP);
      v[s] = hipc_load_weights16(w1 + k + s * STEP);
    }
#pragma unroll
    for (int s = 0; s < U; ++s) hipc_fma_bf16x8(u[s], v[s], x + k + s * STEP, a0, a1);
  }
  for (; k < K; k += STEP) hipc_fma_bf16x8(*(const uint4*)(w0 + k), *(const uint4*)(w1 + k), x + k, a0, a1);
}
#define HIPC_GENERIC_DOT2(T)                                                                              \
  HIPC_DEVICE void hipc_dot2_##T(const void* R0, const void* R1, const float* x, int K, int lane, float& a0, \
                                 float& a1) {                                                              \
    a0 += hipc_dot_##T(R0, x, K, lane);                                                                    \
    a1 += hipc_dot_##T(R1, x, K, lane);                                                                    \
  }

HIPC_DEVICE float hipc_dot_f16(const void* Wrow, const float* x, int K, int lane) {
  const uint16_t* w = (const uint16_t*)Wrow;
  float acc = 0.f;
#pragma unroll 4
  for (int k = lane * 8; k < K; k += HIPC_WAVE * 8) {
    const uint4 v = *(const uint4*)(w + k);
    const float4 xa = *(const float4*)(x + k), xb = *(const float4*)(x + k + 4);
    acc += hipc_f16_to_f32((uint16_t)(v.x & 0xffffu)) * xa.x + hipc_f16_to_f32((uint16_t)(v.x >> 16)) * xa.y;
    acc += hipc_f16_to_f32((uint16_t)(v.y & 0xffffu)) * xa.z + hipc_f16_to_f32((uint16_t)(v.y >> 16)) * xa.w;
    acc += hipc_f16_to_f32((uint16_t)(v.z & 0xffffu)) * xb.x + hipc_f16_to_f32((uint16_t)(v.z >> 16)) * xb.y;
    acc += hipc_f16_to_f32((uint16_t)(v.w & 0xffffu)) * xb.z + hipc_f16_to_f32((uint16_t)(v.w >> 16)) * xb.w;
  }
  return acc;
}
HIPC_DEVICE float hipc_dot_f32(const void* Wrow, const float* x, int K, int lane) {
  const float* w = (const float*)Wrow;
  float acc = 0.f;
  for (int k = lane * 4; k < K; k += HIPC_WAVE * 4) {
    const float4 v = *(const float4*)(w + k);
    acc += v.x * x[k] + v.y * x[k + 1] + v.z * x[k + 2] + v.w * x[k + 3];
  }
  return acc;
}
HIPC_DEVICE float hipc_dot_q8_0(const void* Wrow, const float* x, int K, int lane) {
  const hipc_block_q8_0* w = (const hipc_block_q8_0*)Wrow;
  float acc = 0.f;
  for (int b = lane; b < K / 32; b += HIPC_WAVE) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 32; ++j) s += (float)w[b].qs[j] * x[b * 32 + j];
    acc += hipc_f16_to_f32(w[b].d) * s;
  }
  return acc;
}
HIPC_DEVICE float hipc_dot_q4_0(const void* Wrow, const float* x, int K, int lane) {
  const hipc_block_q4_0* w = (const hipc_block_q4_0*)Wrow;
  float acc = 0.f;
  for (int b = lane; b < K / 32; b += HIPC_WAVE) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      s += (float)((w[b].qs[j] & 15) - 8) * x[b * 32 + j];
      s += (float)((w[b].qs[j] >> 4) - 8) * x[b * 32 + j + 16];
    }
    acc += hipc_f16_to_f32(w[b].d) * s;
  }
  return acc;
}
HIPC_DEVICE float hipc_dot_q4_1(const void* Wrow, const float* x, int K, int lane) {
  const hipc_block_q4_1* w = (const hipc_block_q4_1*)Wrow;
  float acc = 0.f;
  for (int b = lane; b < K / 32; b += HIPC_WAVE) {
    float s = 0.f, sx = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      s += (float)(w[b].qs[j] & 15) * x[b * 32 + j] + (float)(w[b].qs[j] >> 4) * x[b * 32 + j + 16];
      sx += x[b * 32 + j] + x[b * 32 + j + 16];
    }
    acc += hipc_f16_to_f32(w[b].d) * s + hipc_f16_to_f32(w[b].m) * sx;
  }
  return acc;
}

HIPC_GENERIC_DOT2(f16)
HIPC_GENERIC_DOT2(f32)
HIPC_GENERIC_DOT2(q8_0)
HIPC_GENERIC_DOT2(q4_0)
HIPC_GENERIC_DOT2(q4_1)

// Bytes of one weight row of K values in a storage type (row pointers in kernels).
#define HIPC_ROW_BYTES_f32(K) ((size_t)(K) * 4)
#define HIPC_ROW_BYTES_bf16(K) ((size_t)(K) * 2)
#define HIPC_ROW_BYTES_f16(K) ((size_t)(K) * 2)
#define HIPC_ROW_BYTES_q8_0(K) ((size_t)(K) / 32 * 34)
#define HIPC_ROW_BYTES_q4_0(K) ((size_t)(K) / 32 * 18)
#define HIPC_ROW_BYTES_q4_1(K) ((size_t)(K) / 32 * 20)

// ---- matrix instructions (the prefill GEMM, bf16 weights) ---------------------------------
// One MMA tile multiplies A = 16 rows (tokens) x 16 k by B = HIPC_MMA_N columns (weight rows)
// x 16 k into a float32 16 x HIPC_MMA_N accumulator spread over the wave. Both operands are
// read from shared memory where they are stored row-major, k contiguous, `ld` elements apart:
// x rows for A and W rows (B's columns) for B, so the two loads differ only in row count.
// hipc_mma_row/col(lane, i) say where accumulator element i of a lane sits in the tile.

// bf16 <-> float32 with round-to-nearest-even (finite inputs; the GEMM splits activations)
HIPC_DEVICE uint32_t hipc_f32_to_bf16(float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
// x = hi + lo to about 16 significant bits: hi = bf16(x), lo = bf16(x - hi) (x - hi is exact).
HIPC_DEVICE void hipc_split_bf16(float x, uint32_t& hi, uint32_t& lo) {
  hi = hipc_f32_to_bf16(x);
  lo = hipc_f32_to_bf16(x - __builtin_bit_cast(float, hi << 16));
}

#if defined(HIPC_MMA_NV)
// mma.sync.m16n8k16 bf16 -> f32 (sm_80+), operands through ldmatrix. Layouts (PTX ISA, "Matrix
// Fragments for mma.m16n8k16 with floating point type"), g = lane / 4, q = lane % 4:
//   A regs a0..a3 = (row g, k 2q..2q+1), (row g+8, k 2q..), (row g, k 2q+8..), (row g+8, k 2q+8..)
//   B regs b0, b1 = (k 2q..2q+1, col g), (k 2q+8.., col g)
//   C c0..c3      = (row g, col 2q), (row g, col 2q+1), (row g+8, col 2q), (row g+8, col 2q+1)
// ldmatrix.x4 hands lane l element pair l % 4 of row l / 4 of each 8x8 matrix, matrix j coming
// from the row addresses of lanes 8j..8j+7, so A takes its four 8x8 quadrants in the order
// above from lanes (row l % 16, k (l / 16) * 8), and B (x2) its two k halves from lanes
// (row l % 8, k ((l / 8) % 2) * 8).
#define HIPC_MMA_N 8
struct hipc_mma_a { uint32_t r[4]; };
struct hipc_mma_b { uint32_t r[2]; };
struct hipc_mma_c {
  float v[4];
  HIPC_DEVICE float& operator[](int i) { return v[i]; }
  HIPC_DEVICE float operator[](int i) const { return v[i]; }
};
HIPC_DEVICE hipc_mma_a hipc_mma_load_a(const uint16_t* s, int ld) {
  const int lane = hipc_thread() % 32;
  const uint32_t p = (uint32_t)__cvta_generic_to_shared(s + (lane % 16) * ld + (lane / 16) * 8);
  hipc_mma_a a;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a.r[0]), "=r"(a.r[1]), "=r"(a.r[2]), "=r"(a.r[3])
               : "r"(p)
               : "memory");
  return a;
}
HIPC_DEVICE hipc_mma_b hipc_mma_load_b(const uint16_t* s, int ld) {
  const int lane = hipc_thread() % 32;
  const uint32_t p = (uint32_t)__cvta_generic_to_shared(s + (lane % 8) * ld + ((lane / 8) % 2) * 8);
  hipc_mma_b b;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
               : "=r"(b.r[0]), "=r"(b.r[1])
               : "r"(p)
               : "memory");
  return b;
}
HIPC_DEVICE void hipc_mma(hipc_mma_c& c, const hipc_mma_a& a, const hipc_mma_b& b) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c.v[0]), "+f"(c.v[1]), "+f"(c.v[2]), "+f"(c.v[3])
      : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}
HIPC_DEVICE int hipc_mma_row(int lane, int i) { return lane / 4 + 8 * (i / 2); }
HIPC_DEVICE int hipc_mma_col(int lane, int i) { return 2 * (lane % 4) + i % 2; }

#elif defined(HIPC_MMA_WMMA)
// v_wmma_f32_16x16x16_bf16, wave32 (gfx11: RDNA3/3.5). Layouts (RDNA3 ISA guide; AMD's matrix
// instruction calculator; GPUOpen "How to accelerate AI applications on RDNA 3 using WMMA"):
//   A: lane l holds row l % 16, k 0..15 (16 bf16, 8 VGPRs); lanes 16..31 repeat lanes 0..15
//   B: lane l holds column l % 16, k 0..15; likewise repeated
//   C/D (8 floats): element i of lane l is (row 2i + l / 16, column l % 16)
#define HIPC_MMA_N 16
typedef short hipc_v16s __attribute__((ext_vector_type(16)));
typedef float hipc_v8f __attribute__((ext_vector_type(8)));
struct hipc_u4x2 { uint4 lo, hi; };
typedef hipc_v16s hipc_mma_a;
typedef hipc_v16s hipc_mma_b;
typedef hipc_v8f hipc_mma_c;
HIPC_DEVICE hipc_v16s hipc_mma_load_a(const uint16_t* s, int ld) {
  const uint4* p = (const uint4*)(s + (hipc_thread() % 16) * ld);
  return __builtin_bit_cast(hipc_v16s, (hipc_u4x2{p[0], p[1]}));
}
HIPC_DEVICE hipc_v16s hipc_mma_load_b(const uint16_t* s, int ld) { return hipc_mma_load_a(s, ld); }
HIPC_DEVICE void hipc_mma(hipc_mma_c& c, const hipc_mma_a& a, const hipc_mma_b& b) {
  c = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(a, b, c);
}
HIPC_DEVICE int hipc_mma_row(int lane, int i) { return 2 * i + lane / 16; }
HIPC_DEVICE int hipc_mma_col(int lane, int i) { return lane % 16; }

#elif defined(HIPC_MMA_MFMA)
// v_mfma_f32_16x16x16_bf16 (gfx942; gfx90a's v_mfma_f32_16x16x16bf16_1k), wave64. Layouts
// (CDNA3 ISA "Matrix fused multiply-add" operand layouts; AMD's matrix instruction calculator):
//   A: lane l holds row l % 16, k 4(l / 16) .. 4(l / 16) + 3 (4 bf16, 2 VGPRs)
//   B: lane l holds column l % 16, the same 4 k
//   C/D (4 floats): element i of lane l is (row 4(l / 16) + i, column l % 16)
#define HIPC_MMA_N 16
typedef short hipc_v4s __attribute__((ext_vector_type(4)));
typedef float hipc_v4f __attribute__((ext_vector_type(4)));
typedef hipc_v4s hipc_mma_a;
typedef hipc_v4s hipc_mma_b;
typedef hipc_v4f hipc_mma_c;
HIPC_DEVICE hipc_v4s hipc_mma_load_a(const uint16_t* s, int ld) {
  const int lane = hipc_thread() % 64;
  return __builtin_bit_cast(hipc_v4s, *(const uint2*)(s + (lane % 16) * ld + (lane / 16) * 4));
}
HIPC_DEVICE hipc_v4s hipc_mma_load_b(const uint16_t* s, int ld) { return hipc_mma_load_a(s, ld); }
HIPC_DEVICE void hipc_mma(hipc_mma_c& c, const hipc_mma_a& a, const hipc_mma_b& b) {
  c = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, 0, 0, 0);
}
HIPC_DEVICE int hipc_mma_row(int lane, int i) { return 4 * (lane / 16) + i; }
HIPC_DEVICE int hipc_mma_col(int lane, int i) { return lane % 16; }
#endif
