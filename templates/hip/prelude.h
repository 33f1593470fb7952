// hipc prelude: the small HIP kernel-language surface hipc's kernels use, mapped onto
//   - NVIDIA, compiled by nvcc (HIP names -> CUDA),
//   - AMD with ROCm's headers (hipcc / amdclang++, HIPC_ROCM defined),
//   - AMD with a bare `clang++ -x hip -nogpulib -nogpuinc` (clang builtins only).
// Kernels use only the hipc_* names below, so one template serves every platform.
// HIPC_WAVE (the wavefront width) is defined by the renderer before this header, and so is at
// most one of HIPC_MMA_NV / HIPC_MMA_WMMA / HIPC_MMA_WMMA12 / HIPC_MMA_MFMA: the target's matrix
// instruction, which the prefill GEMMs, the flash attention and the chunked delta rule use
// through the hipc_mma_* interface at the end (HIPC_MMA_HOST: mma.sync's, emulated for the
// host tests).
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
// ---- NVIDIA ------------------------------------------------------------------------
#define HIPC_KERNEL extern "C" __global__
#define HIPC_DEVICE __device__ __forceinline__
// n threads per block, and no occupancy target: ptxas then issues a loop's batch of loads
// before their first use instead of interleaving them with the math to save registers
#define HIPC_BOUNDS_LOADS_IN_FLIGHT(n) __launch_bounds__(n, 1)
// n threads per block and registers for b blocks per SM (a streaming kernel whose grid is
// sized for b per SM; its batches of loads are separate registers, so they stay batched)
#define HIPC_BOUNDS_BLOCKS(n, b) __launch_bounds__(n, b)
__device__ __forceinline__ int hipc_thread() { return threadIdx.x; }
__device__ __forceinline__ int hipc_block_x() { return blockIdx.x; }
__device__ __forceinline__ int hipc_block_y() { return blockIdx.y; }
__device__ __forceinline__ int hipc_block_z() { return blockIdx.z; }
__device__ __forceinline__ int hipc_block_dim() { return blockDim.x; }
__device__ __forceinline__ int hipc_grid_x() { return gridDim.x; }
__device__ __forceinline__ void hipc_sync() { __syncthreads(); }
__device__ __forceinline__ float hipc_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ float hipc_shfl(float v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }
__device__ __forceinline__ float hipc_exp(float x) { return __expf(x); }
__device__ __forceinline__ float hipc_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float hipc_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ float hipc_fmaxf(float a, float b) { return fmaxf(a, b); }
// the wave's shared-memory writes visible to its other lanes
__device__ __forceinline__ void hipc_sync_wave() { __syncwarp(); }
#define HIPC_DYNAMIC_SHARED(T, name) extern __shared__ __attribute__((aligned(16))) T name[]
// a module-scope array in device memory, zero when the module loads
#define HIPC_MODULE_ARRAY(T, name, n) __device__ T name[n]

#elif defined(HIPC_ROCM)
// ---- AMD with ROCm headers ---------------------------------------------------------
#include <hip/hip_runtime.h>
#define HIPC_BOUNDS_LOADS_IN_FLIGHT(n) __launch_bounds__(n)
#define HIPC_BOUNDS_BLOCKS(n, b) __launch_bounds__(n)
#define HIPC_KERNEL extern "C" __global__
#define HIPC_DEVICE __device__ __forceinline__
__device__ __forceinline__ int hipc_thread() { return threadIdx.x; }
__device__ __forceinline__ int hipc_block_x() { return blockIdx.x; }
__device__ __forceinline__ int hipc_block_y() { return blockIdx.y; }
__device__ __forceinline__ int hipc_block_z() { return blockIdx.z; }
__device__ __forceinline__ int hipc_block_dim() { return blockDim.x; }
__device__ __forceinline__ int hipc_grid_x() { return gridDim.x; }
__device__ __forceinline__ void hipc_sync() { __syncthreads(); }
__device__ __forceinline__ float hipc_shfl_xor(float v, int m) { return __shfl_xor(v, m, HIPC_WAVE); }
__device__ __forceinline__ float hipc_shfl(float v, int lane) { return __shfl(v, lane, HIPC_WAVE); }
__device__ __forceinline__ float hipc_exp(float x) { return __expf(x); }
__device__ __forceinline__ float hipc_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float hipc_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ float hipc_fmaxf(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ void hipc_sync_wave() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
#define HIPC_DYNAMIC_SHARED(T, name) extern __shared__ __attribute__((aligned(16))) T name[]
// a module-scope array in device memory, zero when the module loads
#define HIPC_MODULE_ARRAY(T, name, n) __device__ T name[n]

#elif defined(HIPC_HOST)
// ---- the host, one thread (tests/compiler/test_gpu_prelude_host.py only: the weight
// decoding and integer dot products checked by a plain C++ compiler, with no GPU) ----
#include <math.h>
#include <stddef.h>
#define HIPC_KERNEL extern "C"
#define HIPC_DEVICE inline
#define HIPC_BOUNDS_LOADS_IN_FLIGHT(n)
#define HIPC_BOUNDS_BLOCKS(n, b)
#define __launch_bounds__(...)
struct uint2 { uint32_t x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { uint32_t x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
#ifdef HIPC_HOST_SIMT
// a host test runs a block as threads in step (tests/compiler/test_gpu_prelude_host.py):
// a kernel's shared arrays are its function's statics, one block at a time
#define __shared__ static
int hipc_thread();
int hipc_block_dim();
int hipc_block_x();
int hipc_block_y();
int hipc_grid_x();
void hipc_sync();
void hipc_sync_wave();
float hipc_shfl_xor(float v, int m);
float hipc_shfl(float v, int lane);
// the launch's dynamic shared memory (the harness allocates it per block)
void* hipc_dynamic_shared();
#define HIPC_DYNAMIC_SHARED(T, name) T* const name = (T*)hipc_dynamic_shared()
#define HIPC_MODULE_ARRAY(T, name, n) static T name[n]
#else
#define __shared__
HIPC_DEVICE int hipc_thread() { return 0; }
HIPC_DEVICE int hipc_block_dim() { return 1; }
HIPC_DEVICE void hipc_sync() {}
HIPC_DEVICE float hipc_shfl_xor(float v, int) { return v; }
#endif
HIPC_DEVICE float hipc_exp(float x) { return expf(x); }
HIPC_DEVICE float hipc_rsqrt(float x) { return 1.f / sqrtf(x); }
HIPC_DEVICE float hipc_exp2(float x) { return exp2f(x); }
HIPC_DEVICE float hipc_fmaxf(float a, float b) { return fmaxf(a, b); }

#else
// ---- AMD, bare clang (no ROCm): attributes and builtins only -----------------------
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __launch_bounds__(n) __attribute__((amdgpu_flat_work_group_size(1, n)))
#define HIPC_BOUNDS_LOADS_IN_FLIGHT(n) __launch_bounds__(n)
#define HIPC_BOUNDS_BLOCKS(n, b) __launch_bounds__(n)
#define HIPC_KERNEL extern "C" __global__
#define HIPC_DEVICE __device__ inline __attribute__((always_inline))
HIPC_DEVICE int hipc_thread() { return __builtin_amdgcn_workitem_id_x(); }
HIPC_DEVICE int hipc_block_x() { return __builtin_amdgcn_workgroup_id_x(); }
HIPC_DEVICE int hipc_block_y() { return __builtin_amdgcn_workgroup_id_y(); }
HIPC_DEVICE int hipc_block_z() { return __builtin_amdgcn_workgroup_id_z(); }
HIPC_DEVICE int hipc_block_dim() { return __builtin_amdgcn_workgroup_size_x(); }
// blocks along x (the dispatch's grid size is in work-items; hipModuleLaunchKernel's is whole blocks)
HIPC_DEVICE int hipc_grid_x() { return __builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(); }
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
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
HIPC_DEVICE float hipc_shfl(float v, int src) {
  return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute(src << 2, __builtin_bit_cast(int, v)));
}
// NOTE: -nogpulib links no math library, so exp/rsqrt use the hardware instructions.
HIPC_DEVICE float hipc_exp(float x) { return __builtin_amdgcn_exp2f(x * 1.4426950408889634f); }
HIPC_DEVICE float hipc_rsqrt(float x) { return __builtin_amdgcn_rsqf(x); }
HIPC_DEVICE float hipc_exp2(float x) { return __builtin_amdgcn_exp2f(x); }
HIPC_DEVICE float hipc_fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
// a wave runs in lockstep; the fences keep the compiler from moving shared-memory accesses across
HIPC_DEVICE void hipc_sync_wave() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
#define HIPC_DYNAMIC_SHARED(T, name) extern __shared__ __attribute__((aligned(16))) T name[]
// a module-scope array in device memory, zero when the module loads
#define HIPC_MODULE_ARRAY(T, name, n) __device__ T name[n]
#endif

// ---- kernel overlap, L2 prefetch, cross-block hand-off ------------------------------
// Decode kernels are launched so the next one may start while this one finishes
// (programmatic dependent launch, sm_90+). A kernel touches nothing an earlier kernel
// writes before hipc_wait_prior() returns, which is when every earlier kernel has
// finished and its writes are visible; it calls hipc_let_next_start() right after, so
// at most the next kernel is resident early (prefetching its weights) while it runs.
// Elsewhere (AMD, sm_80/89) kernels run back to back and both are no-ops.
#if defined(__CUDACC__)
#ifdef HIPC_TRACE
// A timeline of the decode graph (docs/benchmarks/trace_gpu_decode.py compiles the program with
// HIPC_TRACE = records): thread 0 of each block that reaches hipc_wait_prior() takes the next
// record, in the order blocks are released, and stores globaltimer ns at its arrival and
// release, its grid's and its own index (SM in the high word); hipc_trace_end() (a
// hipc_trace_scope's end) adds when the block's last wave finished, hipc_trace_mark(k) when
// thread 0 passed mark k (0-2: a kernel's phases). Never defined by the compiler.
#define HIPC_TRACE_WORDS 8
HIPC_MODULE_ARRAY(unsigned long long, hipc_trace, HIPC_TRACE_WORDS * HIPC_TRACE);
__device__ unsigned hipc_trace_n;
HIPC_DEVICE unsigned long long hipc_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
HIPC_DEVICE unsigned* hipc_trace_slot() {
  __shared__ unsigned slot;
  return &slot;
}
#endif
HIPC_DEVICE void hipc_wait_prior() {
#ifdef HIPC_TRACE
  const unsigned long long arrived = hipc_now();
#endif
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef HIPC_TRACE
  if (threadIdx.x == 0) {
    const unsigned i = atomicAdd(&hipc_trace_n, 1u);
    *hipc_trace_slot() = i;
    if (i < HIPC_TRACE) {
      unsigned sm;
      asm("mov.u32 %0, %%smid;" : "=r"(sm));
      unsigned long long* r = hipc_trace + HIPC_TRACE_WORDS * i;
      r[0] = arrived, r[1] = hipc_now(), r[2] = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
      r[3] = ((unsigned long long)sm << 32) | ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x);
      r[4] = r[5] = r[6] = r[7] = 0;
    }
  }
  __syncthreads();
#endif
}
HIPC_DEVICE void hipc_trace_end() {
#ifdef HIPC_TRACE
  const unsigned i = *hipc_trace_slot();
  if (threadIdx.x % 32 == 0 && i < HIPC_TRACE) atomicMax(hipc_trace + HIPC_TRACE_WORDS * i + 4, hipc_now());
#endif
}
HIPC_DEVICE void hipc_trace_mark(int k) {
#ifdef HIPC_TRACE
  const unsigned i = *hipc_trace_slot();
  if (threadIdx.x == 0 && i < HIPC_TRACE) hipc_trace[HIPC_TRACE_WORDS * i + 5 + k] = hipc_now();
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
// HIPC_WEIGHT_CACHE, HIPC_WEIGHT_POLICY: the loads' cache qualifiers and L2 eviction policy
// (benchmarks: codegen/hip.py weight_cache)
#ifndef HIPC_WEIGHT_CACHE
#define HIPC_WEIGHT_CACHE ""
#endif
HIPC_DEVICE uint4 hipc_load_weights16(const void* p) {
  uint4 r;
#ifdef HIPC_WEIGHT_POLICY
  // (a 128-bit load takes an L2 priority as a policy operand only)
  uint64_t policy;
  asm("createpolicy.fractional." HIPC_WEIGHT_POLICY ".b64 %0, 1.0;" : "=l"(policy));
  asm volatile("ld.global.nc" HIPC_WEIGHT_CACHE ".v4.u32 {%0, %1, %2, %3}, [%4], %5;" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(policy));
#else
  asm volatile("ld.global.nc" HIPC_WEIGHT_CACHE ".v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
#endif
  return r;
}
// a float read where it is written in the program (not moved to its first use), so that its
// round trip overlaps what follows
HIPC_DEVICE float hipc_load_now(const float* p) {
  float r;
  asm volatile("ld.global.f32 %0, [%1];" : "=f"(r) : "l"(p));
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
HIPC_DEVICE float4 hipc_load_coherent4(const float* p) { return __ldcg((const float4*)p); }
// a shared-memory counter (histograms): no ordering with other memory
HIPC_DEVICE unsigned hipc_shared_add(unsigned* p, unsigned v) { return atomicAdd(p, v); }
#elif defined(HIPC_HOST)
HIPC_DEVICE void hipc_wait_prior() {}
HIPC_DEVICE void hipc_trace_end() {}
HIPC_DEVICE void hipc_trace_mark(int) {}
HIPC_DEVICE void hipc_let_next_start() {}
HIPC_DEVICE void hipc_prefetch_l2(const void*) {}
HIPC_DEVICE uint4 hipc_load_weights16(const void* p) { return *(const uint4*)p; }
HIPC_DEVICE float hipc_load_now(const float* p) { return *p; }
HIPC_DEVICE void hipc_publish() {}
HIPC_DEVICE unsigned hipc_count(unsigned* p) { return __atomic_fetch_add(p, 1u, __ATOMIC_ACQ_REL); }
HIPC_DEVICE float hipc_load_coherent(const float* p) { return *p; }  // host blocks run one after another
HIPC_DEVICE float4 hipc_load_coherent4(const float* p) { return *(const float4*)p; }
HIPC_DEVICE unsigned hipc_shared_add(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
#else
HIPC_DEVICE void hipc_wait_prior() {}
HIPC_DEVICE void hipc_trace_end() {}
HIPC_DEVICE void hipc_trace_mark(int) {}
HIPC_DEVICE void hipc_let_next_start() {}
HIPC_DEVICE void hipc_prefetch_l2(const void*) {}
HIPC_DEVICE uint4 hipc_load_weights16(const void* p) { return *(const uint4*)p; }
HIPC_DEVICE float hipc_load_now(const float* p) { return *p; }
// every wave makes its own stores visible device-wide (a workgroup barrier does not)
HIPC_DEVICE void hipc_publish() { __builtin_amdgcn_fence(__ATOMIC_RELEASE, "agent"); }
HIPC_DEVICE unsigned hipc_count(unsigned* p) {
  return __hip_atomic_fetch_add(p, 1u, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
}
// the acquire in hipc_count invalidated this CU's vector L1
HIPC_DEVICE float hipc_load_coherent(const float* p) { return *p; }
HIPC_DEVICE float4 hipc_load_coherent4(const float* p) { return *(const float4*)p; }
HIPC_DEVICE unsigned hipc_shared_add(unsigned* p, unsigned v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
}
#endif

// trace_gpu_decode.py's end mark, wherever a kernel returns after its wait (a no-op unless
// the program is compiled with HIPC_TRACE)
struct hipc_trace_scope {
  HIPC_DEVICE ~hipc_trace_scope() { hipc_trace_end(); }
};

// Pull `bytes` starting at p towards L2, one 128-byte line per lane and step (a wave's
// rows of weights, before waiting on the kernel before).
HIPC_DEVICE void hipc_prefetch_rows(const void* p, size_t bytes, int lane) {
  for (size_t o = (size_t)lane * 128; o < bytes; o += HIPC_WAVE * 128) hipc_prefetch_l2((const char*)p + o);
}

// ---- shared by every platform --------------------------------------------------------

#define HIPC_INF __builtin_inff()

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

// x clamped to [-c, c] (OLMoE's clip_qkv, applied as the attention kernels read q, k, v)
HIPC_DEVICE float hipc_clip(float x, float c) { return x < -c ? -c : x > c ? c : x; }

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
// Max over the block, as hipc_block_sum
HIPC_DEVICE float hipc_block_max(float v, float* red) {
  const int lane = hipc_thread() % HIPC_WAVE, wave = hipc_thread() / HIPC_WAVE;
  const int waves = hipc_block_dim() / HIPC_WAVE;
  v = hipc_warp_max(v);
  hipc_sync();
  if (lane == 0) red[wave] = v;
  hipc_sync();
  v = lane < waves ? red[lane] : -HIPC_INF;
  return hipc_warp_max(v);
}

HIPC_DEVICE float hipc_bf16_to_f32(uint16_t h) { return __builtin_bit_cast(float, (uint32_t)h << 16); }

HIPC_DEVICE float hipc_f16_to_f32(uint16_t h) {
#if defined(__CUDACC__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#elif defined(__AMDGCN__)
  return (float)__builtin_bit_cast(_Float16, h);
#else
  // IEEE half -> float, subnormals included, without a platform half type
  const uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
  if (e == 0) {
    const float f = (float)m * 5.9604644775390625e-08f;  // m * 2^-24
    return s ? -f : f;
  }
  const uint32_t bits = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112) << 23) | (m << 13));
  return __builtin_bit_cast(float, bits);
#endif
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
// (four partial sums: one chain of D dependent FMAs is the longest latency of a decode
// attention block)
HIPC_DEVICE float hipc_kv_dot_f32(const float* q, const float* k, int D) {
  float dot[4] = {0.f, 0.f, 0.f, 0.f};
  if (D % 4 == 0) {
#pragma unroll
    for (int d = 0; d < D; d += 4) {
      const float4 kv = *(const float4*)(k + d);
      dot[0] += q[d] * kv.x, dot[1] += q[d + 1] * kv.y, dot[2] += q[d + 2] * kv.z, dot[3] += q[d + 3] * kv.w;
    }
  } else {
    for (int d = 0; d < D; ++d) dot[0] += q[d] * k[d];
  }
  return (dot[0] + dot[1]) + (dot[2] + dot[3]);
}
HIPC_DEVICE float hipc_kv_dot_bf16(const float* q, const uint16_t* k, int D) {
  float dot[4] = {0.f, 0.f, 0.f, 0.f};
  if (D % 8 == 0) {
#pragma unroll
    for (int d = 0; d < D; d += 8) {
      const uint4 kv = *(const uint4*)(k + d);
      const uint32_t w[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dot[e] += q[d + 2 * e] * __builtin_bit_cast(float, w[e] << 16) +
                  q[d + 2 * e + 1] * __builtin_bit_cast(float, w[e] & 0xffff0000u);
    }
  } else {
    for (int d = 0; d < D; ++d) dot[0] += q[d] * hipc_bf16_to_f32(k[d]);
  }
  return (dot[0] + dot[1]) + (dot[2] + dot[3]);
}
// q_g . k for G queries (q: [G][D] floats in shared memory) against one cached key row, the
// row read once (batch attention: a KV head's group of query heads); k null: zeros
template <int G, int D>
HIPC_DEVICE void hipc_kv_dots_f32(const float* q, const float* k, float* out) {
  float dot[G][2] = {};
  if (k != nullptr) {
#pragma unroll 4
    for (int d = 0; d < D; d += 2) {
      const float k0 = k[d], k1 = k[d + 1];
#pragma unroll
      for (int g = 0; g < G; ++g) dot[g][0] += q[g * D + d] * k0, dot[g][1] += q[g * D + d + 1] * k1;
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) out[g] = dot[g][0] + dot[g][1];
}
template <int G, int D>
HIPC_DEVICE void hipc_kv_dots_bf16(const float* q, const uint16_t* k, float* out) {
  static_assert(D % 8 == 0, "bf16 key rows are read 8 values at a time");
  float dot[G][2] = {};
  if (k != nullptr) {
#pragma unroll
    for (int d = 0; d < D; d += 8) {
      const uint4 kv = *(const uint4*)(k + d);
      const uint32_t w[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float k0 = __builtin_bit_cast(float, w[e] << 16), k1 = __builtin_bit_cast(float, w[e] & 0xffff0000u);
#pragma unroll
        for (int g = 0; g < G; ++g) dot[g][0] += q[g * D + d + 2 * e] * k0, dot[g][1] += q[g * D + d + 2 * e + 1] * k1;
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) out[g] = dot[g][0] + dot[g][1];
}
// PER consecutive cached values from p (p is PER-element aligned): one vector load
template <int PER>
HIPC_DEVICE void hipc_kv_load_vec(const float* p, float* out) {
  if constexpr (PER == 4) {
    const float4 v = *(const float4*)p;
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  } else if constexpr (PER == 2) {
    const uint2 v = *(const uint2*)p;
    out[0] = __builtin_bit_cast(float, v.x), out[1] = __builtin_bit_cast(float, v.y);
  } else {
#pragma unroll
    for (int d = 0; d < PER; ++d) out[d] = p[d];
  }
}
template <int PER>
HIPC_DEVICE void hipc_kv_load_vec(const uint16_t* p, float* out) {
  if constexpr (PER == 4) {
    const uint2 v = *(const uint2*)p;
    out[0] = __builtin_bit_cast(float, v.x << 16), out[1] = __builtin_bit_cast(float, v.x & 0xffff0000u);
    out[2] = __builtin_bit_cast(float, v.y << 16), out[3] = __builtin_bit_cast(float, v.y & 0xffff0000u);
  } else if constexpr (PER == 2) {
    const uint32_t v = *(const uint32_t*)p;
    out[0] = __builtin_bit_cast(float, v << 16), out[1] = __builtin_bit_cast(float, v & 0xffff0000u);
  } else {
#pragma unroll
    for (int d = 0; d < PER; ++d) out[d] = hipc_bf16_to_f32(p[d]);
  }
}

// 8 consecutive cached values of a row, loaded (one 16-byte load of bf16, two of float32) and
// unpacked apart: a loop issues several rows' loads before it uses the first (the batch attention)
template <class T>
struct hipc_kv8;
template <>
struct hipc_kv8<uint16_t> {
  uint32_t w[4];
  HIPC_DEVICE void load(const uint16_t* p) {
    const uint4 v = *(const uint4*)p;
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  }
  HIPC_DEVICE void take(uint4 v) { w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w; }
  HIPC_DEVICE float get(int e) const { return __builtin_bit_cast(float, e % 2 ? w[e / 2] & 0xffff0000u : w[e / 2] << 16); }
};
// the batch attention's ring: 16 bytes global -> shared, a group of them per commit, waited for
// until at most N groups (the latest) are in flight: cp.async on NVIDIA (sm_80+), elsewhere a
// plain copy through registers (done when issued)
HIPC_DEVICE void hipc_ring_copy(uint4* dst, const void* src) {
#if defined(__CUDACC__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
#else
  *dst = *(const uint4*)src;
#endif
}
HIPC_DEVICE void hipc_ring_commit() {
#if defined(__CUDACC__)
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
HIPC_DEVICE void hipc_ring_wait() {
#if defined(__CUDACC__)
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}
template <>
struct hipc_kv8<float> {
  float w[8];
  HIPC_DEVICE void load(const float* p) {
    const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
  }
  HIPC_DEVICE float get(int e) const { return w[e]; }
};

// ---- quantized weights ----------------------------------------------------------------
// GGUF stores a matrix as rows of 32-weight blocks, each its scale(s) then its quants:
// q4_0 {f16 d; 16 bytes of nibbles} (18 bytes), q4_1 {f16 d, m; nibbles} (20), q8_0 {f16 d;
// int8 x 32} (34) -- 2-byte aligned, so a lane cannot read a block with one wide load. An
// artifact for GPU targets only stores each quantized matrix split (HIPC_QSPLIT, written by
// compiler/passes/repack.py:split_quant_blocks): the quants of every block in row order
// [rows x blocks x QB], then the scales [rows x blocks x SB]. A block's quants are then one
// aligned 16-byte load (two for q8_0) and its scales one 2- or 4-byte load. An artifact that
// also holds the cpu target keeps GGUF's order (the CPU kernels read it) and the same
// kernels read it with narrow loads.
#ifndef HIPC_QSPLIT
#define HIPC_QSPLIT 1
#endif
// Quants and scales of block `b` (counted over the whole matrix of `blocks` blocks); TYPE
// tells apart types of one layout (q4_0, iq4_nl), whose functions overload on it.
template <int QB, int SB, int TYPE = 0>
struct hipc_qmat {
  const char* base;
  size_t blocks;
  HIPC_DEVICE const char* qs(size_t b) const { return HIPC_QSPLIT ? base + b * QB : base + b * (QB + SB) + SB; }
  HIPC_DEVICE const char* sc(size_t b) const { return HIPC_QSPLIT ? base + blocks * QB + b * SB : base + b * (QB + SB); }
};
typedef hipc_qmat<16, 2> hipc_qmat_q4_0;
typedef hipc_qmat<16, 4> hipc_qmat_q4_1;
typedef hipc_qmat<32, 2> hipc_qmat_q8_0;
// IQ4_NL {f16 d; 16 bytes of nibbles} (18 bytes): Q4_0's layout, each nibble an index into a
// fixed table of 16 int8 values (hipc_iq4nl_bytes4)
typedef hipc_qmat<16, 2, 1> hipc_qmat_iq4_nl;
// Blocks of three fields (quants, then two kinds of scale), split into three regions or
// interleaved as GGUF has them (field offsets O1..O3 in a block of B bytes).
template <int B, int O1, int N1, int O2, int N2, int O3>
struct hipc_qmat3 {
  const char* base;
  size_t blocks;
  HIPC_DEVICE const char* qs(size_t b) const { return HIPC_QSPLIT ? base + b * N1 : base + b * B + O1; }
  HIPC_DEVICE const char* f2(size_t b) const { return HIPC_QSPLIT ? base + blocks * N1 + b * N2 : base + b * B + O2; }
  HIPC_DEVICE const char* f3(size_t b) const {
    return HIPC_QSPLIT ? base + blocks * (N1 + N2) + b * (B - N1 - N2) : base + b * B + O3;
  }
};
// Q5_0 {f16 d; uint32 qh (bit j: weight j's fifth bit); nibbles as Q4_0} (22 bytes), Q5_1
// {f16 d, m; qh; nibbles} (24): fields quants, qh, d (and m).
typedef hipc_qmat3<22, 6, 16, 2, 4, 0> hipc_qmat_q5_0;
typedef hipc_qmat3<24, 8, 16, 4, 4, 0> hipc_qmat_q5_1;
// Q4_K {f16 d, dmin; scales[12] (8 6-bit scales and mins); qs[128]} (144 bytes), Q5_K
// {d, dmin; scales[12]; qh[32]; qs[128]} (176): a 16-byte head {d, dmin, scales} before the
// quants (Q5_K: qh then qs). Split: every block's quants, then every block's head, so that one
// aligned 16-byte load reads a super-block's d, dmin and scales (hipc_load_kscales); fields
// quants, scales (head + 4), d + dmin (the head).
template <int B>
struct hipc_qmatk {
  const char* base;
  size_t blocks;
  HIPC_DEVICE const char* qs(size_t b) const { return HIPC_QSPLIT ? base + b * (B - 16) : base + b * B + 16; }
  HIPC_DEVICE const char* f3(size_t b) const { return HIPC_QSPLIT ? base + blocks * (B - 16) + b * 16 : base + b * B; }
  HIPC_DEVICE const char* f2(size_t b) const { return f3(b) + 4; }
};
typedef hipc_qmatk<144> hipc_qmat_q4_k;
typedef hipc_qmatk<176> hipc_qmat_q5_k;
// IQ4_XS {f16 d; u16 scales_h; u8 scales_l[4]; qs[128]} (136 bytes, 256 weights): sub-block j
// (32 weights) is IQ4_NL's nibbles at qs + 16j with the scale d * (ls - 32), ls = nibble j of
// scales_l | bits 2j, 2j + 1 of scales_h << 4; fields quants, scales_l, d + scales_h.
typedef hipc_qmat3<136, 8, 128, 4, 4, 0> hipc_qmat_iq4_xs;
// Q3_K super-blocks of 256: {hmask[32] (bit 4h + c of byte l: the third bit of weight
// 128h + 32c + l), qs[64] (2-bit lows: bits 2c.. of byte 32h + l), scales[12] (16 6-bit
// scales packed as hipc_q3scales4 reads them), f16 d} (110 bytes); fields hmask + qs (the
// quants), scales, d.
typedef hipc_qmat3<110, 0, 96, 96, 12, 108> hipc_qmat_q3_k;
// Q2_K super-blocks of 256: {scales[16] (16-group g: low nibble its scale, high its min),
// qs[64] (2-bit quants: bits 2c.. of byte 32h + l are weight 128h + 32c + l), f16 d, dmin}
// (84 bytes); fields quants, scales, d + dmin.
typedef hipc_qmat3<84, 16, 64, 0, 16, 80> hipc_qmat_q2_k;
// Q6_K super-blocks of 256: {ql[128] low nibbles, qh[64] 2-bit highs, int8 scales[16] (one
// per 16 weights), f16 d} (210 bytes); split: every ql+qh, then every scales, then every d.
struct hipc_qmat_q6_k {
  const char* base;
  size_t blocks;
  HIPC_DEVICE const char* qs(size_t b) const { return HIPC_QSPLIT ? base + b * 192 : base + b * 210; }
  HIPC_DEVICE const char* sc(size_t b) const { return HIPC_QSPLIT ? base + blocks * 192 + b * 16 : base + b * 210 + 192; }
  HIPC_DEVICE const char* d(size_t b) const { return HIPC_QSPLIT ? base + blocks * 208 + b * 2 : base + b * 210 + 208; }
};
HIPC_DEVICE uint4 hipc_load_quants16(const char* p) {
#if HIPC_QSPLIT
  return hipc_load_weights16(p);
#else
  const uint16_t* h = (const uint16_t*)p;  // GGUF order: quants start 2 bytes into a block
  uint4 r;
  r.x = h[0] | (uint32_t)h[1] << 16;
  r.y = h[2] | (uint32_t)h[3] << 16;
  r.z = h[4] | (uint32_t)h[5] << 16;
  r.w = h[6] | (uint32_t)h[7] << 16;
  return r;
#endif
}
// 16 bytes of quants from global memory (the read-only path) or, SMEM, from a stage in shared
// memory (linear_gemv_qbulk: the split layout copied there whole)
template <bool SMEM>
HIPC_DEVICE uint4 hipc_load_q16(const char* p) {
  if constexpr (SMEM) return *(const uint4*)p;
  else return hipc_load_quants16(p);
}
// 4 bytes of a block: 2-byte aligned in GGUF's order; in the split layout every field a
// kernel reads this way is 4-byte aligned (regions of 4-, 12-, 16-byte fields, 8-byte
// chunks of quants), so one load
HIPC_DEVICE uint32_t hipc_load_u32(const char* p) {
#if HIPC_QSPLIT
#ifdef HIPC_HOST
  if ((size_t)p % 4) __builtin_trap();  // the host tests hold the layout to it
#endif
  return *(const uint32_t*)p;
#else
  return ((const uint16_t*)p)[0] | (uint32_t)((const uint16_t*)p)[1] << 16;
#endif
}

// the 8 int8 scales of half a Q6_K super-block as 2 words: split, one 8-byte load (the scales
// region is 16 bytes a block); GGUF's order, 2-byte aligned
HIPC_DEVICE void hipc_load_q6scales(uint32_t* sc, const char* p) {
#if HIPC_QSPLIT
#ifdef HIPC_HOST
  if ((size_t)p % 8) __builtin_trap();  // the host tests hold the layout to it
#endif
  const uint2 v = *(const uint2*)p;
  sc[0] = v.x, sc[1] = v.y;
#else
  const uint16_t* h = (const uint16_t*)p;
  sc[0] = h[0] | (uint32_t)h[1] << 16;
  sc[1] = h[2] | (uint32_t)h[3] << 16;
#endif
}
// One weight W[n, k] of an [N, K] matrix in its storage type (GEMM tiles, embedding rows).
HIPC_DEVICE float hipc_w_f32(const void* W, int, int K, int n, int k) { return ((const float*)W)[(size_t)n * K + k]; }
HIPC_DEVICE float hipc_w_bf16(const void* W, int, int K, int n, int k) {
  return hipc_bf16_to_f32(((const uint16_t*)W)[(size_t)n * K + k]);
}
HIPC_DEVICE float hipc_w_f16(const void* W, int, int K, int n, int k) {
  return hipc_f16_to_f32(((const uint16_t*)W)[(size_t)n * K + k]);
}
HIPC_DEVICE float hipc_w_q8_0(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_q8_0 m{(const char*)W, (size_t)N * (K / 32)};
  const size_t b = (size_t)n * (K / 32) + k / 32;
  return hipc_f16_to_f32(*(const uint16_t*)m.sc(b)) * (float)((const int8_t*)m.qs(b))[k % 32];
}
// element j < 16 of a 4-bit block is the low nibble of byte j, element j >= 16 the high one of j - 16
HIPC_DEVICE int hipc_nibble(const char* qs, int j) {
  const uint8_t v = (uint8_t)qs[j % 16];
  return j < 16 ? v & 15 : v >> 4;
}
HIPC_DEVICE float hipc_w_q4_0(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_q4_0 m{(const char*)W, (size_t)N * (K / 32)};
  const size_t b = (size_t)n * (K / 32) + k / 32;
  return hipc_f16_to_f32(*(const uint16_t*)m.sc(b)) * (float)(hipc_nibble(m.qs(b), k % 32) - 8);
}
// IQ4_NL's values -127 -104 -83 -65 -49 -35 -22 -10 1 13 25 38 53 69 89 113 (llama.cpp's
// kvalues_iq4nl) as the bytes of 4 words, and 4 indices (the bytes of v, each 0..15) to
// their values: two byte permutes and a select on NVIDIA, byte by byte elsewhere
#define HIPC_IQ4NL_W0 0xBFAD9881u
#define HIPC_IQ4NL_W1 0xF6EADDCFu
#define HIPC_IQ4NL_W2 0x26190D01u
#define HIPC_IQ4NL_W3 0x71594535u
HIPC_DEVICE uint32_t hipc_iq4nl_bytes4(uint32_t v) {
#if defined(__CUDACC__)
  const uint32_t s = v | v >> 4;
  const uint32_t sel = ((s & 0xffu) | ((s >> 8) & 0xff00u)) & 0x7777u;  // index & 7, a nibble each
  const uint32_t lo = __byte_perm(HIPC_IQ4NL_W0, HIPC_IQ4NL_W1, sel), hi = __byte_perm(HIPC_IQ4NL_W2, HIPC_IQ4NL_W3, sel);
  const uint32_t upper = ((v >> 3) & 0x01010101u) * 0xffu;  // the bytes whose index is 8..15
  return (hi & upper) | (lo & ~upper);
#else
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = (v >> (8 * i)) & 15;
    const uint32_t w = n < 4 ? HIPC_IQ4NL_W0 : n < 8 ? HIPC_IQ4NL_W1 : n < 12 ? HIPC_IQ4NL_W2 : HIPC_IQ4NL_W3;
    out |= ((w >> (8 * (n & 3))) & 255) << (8 * i);
  }
  return out;
#endif
}
HIPC_DEVICE float hipc_w_iq4_nl(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_iq4_nl m{(const char*)W, (size_t)N * (K / 32)};
  const size_t b = (size_t)n * (K / 32) + k / 32;
  const int8_t v = (int8_t)hipc_iq4nl_bytes4((uint32_t)hipc_nibble(m.qs(b), k % 32));
  return hipc_f16_to_f32(*(const uint16_t*)m.sc(b)) * (float)v;
}
HIPC_DEVICE float hipc_w_q4_1(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_q4_1 m{(const char*)W, (size_t)N * (K / 32)};
  const size_t b = (size_t)n * (K / 32) + k / 32;
  const uint16_t* s = (const uint16_t*)m.sc(b);
  return hipc_f16_to_f32(s[0]) * (float)hipc_nibble(m.qs(b), k % 32) + hipc_f16_to_f32(s[1]);
}
// Q6_K weight j of a super-block: half h = j / 128; chunk c = (j % 128) / 32 takes the low
// (c < 2) or high nibble of ql[64h + 32(c % 2) + l] and bits 2c.. of qh[32h + l], l = j % 32;
// its scale is scales[8h + 2c + l / 16]; the weight is d * scale * (q - 32).
HIPC_DEVICE float hipc_w_q6_k(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_q6_k m{(const char*)W, (size_t)N * (K / 256)};
  const size_t b = (size_t)n * (K / 256) + k / 256;
  const int j = k % 256, h = j / 128, c = (j % 128) / 32, l = j % 32;
  const uint8_t* q = (const uint8_t*)m.qs(b);
  const int lo = (q[64 * h + 32 * (c % 2) + l] >> (4 * (c / 2))) & 15;
  const int hi = (q[128 + 32 * h + l] >> (2 * c)) & 3;
  const int sc = ((const int8_t*)m.sc(b))[8 * h + 2 * c + l / 16];
  return hipc_f16_to_f32(*(const uint16_t*)m.d(b)) * (float)sc * (float)((lo | hi << 4) - 32);
}
HIPC_DEVICE int hipc_qh_bit(const char* qh, int j) {
  return (((const uint16_t*)qh)[j / 16] >> (j % 16)) & 1;  // 2-byte loads: GGUF's qh is 2-aligned
}
HIPC_DEVICE float hipc_w_q5_0(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_q5_0 m{(const char*)W, (size_t)N * (K / 32)};
  const size_t b = (size_t)n * (K / 32) + k / 32;
  const int q = hipc_nibble(m.qs(b), k % 32) | hipc_qh_bit(m.f2(b), k % 32) << 4;
  return hipc_f16_to_f32(*(const uint16_t*)m.f3(b)) * (float)(q - 16);
}
HIPC_DEVICE float hipc_w_q5_1(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_q5_1 m{(const char*)W, (size_t)N * (K / 32)};
  const size_t b = (size_t)n * (K / 32) + k / 32;
  const int q = hipc_nibble(m.qs(b), k % 32) | hipc_qh_bit(m.f2(b), k % 32) << 4;
  const uint16_t* dm = (const uint16_t*)m.f3(b);
  return hipc_f16_to_f32(dm[0]) * (float)q + hipc_f16_to_f32(dm[1]);
}
// a K-quant's 12 scale bytes at p as 3 words
HIPC_DEVICE void hipc_load_u32x3(uint32_t* w, const char* p) {
#pragma unroll
  for (int j = 0; j < 3; ++j) w[j] = hipc_load_u32(p + 4 * j);
}
// byte i of 12 held as 3 words (no indexed local array)
HIPC_DEVICE int hipc_byte12(const uint32_t* w, int i) {
  return (int)(((i < 4 ? w[0] : i < 8 ? w[1] : w[2]) >> (8 * (i & 3))) & 255);
}
// K-quant sub-block j's 6-bit scale and min from the 12 scale bytes held as 3 words (ggml's
// get_scale_min_k4)
HIPC_DEVICE void hipc_kscale_w(const uint32_t* w, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = hipc_byte12(w, j) & 63;
    mn = hipc_byte12(w, j + 4) & 63;
  } else {
    sc = (hipc_byte12(w, j + 4) & 15) | ((hipc_byte12(w, j - 4) >> 6) << 4);
    mn = (hipc_byte12(w, j + 4) >> 4) | ((hipc_byte12(w, j) >> 6) << 4);
  }
}
// ... from the 12 scale bytes at p
HIPC_DEVICE void hipc_kscale_at(const char* p, int j, int& sc, int& mn) {
  uint32_t w[3];
  hipc_load_u32x3(w, p);
  hipc_kscale_w(w, j, sc, mn);
}
// Q4_K/Q5_K weight j of a super-block: sub-block s = j / 32 takes the low (s even) or high
// nibble of qs[32 (s / 2) + j % 32] (Q5_K: plus bit s of qh[j % 32] as 16); the weight is
// d * scale(s) * q - dmin * min(s).
HIPC_DEVICE float hipc_w_q4_k(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_q4_k m{(const char*)W, (size_t)N * (K / 256)};
  const size_t b = (size_t)n * (K / 256) + k / 256;
  const int j = k % 256, sb = j / 32, l = j % 32;
  const int q = (((const uint8_t*)m.qs(b))[32 * (sb / 2) + l] >> (4 * (sb % 2))) & 15;
  int sc, mn;
  hipc_kscale_at(m.f2(b), sb, sc, mn);
  const uint16_t* dd = (const uint16_t*)m.f3(b);
  return hipc_f16_to_f32(dd[0]) * (float)(sc * q) - hipc_f16_to_f32(dd[1]) * (float)mn;
}
HIPC_DEVICE float hipc_w_q5_k(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_q5_k m{(const char*)W, (size_t)N * (K / 256)};
  const size_t b = (size_t)n * (K / 256) + k / 256;
  const int j = k % 256, sb = j / 32, l = j % 32;
  const uint8_t* q = (const uint8_t*)m.qs(b);  // qh[32], then qs[128]
  const int v = ((q[32 + 32 * (sb / 2) + l] >> (4 * (sb % 2))) & 15) | ((q[l] >> sb) & 1) << 4;
  int sc, mn;
  hipc_kscale_at(m.f2(b), sb, sc, mn);
  const uint16_t* dd = (const uint16_t*)m.f3(b);
  return hipc_f16_to_f32(dd[0]) * (float)(sc * v) - hipc_f16_to_f32(dd[1]) * (float)mn;
}

// The quantized GEMV multiplies integers: x is staged in shared memory per 32-value block,
// rounded on the block's scale d = max|x| / 127 to int8 q (hi). With int16 activations
// (LO, the default) the remainder is rounded on a 254x finer scale to a second int8 plane
// (lo): x ~= dq * (254 * hi + lo) with dq = d / 254, at most max|x| / 64516 off per value
// (about 16 significant bits, the class of a bf16 hi + lo split). With int8 activations
// (--activations int8, llama.cpp's q8_1 numerics) x ~= d * hi: half the dot products and
// half the shared-memory reads, at most max|x| / 254 off per value. Every product sums
// exactly in int32 (dp4a).
// One staged block: hi[32] (and lo[32]) as int8, then meta = {dq or d (float bits), the
// block's sum of 254 * hi + lo (or of hi), that sum over its first 16 values, 0}: 80 (48)
// bytes, so that 8 lanes reading 8 consecutive blocks with 16-byte loads hit distinct banks.
template <bool LO>
struct hipc_xq {
  static constexpr int INTS = LO ? 20 : 12;  // ints per staged block
  static constexpr int META = LO ? 16 : 8;   // the meta int4's first int
};
// the first int of staged block `blk` (padded: hipc_xqs below)
template <bool LO>
HIPC_DEVICE int hipc_xq_at(int blk, bool padded) {
  return blk * hipc_xq<LO>::INTS + (padded ? 4 * (blk >> 3) : 0);
}
// 4 int8 products summed into c: __dp4a on NVIDIA, v_dot4 on AMD where the arch has it.
HIPC_DEVICE int hipc_dot4_i8(int a, int b, int c) {
#if defined(__CUDACC__)
  // CUDA's __dp4a is `asm volatile`, which the compiler treats as a side effect: no load from
  // shared memory was merged across one, so a GEMV of R rows loaded each staged x block R
  // times (PTX of linear_gemv_q). The instruction is pure: plain asm lets those loads merge.
  int r;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#elif defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
  return __builtin_amdgcn_sdot4(a, b, c, false);
#elif defined(__gfx1100__) || defined(__gfx1101__) || defined(__gfx1102__) || defined(__gfx1150__) || \
    defined(__gfx1151__) || defined(__gfx1200__) || defined(__gfx1201__)
  return __builtin_amdgcn_sudot4(true, a, true, b, c, false);
#else
#pragma unroll
  for (int i = 0; i < 32; i += 8) c += (int)(int8_t)(a >> i) * (int)(int8_t)(b >> i);
  return c;
#endif
}
HIPC_DEVICE float hipc_rint(float v) {
#if defined(__CUDACC__) || defined(HIPC_ROCM)
  return rintf(v);
#else
  return __builtin_rintf(v);
#endif
}
HIPC_DEVICE float hipc_fmax(float a, float b) { return a > b ? a : b; }
HIPC_DEVICE float hipc_fabs(float a) { return a < 0.f ? -a : a; }
HIPC_DEVICE int hipc_pack4_i8(float a, float b, float c, float d) {
  return ((int)a & 255) | ((int)b & 255) << 8 | ((int)c & 255) << 16 | (int)d << 24;
}
// Stage x[0..K) (times g[k] when g is given) into xq (K / 32 blocks of hipc_xq<LO>::INTS
// ints) and return sum_k x[k]^2 to every thread: the RMSNorm's 1 / rms is one positive
// factor common to every product, so a norm GEMV quantizes x * g and scales its sums at
// the end, and the whole prologue is one pass over x and one barrier. Every thread of the
// block calls it; 8 lanes share a 32-value block, 4 values each, ROUNDS = ceil(K / 4 /
// threads) rounds. The loads of CHUNK rounds are issued before any is used: x was
// just written by the kernel before, and one L2 round trip per round was most of a
// long-row GEMV's prologue. `red`: __shared__ float[32].
// `issued()` runs once the first CHUNK rounds' loads are issued (a GEMV's L2 prefetches of its
// next weights: behind x's loads, not ahead of them).
#define HIPC_XQ_CHUNK 4
struct hipc_nothing {
  HIPC_DEVICE void operator()() const {}
};
template <bool LO, int ROUNDS, int CHUNK = HIPC_XQ_CHUNK, bool PAD = false, typename F = hipc_nothing>
HIPC_DEVICE float hipc_stage_xq(const float* x, const float* g, int K, int* xq, float* red, F issued = {}) {
  const int n4 = K / 4, stride = hipc_block_dim();
  float ss = 0.f;
  for (int r0 = 0; r0 < ROUNDS; r0 += CHUNK) {
    float4 vs[CHUNK], gs[CHUNK];
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      const int i = (r0 + c) * stride + hipc_thread();
      const bool ok = r0 + c < ROUNDS && i < n4;
      vs[c] = ok ? *(const float4*)(x + 4 * i) : float4{0.f, 0.f, 0.f, 0.f};
      gs[c] = g && ok ? *(const float4*)(g + 4 * i) : float4{1.f, 1.f, 1.f, 1.f};
    }
    if (r0 == 0) issued();
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      if (r0 + c >= ROUNDS) break;  // the same for every lane: the shuffles need whole waves
      const int i = (r0 + c) * stride + hipc_thread(), part = i % 8;
      const bool ok = i < n4;  // the same for all 8 lanes of a block (K % 32 == 0)
      float4 v = vs[c];
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      v.x *= gs[c].x, v.y *= gs[c].y, v.z *= gs[c].z, v.w *= gs[c].w;
      float am = hipc_fmax(hipc_fmax(hipc_fabs(v.x), hipc_fabs(v.y)), hipc_fmax(hipc_fabs(v.z), hipc_fabs(v.w)));
      am = hipc_fmax(am, hipc_shfl_xor(am, 1));
      am = hipc_fmax(am, hipc_shfl_xor(am, 2));
      am = hipc_fmax(am, hipc_shfl_xor(am, 4));
      const float d = am / 127.f, id = am > 0.f ? 127.f / am : 0.f;
      const float xs[4] = {v.x, v.y, v.z, v.w};
      float hi[4], lo[4];
      int sum = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        hi[e] = hipc_rint(xs[e] * id);
        if constexpr (LO) {
          lo[e] = -hipc_fmax(-hipc_fmax(hipc_rint((xs[e] - hi[e] * d) * id * 254.f), -127.f), -127.f);
          sum += 254 * (int)hi[e] + (int)lo[e];
        } else {
          sum += (int)hi[e];
        }
      }
      sum += __builtin_bit_cast(int, hipc_shfl_xor(__builtin_bit_cast(float, sum), 1));
      sum += __builtin_bit_cast(int, hipc_shfl_xor(__builtin_bit_cast(float, sum), 2));
      const int sum16 = sum;  // lanes 0..3 of the 8: the block's first 16 values
      sum += __builtin_bit_cast(int, hipc_shfl_xor(__builtin_bit_cast(float, sum), 4));
      if (ok) {
        int* blk = xq + hipc_xq_at<LO>(i / 8, PAD);
        blk[part] = hipc_pack4_i8(hi[0], hi[1], hi[2], hi[3]);
        if constexpr (LO) blk[8 + part] = hipc_pack4_i8(lo[0], lo[1], lo[2], lo[3]);
        if (part == 0) {
          int* meta = blk + hipc_xq<LO>::META;
          meta[0] = __builtin_bit_cast(int, LO ? d / 254.f : d);
          meta[1] = sum;
          meta[2] = sum16;
        }
      }
    }
  }
  ss = hipc_warp_sum(ss);
  if (hipc_thread() % HIPC_WAVE == 0) red[hipc_thread() / HIPC_WAVE] = ss;
  hipc_sync();
  ss = 0.f;
  for (int w = 0; w < hipc_block_dim() / HIPC_WAVE; ++w) ss += red[w];
  return ss;
}
// One staged x block in registers: hi (and lo) as 8 words of 4 int8 each, and its meta
// (without LO, L is never touched and takes no registers).
template <bool LO>
struct hipc_xb {
  int H[8], L[8];
  int4 meta;
  HIPC_DEVICE float scale() const { return __builtin_bit_cast(float, meta.x); }
};
// Staged x with 16 bytes of padding after every 8 blocks (hipc_stage_xq<..., true>): a lane
// whose unit is 128 weights reads blocks 4l .. 4l + 3, and without the padding lanes l and
// l + 2 of 8 would read the same banks (blocks 4 apart are 192 or 320 bytes apart: a
// multiple of 64), 4 times the wavefronts of a conflict-free 16-byte load; with it, 8 lanes
// hit 8 distinct 16-byte bank groups, and 8 lanes reading 8 consecutive blocks still do.
struct hipc_xqs {
  const int* p;
};
template <bool LO>
HIPC_DEVICE hipc_xb<LO> hipc_load_xb(hipc_xqs xq, int blk);
template <bool LO>
HIPC_DEVICE hipc_xb<LO> hipc_load_xb(const int* xq, int blk) {
  const int4* p = (const int4*)(xq + hipc_xq_at<LO>(blk, false));
  hipc_xb<LO> r;
  const int4 h0 = p[0], h1 = p[1];
  r.H[0] = h0.x, r.H[1] = h0.y, r.H[2] = h0.z, r.H[3] = h0.w;
  r.H[4] = h1.x, r.H[5] = h1.y, r.H[6] = h1.z, r.H[7] = h1.w;
  if constexpr (LO) {
    const int4 l0 = p[2], l1 = p[3];
    r.L[0] = l0.x, r.L[1] = l0.y, r.L[2] = l0.z, r.L[3] = l0.w;
    r.L[4] = l1.x, r.L[5] = l1.y, r.L[6] = l1.z, r.L[7] = l1.w;
  }
  r.meta = p[hipc_xq<LO>::META / 4];
  return r;
}
template <bool LO>
HIPC_DEVICE hipc_xb<LO> hipc_load_xb(hipc_xqs xq, int blk) {
  const int4* p = (const int4*)(xq.p + hipc_xq_at<LO>(blk, true));
  hipc_xb<LO> r;
  const int4 h0 = p[0], h1 = p[1];
  r.H[0] = h0.x, r.H[1] = h0.y, r.H[2] = h0.z, r.H[3] = h0.w;
  r.H[4] = h1.x, r.H[5] = h1.y, r.H[6] = h1.z, r.H[7] = h1.w;
  if constexpr (LO) {
    const int4 l0 = p[2], l1 = p[3];
    r.L[0] = l0.x, r.L[1] = l0.y, r.L[2] = l0.z, r.L[3] = l0.w;
    r.L[4] = l1.x, r.L[5] = l1.y, r.L[6] = l1.z, r.L[7] = l1.w;
  }
  r.meta = p[hipc_xq<LO>::META / 4];
  return r;
}
// sum_k q[k] * x[k] over words w0 .. w0 + n of a staged block (x in units of dq / d), the
// quants as words of 4 signed bytes: 254 * (q . hi) + q . lo, or q . hi.
template <bool LO, int N>
HIPC_DEVICE int hipc_idot_words(const int* q, const hipc_xb<LO>& x, int w0) {
  int sh = 0, sl = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    sh = hipc_dot4_i8(q[i], x.H[w0 + i], sh);
    if constexpr (LO) sl = hipc_dot4_i8(q[i], x.L[w0 + i], sl);
  }
  return LO ? 254 * sh + sl : sh;
}
// One 32-weight block of a row against a staged x block: the exact integer sum_k q[k] x[k]
// of its unsigned 4-bit quants (nibbles 0..15 are the same as signed bytes, so the signed
// dot product serves). Byte j holds weight j (low nibble) and weight j + 16 (high).
template <bool LO>
HIPC_DEVICE int hipc_idot_q4(uint4 q, const hipc_xb<LO>& x) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  int b[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    b[i] = (int)(w[i] & 0x0f0f0f0fu);
    b[4 + i] = (int)((w[i] >> 4) & 0x0f0f0f0fu);
  }
  return hipc_idot_words<LO, 8>(b, x, 0);
}
template <bool LO>
HIPC_DEVICE int hipc_idot_q8(uint4 qa, uint4 qb, const hipc_xb<LO>& x) {
  const int w[8] = {(int)qa.x, (int)qa.y, (int)qa.z, (int)qa.w, (int)qb.x, (int)qb.y, (int)qb.z, (int)qb.w};
  return hipc_idot_words<LO, 8>(w, x, 0);
}

// ---- GEMV units: what a lane loads and multiplies per step and row ---------------------
// A unit is one 32-weight block (q4_0, q4_1, q8_0) or half a Q6_K super-block (128
// weights). hipc_load_unit reads unit `u` of the matrix (counted over all rows);
// hipc_dot_unit<LO> multiplies it with the staged x of the row's unit `i` (x blocks
// i * values / 32 ...).
struct hipc_unit_q4_0 { uint4 q; uint16_t d; };
struct hipc_unit_q4_1 { uint4 q; uint32_t dm; };
struct hipc_unit_q8_0 { uint4 qa, qb; uint16_t d; };
struct hipc_unit_iq4_nl { uint4 q; uint16_t d; };
struct hipc_unit_q6_k { uint4 ql[4], qh[2]; uint32_t sc[2]; uint16_t d; };
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q4_0& v, const hipc_qmat_q4_0& m, size_t u) {
  v.q = hipc_load_q16<SMEM>(m.qs(u));
  v.d = *(const uint16_t*)m.sc(u);
}
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_iq4_nl& v, const hipc_qmat_iq4_nl& m, size_t u) {
  v.q = hipc_load_q16<SMEM>(m.qs(u));
  v.d = *(const uint16_t*)m.sc(u);
}
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q4_1& v, const hipc_qmat_q4_1& m, size_t u) {
  v.q = hipc_load_q16<SMEM>(m.qs(u));
  v.dm = hipc_load_u32(m.sc(u));  // the scale pair (d, m): d low, m high
}
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q8_0& v, const hipc_qmat_q8_0& m, size_t u) {
  v.qa = hipc_load_q16<SMEM>(m.qs(u));
  v.qb = hipc_load_q16<SMEM>(m.qs(u) + 16);
  v.d = *(const uint16_t*)m.sc(u);
}
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q6_k& v, const hipc_qmat_q6_k& m, size_t u) {
  const size_t b = u / 2;
  const int h = (int)(u % 2);
  const char* q = m.qs(b);
#pragma unroll
  for (int j = 0; j < 4; ++j) v.ql[j] = hipc_load_q16<SMEM>(q + 64 * h + 16 * j);
#pragma unroll
  for (int j = 0; j < 2; ++j) v.qh[j] = hipc_load_q16<SMEM>(q + 128 + 32 * h + 16 * j);
  hipc_load_q6scales(v.sc, m.sc(b) + 8 * h);
  v.d = *(const uint16_t*)m.d(b);
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q4_0& v, XP xq, int i) {
  const hipc_xb<LO> x = hipc_load_xb<LO>(xq, i);
  // quants are stored + 8: subtract 8 * sum(x) in integers
  const int t = hipc_idot_q4<LO>(v.q, x) - 8 * x.meta.y;
  return hipc_f16_to_f32(v.d) * x.scale() * (float)t;
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q4_1& v, XP xq, int i) {
  const hipc_xb<LO> x = hipc_load_xb<LO>(xq, i);
  const float t = (float)hipc_idot_q4<LO>(v.q, x);
  // w = d * q + m: d * sum(q x) + m * sum(x)
  return x.scale() * (hipc_f16_to_f32((uint16_t)v.dm) * t + hipc_f16_to_f32((uint16_t)(v.dm >> 16)) * (float)x.meta.y);
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_iq4_nl& v, XP xq, int i) {
  const hipc_xb<LO> x = hipc_load_xb<LO>(xq, i);
  const uint32_t w[4] = {v.q.x, v.q.y, v.q.z, v.q.w};
  int b[8];  // the table's signed values in place of Q4_0's nibbles
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    b[j] = (int)hipc_iq4nl_bytes4(w[j] & 0x0f0f0f0fu);
    b[4 + j] = (int)hipc_iq4nl_bytes4((w[j] >> 4) & 0x0f0f0f0fu);
  }
  return hipc_f16_to_f32(v.d) * x.scale() * (float)hipc_idot_words<LO, 8>(b, x, 0);
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q8_0& v, XP xq, int i) {
  const hipc_xb<LO> x = hipc_load_xb<LO>(xq, i);
  return hipc_f16_to_f32(v.d) * x.scale() * (float)hipc_idot_q8<LO>(v.qa, v.qb, x);
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q6_k& v, XP xq, int i) {
  const uint32_t QL[16] = {v.ql[0].x, v.ql[0].y, v.ql[0].z, v.ql[0].w, v.ql[1].x, v.ql[1].y, v.ql[1].z, v.ql[1].w,
                           v.ql[2].x, v.ql[2].y, v.ql[2].z, v.ql[2].w, v.ql[3].x, v.ql[3].y, v.ql[3].z, v.ql[3].w};
  const uint32_t QH[8] = {v.qh[0].x, v.qh[0].y, v.qh[0].z, v.qh[0].w, v.qh[1].x, v.qh[1].y, v.qh[1].z, v.qh[1].w};
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < 4; ++c) {  // the 32 weights of x block 4i + c (hipc_w_q6_k's chunk c)
    const hipc_xb<LO> x = hipc_load_xb<LO>(xq, 4 * i + c);
    int q[8];
#pragma unroll
    for (int w = 0; w < 8; ++w)  // 4 quants 0..63 as bytes (signed bytes alike), one per weight
      q[w] = (int)(((QL[8 * (c % 2) + w] >> (4 * (c / 2))) & 0x0f0f0f0fu) | (((QH[w] >> (2 * c)) & 0x03030303u) << 4));
    // q - 32: subtract 32 * sum(x) over each 16 (exact in float: |t| < 2^24)
    const int t0 = hipc_idot_words<LO, 4>(q, x, 0) - 32 * x.meta.z;
    const int t1 = hipc_idot_words<LO, 4>(q + 4, x, 4) - 32 * (x.meta.y - x.meta.z);
    const float s0 = (float)(int8_t)(v.sc[c / 2] >> (16 * (c % 2))), s1 = (float)(int8_t)(v.sc[c / 2] >> (16 * (c % 2) + 8));
    acc += x.scale() * (s0 * (float)t0 + s1 * (float)t1);
  }
  return hipc_f16_to_f32(v.d) * acc;
}
// Q5_0 / Q5_1: a 32-weight block; qh's 32 bits become bit 4 of each quant byte.
struct hipc_unit_q5_0 { uint4 q; uint32_t qh; uint16_t d; };
struct hipc_unit_q5_1 { uint4 q; uint32_t qh, dm; };
// IQ4_XS sub-block j's 6-bit scale from scales_l (a word) and scales_h
HIPC_DEVICE int hipc_iq4xs_ls(uint32_t sl, uint32_t sh, int j) {
  return (int)((sl >> (4 * j)) & 15) | (int)(((sh >> (2 * j)) & 3) << 4);
}
HIPC_DEVICE float hipc_w_iq4_xs(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_iq4_xs m{(const char*)W, (size_t)N * (K / 256)};
  const size_t b = (size_t)n * (K / 256) + k / 256;
  const int j = k % 256, ib = j / 32;
  const uint32_t dh = hipc_load_u32(m.f3(b));
  const int ls = hipc_iq4xs_ls(hipc_load_u32(m.f2(b)), dh >> 16, ib);
  const int8_t v = (int8_t)hipc_iq4nl_bytes4((uint32_t)hipc_nibble(m.qs(b) + 16 * ib, j % 32));
  return hipc_f16_to_f32((uint16_t)dh) * (float)(ls - 32) * (float)v;
}
// Q3_K's 16 6-bit scales as the bytes of 4 words (ggml's packing): word j's low 4 bits are
// the nibbles (low for j < 2, high after) of word j % 2 of the 12 scale bytes, its top 2 bits
// bits 2j.. of each byte of word 2. Scale i is byte i % 4 of word i / 4, stored + 32. A select,
// not w[j % 2]: an index the compiler cannot fold puts the caller's words (a GEMV unit in
// its ring) in local memory.
HIPC_DEVICE uint32_t hipc_q3scales4(const uint32_t* w, int j) {
  const uint32_t nib = (j & 1) ? w[1] : w[0];
  return ((nib >> (4 * (j >> 1))) & 0x0f0f0f0fu) | (((w[2] >> (2 * j)) & 0x03030303u) << 4);
}
// Q3_K scale i of a super-block, minus its offset of 32, from the 12 scale bytes at p
HIPC_DEVICE int hipc_q3scale(const char* p, int i) {
  uint32_t w[3];
  hipc_load_u32x3(w, p);
  return (int)((hipc_q3scales4(w, i / 4) >> (8 * (i % 4))) & 63) - 32;
}
// Q3_K weight j of a super-block: half h = j / 128, chunk c = (j % 128) / 32, l = j % 32: bits
// 2c.. of qs[32h + l] and, as 4, bit 4h + c of hmask[l] (clear: the weight is 4 lower); its
// scale is scale 8h + 2c + l / 16: w = d * scale * (q - 4), d * scale first as gguf-py does.
HIPC_DEVICE float hipc_w_q3_k(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_q3_k m{(const char*)W, (size_t)N * (K / 256)};
  const size_t b = (size_t)n * (K / 256) + k / 256;
  const int j = k % 256, h = j / 128, c = (j % 128) / 32, l = j % 32;
  const uint8_t* q = (const uint8_t*)m.qs(b);  // hmask[32], then qs[64]
  const int v = ((q[32 + 32 * h + l] >> (2 * c)) & 3) | ((q[l] >> (4 * h + c)) & 1) << 2;
  const float ds = hipc_f16_to_f32(*(const uint16_t*)m.f3(b)) * (float)hipc_q3scale(m.f2(b), 8 * h + 2 * c + l / 16);
  return ds * (float)(v - 4);
}
// Q2_K 16-group g of super-block b: w = s * q + o with s = d * sc, o = -(dmin * mn), as
// gguf-py rounds them
HIPC_DEVICE void hipc_q2_k_group(const hipc_qmat_q2_k& m, size_t b, int g, float& s, float& o) {
  const int sc = ((const uint8_t*)m.f2(b))[g];
  const uint32_t dm = hipc_load_u32(m.f3(b));
  s = hipc_f16_to_f32((uint16_t)dm) * (float)(sc & 15), o = -(hipc_f16_to_f32((uint16_t)(dm >> 16)) * (float)(sc >> 4));
}
// Q2_K weight j of a super-block (h = j / 128, c = (j % 128) / 32, l = j % 32): bits 2c.. of
// qs[32h + l] under 16-group 8h + 2c + l / 16's scale and min
HIPC_DEVICE float hipc_w_q2_k(const void* W, int N, int K, int n, int k) {
  const hipc_qmat_q2_k m{(const char*)W, (size_t)N * (K / 256)};
  const size_t b = (size_t)n * (K / 256) + k / 256;
  const int j = k % 256, h = j / 128, c = (j % 128) / 32, l = j % 32;
  const int q = (((const uint8_t*)m.qs(b))[32 * h + l] >> (2 * c)) & 3;
  float s, o;
  hipc_q2_k_group(m, b, 8 * h + 2 * c + l / 16, s, o);
  return s * (float)q + o;
}
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q5_0& v, const hipc_qmat_q5_0& m, size_t u) {
  v.q = hipc_load_q16<SMEM>(m.qs(u));
  v.qh = hipc_load_u32(m.f2(u));
  v.d = *(const uint16_t*)m.f3(u);
}
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q5_1& v, const hipc_qmat_q5_1& m, size_t u) {
  v.q = hipc_load_q16<SMEM>(m.qs(u));
  v.qh = hipc_load_u32(m.f2(u));
  v.dm = hipc_load_u32(m.f3(u));
}
// bits 0..3 of b to bit 4 of bytes 0..3
HIPC_DEVICE uint32_t hipc_bits_to_bytes4(uint32_t b) { return ((b * 0x00204081u) & 0x01010101u) << 4; }
template <bool LO>
HIPC_DEVICE int hipc_idot_q5(uint4 q, uint32_t qh, const hipc_xb<LO>& x) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  int b[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    b[i] = (int)((w[i] & 0x0f0f0f0fu) | hipc_bits_to_bytes4((qh >> (4 * i)) & 15));
    b[4 + i] = (int)(((w[i] >> 4) & 0x0f0f0f0fu) | hipc_bits_to_bytes4((qh >> (16 + 4 * i)) & 15));
  }
  return hipc_idot_words<LO, 8>(b, x, 0);
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q5_0& v, XP xq, int i) {
  const hipc_xb<LO> x = hipc_load_xb<LO>(xq, i);
  const int t = hipc_idot_q5<LO>(v.q, v.qh, x) - 16 * x.meta.y;  // quants stored + 16
  return hipc_f16_to_f32(v.d) * x.scale() * (float)t;
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q5_1& v, XP xq, int i) {
  const hipc_xb<LO> x = hipc_load_xb<LO>(xq, i);
  const float t = (float)hipc_idot_q5<LO>(v.q, v.qh, x);
  return x.scale() * (hipc_f16_to_f32((uint16_t)v.dm) * t + hipc_f16_to_f32((uint16_t)(v.dm >> 16)) * (float)x.meta.y);
}
// Q3_K: half h of a super-block (128 weights: chunks c = 0..3 of 32, x blocks 4i + c): its 32
// bytes of 2-bit lows and the whole hmask (bits 4h .. 4h + 3 of each byte are this half's);
// a lane's neighbour reads the other half of the same hmask in the same load.
struct hipc_unit_q3_k { uint4 qs[2], hm[2]; uint32_t sc[3]; uint16_t d; int h; };
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q3_k& v, const hipc_qmat_q3_k& m, size_t u) {
  const size_t b = u / 2;
  v.h = (int)(u % 2);
  const char* q = m.qs(b);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    v.hm[j] = hipc_load_q16<SMEM>(q + 16 * j);
    v.qs[j] = hipc_load_q16<SMEM>(q + 32 + 32 * v.h + 16 * j);
  }
  hipc_load_u32x3(v.sc, m.f2(b));
  v.d = *(const uint16_t*)m.f3(b);
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q3_k& v, XP xq, int i) {
  const uint32_t QS[8] = {v.qs[0].x, v.qs[0].y, v.qs[0].z, v.qs[0].w, v.qs[1].x, v.qs[1].y, v.qs[1].z, v.qs[1].w};
  const int hs = 4 * v.h;  // this half's hmask bits at bits 0..3 of each byte: one shift per word
  const uint32_t HM[8] = {v.hm[0].x >> hs, v.hm[0].y >> hs, v.hm[0].z >> hs, v.hm[0].w >> hs,
                          v.hm[1].x >> hs, v.hm[1].y >> hs, v.hm[1].z >> hs, v.hm[1].w >> hs};
  const uint32_t sc[2] = {hipc_q3scales4(v.sc, 2 * v.h), hipc_q3scales4(v.sc, 2 * v.h + 1)};  // chunks 0-1, 2-3
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const hipc_xb<LO> x = hipc_load_xb<LO>(xq, 4 * i + c);
    int q[8];  // 4 quants 0..7 as bytes, one per weight
#pragma unroll
    for (int w = 0; w < 8; ++w) q[w] = (int)(((QS[w] >> (2 * c)) & 0x03030303u) | (((HM[w] >> c) & 0x01010101u) << 2));
    // q - 4: subtract 4 * sum(x) over each 16 (exact in float: |t| < 2^24)
    const int t0 = hipc_idot_words<LO, 4>(q, x, 0) - 4 * x.meta.z;
    const int t1 = hipc_idot_words<LO, 4>(q + 4, x, 4) - 4 * (x.meta.y - x.meta.z);
    const uint32_t sw = sc[c / 2] >> (16 * (c % 2));
    // the two 16s' scales times their sums in integers, one conversion (|t| * 32 < 2^31
    // even against int16 activations)
    acc += x.scale() * (float)(((int)(sw & 63) - 32) * t0 + ((int)((sw >> 8) & 63) - 32) * t1);
  }
  return hipc_f16_to_f32(v.d) * acc;
}
// Q2_K: half h of a super-block (128 weights: chunks c = 0..3 of 32, x blocks 4i + c): its 32
// bytes of 2-bit quants, the 8 scale bytes of its 16-groups and d, dmin. The mins multiply x's
// sums per 16 that staging keeps (meta.z: the first 16 of a block, meta.y: all 32).
struct hipc_unit_q2_k { uint4 qs[2]; uint2 sc; uint32_t dm; };
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q2_k& v, const hipc_qmat_q2_k& m, size_t u) {
  const size_t b = u / 2;
  const int h = (int)(u % 2);
  v.qs[0] = hipc_load_q16<SMEM>(m.qs(b) + 32 * h);
  v.qs[1] = hipc_load_q16<SMEM>(m.qs(b) + 32 * h + 16);
  v.sc = uint2{hipc_load_u32(m.f2(b) + 8 * h), hipc_load_u32(m.f2(b) + 8 * h + 4)};
  v.dm = hipc_load_u32(m.f3(b));
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q2_k& v, XP xq, int i) {
  const uint32_t QS[8] = {v.qs[0].x, v.qs[0].y, v.qs[0].z, v.qs[0].w, v.qs[1].x, v.qs[1].y, v.qs[1].z, v.qs[1].w};
  float ad = 0.f, am = 0.f;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const hipc_xb<LO> x = hipc_load_xb<LO>(xq, 4 * i + c);
    int q[8];  // 4 quants 0..3 as bytes, one per weight
#pragma unroll
    for (int w = 0; w < 8; ++w) q[w] = (int)((QS[w] >> (2 * c)) & 0x03030303u);
    const int t0 = hipc_idot_words<LO, 4>(q, x, 0), t1 = hipc_idot_words<LO, 4>(q + 4, x, 4);
    const uint32_t f = (c < 2 ? v.sc.x : v.sc.y) >> (16 * (c % 2));  // groups 2c, 2c + 1
    const int s0 = (int)(f & 15), m0 = (int)((f >> 4) & 15), s1 = (int)((f >> 8) & 15), m1 = (int)((f >> 12) & 15);
    // (exact in float: |t| < 2^24)
    ad += x.scale() * (float)(s0 * t0 + s1 * t1);
    am += x.scale() * (float)(m0 * x.meta.z + m1 * (x.meta.y - x.meta.z));
  }
  return hipc_f16_to_f32((uint16_t)v.dm) * ad - hipc_f16_to_f32((uint16_t)(v.dm >> 16)) * am;
}
// The 64 bytes of quants at p (half a super-block's nibbles: Q4_K, Q5_K, IQ4_XS) as 4 loads.
template <bool SMEM>
HIPC_DEVICE void hipc_load_q64(uint4* q, const char* p) {
#pragma unroll
  for (int j = 0; j < 4; ++j) q[j] = hipc_load_q16<SMEM>(p + 16 * j);
}
// Q4_K / Q5_K: half a super-block (128 weights: 4 sub-blocks of 32, x blocks 4i ..).
struct hipc_unit_q4_k { uint4 q[4]; uint32_t sc[3], dd; int h; };
struct hipc_unit_q5_k { uint4 q[4], qh[2]; uint32_t sc[3], dd; int h; };
// a super-block's 12 scale bytes as 3 words and d + dmin as one: split, its 16-byte head
// (hipc_qmatk) in one load
HIPC_DEVICE void hipc_load_kscales(uint32_t* sc, uint32_t& dd, const char* s, const char* d) {
#if HIPC_QSPLIT
#ifdef HIPC_HOST
  if ((size_t)d % 16 || s != d + 4) __builtin_trap();  // the host tests hold the layout to it
#endif
  const uint4 h = *(const uint4*)d;
  dd = h.x, sc[0] = h.y, sc[1] = h.z, sc[2] = h.w;
#else
  hipc_load_u32x3(sc, s);
  dd = hipc_load_u32(d);
#endif
}
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q4_k& v, const hipc_qmat_q4_k& m, size_t u) {
  const size_t b = u / 2;
  v.h = (int)(u % 2);
  hipc_load_q64<SMEM>(v.q, m.qs(b) + 64 * v.h);
  hipc_load_kscales(v.sc, v.dd, m.f2(b), m.f3(b));
}
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q5_k& v, const hipc_qmat_q5_k& m, size_t u) {
  const size_t b = u / 2;
  v.h = (int)(u % 2);
  hipc_load_q64<SMEM>(v.q, m.qs(b) + 32 + 64 * v.h);
#pragma unroll
  for (int j = 0; j < 2; ++j) v.qh[j] = hipc_load_q16<SMEM>(m.qs(b) + 16 * j);
  hipc_load_kscales(v.sc, v.dd, m.f2(b), m.f3(b));
}
// The 6-bit scales and mins of sub-blocks 4h .. 4h + 3 as the bytes of two words, from the 12
// scale bytes held as 3 words: sub-blocks 0-3 are the low 6 bits of words 0 (scales) and 1
// (mins); 4-7 take their low 4 bits from word 2's nibbles and their top 2 from the top 2 bits
// of words 0 and 1. Word-wide, so no per-byte shifts and no branch on h.
HIPC_DEVICE void hipc_kscale4(const uint32_t* w, int h, uint32_t& sc, uint32_t& mn) {
  const uint32_t lo_sc = w[0] & 0x3f3f3f3fu, lo_mn = w[1] & 0x3f3f3f3fu;
  const uint32_t hi_sc = (w[2] & 0x0f0f0f0fu) | ((w[0] >> 2) & 0x30303030u);
  const uint32_t hi_mn = ((w[2] >> 4) & 0x0f0f0f0fu) | ((w[1] >> 2) & 0x30303030u);
  sc = h ? hi_sc : lo_sc;
  mn = h ? hi_mn : lo_mn;
}
// sum over sub-blocks s = 4h + k of d * scale(s) * sum(q x) - dmin * min(s) * sum(x); scale
// and min multiply the integer sums, one conversion each (|sum| * 63 < 2^31 even for Q5_K's
// 5-bit quants against int16 activations)
template <bool LO, bool Q5, class XP>
HIPC_DEVICE float hipc_dot_kquant(const uint4* q4, const uint4* qh2, const uint32_t* sc3, uint32_t dd, int h,
                                   XP xq, int i) {
  const uint32_t Q[16] = {q4[0].x, q4[0].y, q4[0].z, q4[0].w, q4[1].x, q4[1].y, q4[1].z, q4[1].w,
                          q4[2].x, q4[2].y, q4[2].z, q4[2].w, q4[3].x, q4[3].y, q4[3].z, q4[3].w};
  uint32_t scs, mns;
  hipc_kscale4(sc3, h, scs, mns);
  float dsum = 0.f, msum = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const hipc_xb<LO> x = hipc_load_xb<LO>(xq, 4 * i + k);
    const int s = 4 * h + k;
    int q[8];
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      uint32_t v = (Q[8 * (k / 2) + w] >> (4 * (k % 2))) & 0x0f0f0f0fu;
      if (Q5) {
        const uint4 hv = qh2[w / 4];
        const uint32_t hw = (w % 4 == 0 ? hv.x : w % 4 == 1 ? hv.y : w % 4 == 2 ? hv.z : hv.w);
        v |= ((hw >> s) & 0x01010101u) << 4;
      }
      q[w] = (int)v;
    }
    const int sc = (int)((scs >> (8 * k)) & 63), mn = (int)((mns >> (8 * k)) & 63);
    const float dq = x.scale();
    dsum += dq * (float)(sc * hipc_idot_words<LO, 8>(q, x, 0));
    msum += dq * (float)(mn * x.meta.y);
  }
  return hipc_f16_to_f32((uint16_t)dd) * dsum - hipc_f16_to_f32((uint16_t)(dd >> 16)) * msum;
}
// IQ4_XS: half a super-block (128 weights: sub-blocks 4h .. 4h + 3, x blocks 4i ..)
struct hipc_unit_iq4_xs { uint4 q[4]; uint32_t sl, dh; int h; };
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_iq4_xs& v, const hipc_qmat_iq4_xs& m, size_t u) {
  const size_t b = u / 2;
  v.h = (int)(u % 2);
  hipc_load_q64<SMEM>(v.q, m.qs(b) + 64 * v.h);
  v.sl = hipc_load_u32(m.f2(b));
  v.dh = hipc_load_u32(m.f3(b));
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_iq4_xs& v, XP xq, int i) {
  const uint32_t sl = v.sl >> (16 * v.h), sh = (v.dh >> 16) >> (8 * v.h);  // this half's scale bits
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const hipc_xb<LO> x = hipc_load_xb<LO>(xq, 4 * i + k);
    const uint32_t w[4] = {v.q[k].x, v.q[k].y, v.q[k].z, v.q[k].w};
    int b[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      b[j] = (int)hipc_iq4nl_bytes4(w[j] & 0x0f0f0f0fu);
      b[4 + j] = (int)hipc_iq4nl_bytes4((w[j] >> 4) & 0x0f0f0f0fu);
    }
    // (ls - 32) times the sum in float: against int16 activations it can pass 2^31
    acc += x.scale() * (float)(hipc_iq4xs_ls(sl, sh, k) - 32) * (float)hipc_idot_words<LO, 8>(b, x, 0);
  }
  return hipc_f16_to_f32((uint16_t)v.dh) * acc;
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q4_k& v, XP xq, int i) {
  return hipc_dot_kquant<LO, false>(v.q, nullptr, v.sc, v.dd, v.h, xq, i);
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q5_k& v, XP xq, int i) {
  return hipc_dot_kquant<LO, true>(v.q, v.qh, v.sc, v.dd, v.h, xq, i);
}

// ---- bulk copies into shared memory (linear_gemv_qbulk, NVIDIA sm_90) ------------------
// One thread copies a whole tile of weights (contiguous byte ranges) into a shared-memory
// stage with cp.async.bulk; the stage's mbarrier counts the bytes, and every thread waits on
// its phase parity. No register holds a load in flight, so a block keeps tens of KiB in
// flight, and a block of the next kernel (PDL) issues its first tiles before its wait.
// The host emulation copies at once and completes the phase at hipc_bulk_commit.
#if defined(__CUDACC__)
HIPC_DEVICE uint32_t hipc_bulk_smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
HIPC_DEVICE void hipc_bulk_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(hipc_bulk_smem(bar)) : "memory");
}
HIPC_DEVICE void hipc_bulk_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
HIPC_DEVICE void hipc_bulk_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(hipc_bulk_smem(bar)), "r"(bytes) : "memory");
}
// bytes % 16 == 0, src and dst 16-byte aligned
HIPC_DEVICE void hipc_bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(hipc_bulk_smem(dst)), "l"(src), "r"(bytes), "r"(hipc_bulk_smem(bar))
               : "memory");
}
HIPC_DEVICE void hipc_bulk_commit(uint64_t*) {}
HIPC_DEVICE void hipc_bulk_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(hipc_bulk_smem(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
#elif defined(HIPC_HOST)
HIPC_DEVICE void hipc_bulk_init(uint64_t* bar) { __atomic_store_n(bar, 0ull, __ATOMIC_RELEASE); }
HIPC_DEVICE void hipc_bulk_init_fence() {}
HIPC_DEVICE void hipc_bulk_expect(uint64_t*, uint32_t) {}
HIPC_DEVICE void hipc_bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t*) {
  if ((size_t)dst % 16 || (size_t)src % 16 || bytes % 16) __builtin_trap();  // what the hardware requires
  __builtin_memcpy(dst, src, bytes);
}
HIPC_DEVICE void hipc_bulk_commit(uint64_t* bar) { __atomic_fetch_add(bar, 1ull, __ATOMIC_ACQ_REL); }
HIPC_DEVICE void hipc_bulk_wait(uint64_t* bar, uint32_t parity) {
  while ((__atomic_load_n(bar, __ATOMIC_ACQUIRE) & 1) == parity) {
  }
}
#endif

// ---- quantized weights in the matrix-instruction GEMM ----------------------------------
// hipc_qchunk8: 8 consecutive weights k .. k + 7 (k % 8 == 0) of row n as small integers q
// (as bf16 bit pairs: exact, |q| < 256), and the scale s and offset o of the 16 weights their
// group k / 16 belongs to, so that w = s * q + o exactly as gguf-py dequantizes. The GEMM
// multiplies x by q on the matrix instructions and applies s (and o times the sum of x over
// the group) to each 16-deep partial product in float32: the weights are never rounded.
HIPC_DEVICE uint32_t hipc_bf16_ints(int a, int b) {
  return __builtin_bit_cast(uint32_t, (float)a) >> 16 | (__builtin_bit_cast(uint32_t, (float)b) & 0xffff0000u);
}
// 8 bytes at p (2-byte aligned: GGUF's order; 8-byte when split)
HIPC_DEVICE uint2 hipc_load_bytes8(const char* p) { return uint2{hipc_load_u32(p), hipc_load_u32(p + 4)}; }
// 8 integers from 8 bytes: (byte >> shift) & mask (+ bit `hb` of the matching byte of h as
// 1 << hshift when h is given) + add
HIPC_DEVICE uint4 hipc_ints8(uint2 v, int shift, uint32_t mask, int add, const uint2* h = nullptr, int hb = 0, int hshift = 0,
                             uint32_t hmask = 1) {
  int q[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t byte = ((i < 4 ? v.x : v.y) >> (8 * (i % 4))) & 255;
    int val = (int)((byte >> shift) & mask);
    if (h) val |= (int)((((i < 4 ? h->x : h->y) >> (8 * (i % 4) + hb)) & hmask) << hshift);
    q[i] = val + add;
  }
  return uint4{hipc_bf16_ints(q[0], q[1]), hipc_bf16_ints(q[2], q[3]), hipc_bf16_ints(q[4], q[5]), hipc_bf16_ints(q[6], q[7])};
}
// 32-weight blocks: weight j < 16 is the low nibble of byte j, j >= 16 the high one of j - 16
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_q4_0& m, int K, int n, int k, uint4& q, float& s, float& o) {
  const size_t b = (size_t)n * (K / 32) + k / 32;
  const int j = k % 32;
  q = hipc_ints8(hipc_load_bytes8(m.qs(b) + j % 16), 4 * (j / 16), 15, -8);
  s = hipc_f16_to_f32(*(const uint16_t*)m.sc(b)), o = 0.f;
}
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_iq4_nl& m, int K, int n, int k, uint4& q, float& s, float& o) {
  const size_t b = (size_t)n * (K / 32) + k / 32;
  const int j = k % 32, sh = 4 * (j / 16);
  const uint2 v = hipc_load_bytes8(m.qs(b) + j % 16);
  const uint32_t a = hipc_iq4nl_bytes4((v.x >> sh) & 0x0f0f0f0fu), c = hipc_iq4nl_bytes4((v.y >> sh) & 0x0f0f0f0fu);
  q = uint4{hipc_bf16_ints((int8_t)a, (int8_t)(a >> 8)), hipc_bf16_ints((int8_t)(a >> 16), (int8_t)(a >> 24)),
            hipc_bf16_ints((int8_t)c, (int8_t)(c >> 8)), hipc_bf16_ints((int8_t)(c >> 16), (int8_t)(c >> 24))};
  s = hipc_f16_to_f32(*(const uint16_t*)m.sc(b)), o = 0.f;
}
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_iq4_xs& m, int K, int n, int k, uint4& q, float& s, float& o) {
  const size_t b = (size_t)n * (K / 256) + k / 256;
  const int j = k % 256, ib = j / 32, l = j % 32, sh = 4 * (l / 16);
  const uint2 v = hipc_load_bytes8(m.qs(b) + 16 * ib + l % 16);
  const uint32_t a = hipc_iq4nl_bytes4((v.x >> sh) & 0x0f0f0f0fu), c = hipc_iq4nl_bytes4((v.y >> sh) & 0x0f0f0f0fu);
  q = uint4{hipc_bf16_ints((int8_t)a, (int8_t)(a >> 8)), hipc_bf16_ints((int8_t)(a >> 16), (int8_t)(a >> 24)),
            hipc_bf16_ints((int8_t)c, (int8_t)(c >> 8)), hipc_bf16_ints((int8_t)(c >> 16), (int8_t)(c >> 24))};
  const uint32_t dh = hipc_load_u32(m.f3(b));
  s = hipc_f16_to_f32((uint16_t)dh) * (float)(hipc_iq4xs_ls(hipc_load_u32(m.f2(b)), dh >> 16, ib) - 32), o = 0.f;
}
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_q4_1& m, int K, int n, int k, uint4& q, float& s, float& o) {
  const size_t b = (size_t)n * (K / 32) + k / 32;
  const int j = k % 32;
  q = hipc_ints8(hipc_load_bytes8(m.qs(b) + j % 16), 4 * (j / 16), 15, 0);
  const uint16_t* dm = (const uint16_t*)m.sc(b);
  s = hipc_f16_to_f32(dm[0]), o = hipc_f16_to_f32(dm[1]);
}
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_q8_0& m, int K, int n, int k, uint4& q, float& s, float& o) {
  const size_t b = (size_t)n * (K / 32) + k / 32;
  const uint2 v = hipc_load_bytes8(m.qs(b) + k % 32);
  int8_t t[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) t[i] = (int8_t)(((i < 4 ? v.x : v.y) >> (8 * (i % 4))) & 255);
  q = uint4{hipc_bf16_ints(t[0], t[1]), hipc_bf16_ints(t[2], t[3]), hipc_bf16_ints(t[4], t[5]), hipc_bf16_ints(t[6], t[7])};
  s = hipc_f16_to_f32(*(const uint16_t*)m.sc(b)), o = 0.f;
}
// Q5_0 / Q5_1: bit j of the block's qh is weight j's fifth bit
HIPC_DEVICE void hipc_q5chunk8(const char* qs, uint32_t qh, int j, int add, uint4& q) {
  const uint32_t bits = (qh >> j) & 255;  // weights j .. j + 7
  const uint2 h{hipc_bits_to_bytes4(bits & 15) >> 4, hipc_bits_to_bytes4(bits >> 4) >> 4};
  q = hipc_ints8(hipc_load_bytes8(qs + j % 16), 4 * (j / 16), 15, add, &h, 0, 4);
}
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_q5_0& m, int K, int n, int k, uint4& q, float& s, float& o) {
  const size_t b = (size_t)n * (K / 32) + k / 32;
  hipc_q5chunk8(m.qs(b), hipc_load_u32(m.f2(b)), k % 32, -16, q);
  s = hipc_f16_to_f32(*(const uint16_t*)m.f3(b)), o = 0.f;
}
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_q5_1& m, int K, int n, int k, uint4& q, float& s, float& o) {
  const size_t b = (size_t)n * (K / 32) + k / 32;
  hipc_q5chunk8(m.qs(b), hipc_load_u32(m.f2(b)), k % 32, 0, q);
  const uint16_t* dm = (const uint16_t*)m.f3(b);
  s = hipc_f16_to_f32(dm[0]), o = hipc_f16_to_f32(dm[1]);
}
// Q4_K / Q5_K: sub-block sb = j / 32 of a super-block: w = d * scale(sb) * q - dmin * min(sb)
template <bool Q5, class M>
HIPC_DEVICE void hipc_kchunk8(const M& m, int K, int n, int k, uint4& q, float& s, float& o) {
  const size_t b = (size_t)n * (K / 256) + k / 256;
  const int j = k % 256, sb = j / 32, l = j % 32;
  const char* qs = m.qs(b) + (Q5 ? 32 : 0);
  const uint2 v = hipc_load_bytes8(qs + 32 * (sb / 2) + l);
  if (Q5) {
    const uint2 h = hipc_load_bytes8(m.qs(b) + l);
    q = hipc_ints8(v, 4 * (sb % 2), 15, 0, &h, sb, 4);
  } else {
    q = hipc_ints8(v, 4 * (sb % 2), 15, 0);
  }
  int sc, mn;
  hipc_kscale_at(m.f2(b), sb, sc, mn);
  const uint16_t* dd = (const uint16_t*)m.f3(b);
  s = hipc_f16_to_f32(dd[0]) * (float)sc, o = -(hipc_f16_to_f32(dd[1]) * (float)mn);
}
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_q4_k& m, int K, int n, int k, uint4& q, float& s, float& o) {
  hipc_kchunk8<false>(m, K, n, k, q, s, o);
}
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_q5_k& m, int K, int n, int k, uint4& q, float& s, float& o) {
  hipc_kchunk8<true>(m, K, n, k, q, s, o);
}
// Q6_K (hipc_w_q6_k's indexing): an int8 scale per 16 weights, w = d * scale * (q - 32)
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_q6_k& m, int K, int n, int k, uint4& q, float& s, float& o) {
  const size_t b = (size_t)n * (K / 256) + k / 256;
  const int j = k % 256, h = j / 128, c = (j % 128) / 32, l = j % 32;
  const char* base = m.qs(b);
  const uint2 lo = hipc_load_bytes8(base + 64 * h + 32 * (c % 2) + l), hi = hipc_load_bytes8(base + 128 + 32 * h + l);
  q = hipc_ints8(lo, 4 * (c / 2), 15, -32, &hi, 2 * c, 4, 3);
  s = hipc_f16_to_f32(*(const uint16_t*)m.d(b)) * (float)((const int8_t*)m.sc(b))[8 * h + 2 * c + l / 16], o = 0.f;
}
// Q3_K (hipc_w_q3_k's indexing): a 6-bit scale per 16 weights, w = d * (scale - 32) * (q - 4)
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_q3_k& m, int K, int n, int k, uint4& q, float& s, float& o) {
  const size_t b = (size_t)n * (K / 256) + k / 256;
  const int j = k % 256, h = j / 128, c = (j % 128) / 32, l = j % 32;
  const uint2 lo = hipc_load_bytes8(m.qs(b) + 32 + 32 * h + l), hi = hipc_load_bytes8(m.qs(b) + l);
  q = hipc_ints8(lo, 2 * c, 3, -4, &hi, 4 * h + c, 2);
  s = hipc_f16_to_f32(*(const uint16_t*)m.f3(b)) * (float)hipc_q3scale(m.f2(b), 8 * h + 2 * c + l / 16), o = 0.f;
}
// Q2_K (hipc_w_q2_k's indexing): a 4-bit scale and min per 16 weights, w = d * sc * q - dmin * mn
HIPC_DEVICE void hipc_qchunk8(const hipc_qmat_q2_k& m, int K, int n, int k, uint4& q, float& s, float& o) {
  const size_t b = (size_t)n * (K / 256) + k / 256;
  const int j = k % 256, h = j / 128, c = (j % 128) / 32, l = j % 32;
  q = hipc_ints8(hipc_load_bytes8(m.qs(b) + 32 * h + l), 2 * c, 3, 0);
  hipc_q2_k_group(m, b, 8 * h + 2 * c + l / 16, s, o);
}
// Q4_K in 64-weight units (the bulk-copy GEMV reads them from shared memory): unit u of a row
// is sub-blocks 2q and 2q + 1 (q = u % 4) of super-block u / 4, the quants' bytes 32q ..
// 32q + 31 (low nibbles: sub-block 2q, high: 2q + 1). From shared memory (SMEM), 8 lanes of a
// 16-byte load phase read 8 units 32 bytes apart, two per bank group: those with bit 2 of u
// set read their second 16 bytes first, so every load covers all 32 banks once (from global
// memory the order changes nothing: both halves in order, no selects).
struct hipc_unit_q4_k64 { uint4 a, b; uint32_t sc[3], dd; int q; };
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q4_k64& v, const hipc_qmat_q4_k& m, size_t u) {
  const size_t b = u / 4;
  v.q = (int)(u % 4);
  const char* p = m.qs(b) + 32 * v.q;
  if constexpr (SMEM) {
    const int rot = (int)((u >> 2) & 1);
    const uint4 first = hipc_load_q16<SMEM>(p + 16 * rot), second = hipc_load_q16<SMEM>(p + 16 - 16 * rot);
    v.a = rot ? second : first;
    v.b = rot ? first : second;
  } else {
    v.a = hipc_load_q16<SMEM>(p);
    v.b = hipc_load_q16<SMEM>(p + 16);
  }
  hipc_load_kscales(v.sc, v.dd, m.f2(b), m.f3(b));
}
// The scales and mins of sub-blocks 2q and 2q + 1 (q < 4) as the bytes {sc0, sc1, mn0, mn1}
// of a word, from the 12 scale bytes held as 3 words (hipc_kscale4's decoding, on the one byte
// pair the unit needs)
HIPC_DEVICE uint32_t hipc_kscale2(const uint32_t* w, int q) {
  const int s = 16 * (q & 1);
  const uint32_t a = (w[0] >> s) & 0xffffu, b = (w[1] >> s) & 0xffffu, c = (w[2] >> s) & 0xffffu;
  const uint32_t ab = a | b << 16;  // the pair's bytes of words 0 (scales) and 1 (mins)
  // sub-blocks 4-7: the low 4 bits from the nibbles of word 2's pair (scales low, mins high),
  // the top 2 from bits 6-7 of ab
  const uint32_t hi = ((c | c << 12) & 0x0f0f0f0fu) | ((ab >> 2) & 0x30303030u);
  return q < 2 ? ab & 0x3f3f3f3fu : hi;
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q4_k64& v, XP xq, int i) {
  const uint32_t Q[8] = {v.a.x, v.a.y, v.a.z, v.a.w, v.b.x, v.b.y, v.b.z, v.b.w};
  int lo[8], hi[8];
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    lo[w] = (int)(Q[w] & 0x0f0f0f0fu);
    hi[w] = (int)((Q[w] >> 4) & 0x0f0f0f0fu);
  }
  const uint32_t sm = hipc_kscale2(v.sc, v.q);  // sub-blocks 2q, 2q + 1
  const int sc0 = (int)(sm & 255), sc1 = (int)((sm >> 8) & 255), mn0 = (int)((sm >> 16) & 255), mn1 = (int)(sm >> 24);
  const hipc_xb<LO> x0 = hipc_load_xb<LO>(xq, 2 * i), x1 = hipc_load_xb<LO>(xq, 2 * i + 1);
  const float d0 = x0.scale(), d1 = x1.scale();
  const float dsum = d0 * (float)(sc0 * hipc_idot_words<LO, 8>(lo, x0, 0)) +
                     d1 * (float)(sc1 * hipc_idot_words<LO, 8>(hi, x1, 0));
  const float msum = d0 * (float)(mn0 * x0.meta.y) + d1 * (float)(mn1 * x1.meta.y);
  return hipc_f16_to_f32((uint16_t)v.dd) * dsum - hipc_f16_to_f32((uint16_t)(v.dd >> 16)) * msum;
}
// Q6_K in 64-weight units (the bulk-copy GEMV): unit u of a row is, in half h = (u % 4) / 2 of
// super-block u / 4 and with p = u % 2, the 32 bytes ql[64h + 32p ..] (low nibbles: weights
// 128h + 32p + l, high: 128h + 64 + 32p + l) and the 32 bytes qh[32h ..] (their 2-bit highs
// at bits 2p and 4 + 2p); the 16-byte halves read in the bank-covering order of q4_k64.
struct hipc_unit_q6_k64 { uint4 l0, l1, h0, h1; uint32_t sc[2]; uint16_t d; int u; };
template <bool SMEM = false>
HIPC_DEVICE void hipc_load_unit(hipc_unit_q6_k64& v, const hipc_qmat_q6_k& m, size_t u) {
  const size_t b = u / 4;
  const int r = (int)(u % 4), h = r / 2, p = r % 2, rot = (int)((u >> 2) & 1);
  const char* q = m.qs(b);
  if constexpr (SMEM) {  // the bank-covering order (from global memory: in order, no selects)
    const uint4 a0 = hipc_load_q16<SMEM>(q + 64 * h + 32 * p + 16 * rot);
    const uint4 a1 = hipc_load_q16<SMEM>(q + 64 * h + 32 * p + 16 - 16 * rot);
    const uint4 b0 = hipc_load_q16<SMEM>(q + 128 + 32 * h + 16 * rot);
    const uint4 b1 = hipc_load_q16<SMEM>(q + 128 + 32 * h + 16 - 16 * rot);
    v.l0 = rot ? a1 : a0, v.l1 = rot ? a0 : a1;
    v.h0 = rot ? b1 : b0, v.h1 = rot ? b0 : b1;
  } else {
    // two pointers, each half's second load 16 bytes past (an immediate offset in SASS; written
    // as one sum, nvcc computed each of the four addresses apart)
    const char* pl = q + 64 * h + 32 * p;
    const char* ph = q + 128 + 32 * h;
    v.l0 = hipc_load_q16<SMEM>(pl), v.l1 = hipc_load_q16<SMEM>(pl + 16);
    v.h0 = hipc_load_q16<SMEM>(ph), v.h1 = hipc_load_q16<SMEM>(ph + 16);
  }
  hipc_load_q6scales(v.sc, m.sc(b) + 8 * h);
  v.d = *(const uint16_t*)m.d(b);
  v.u = r;
}
template <bool LO, class XP>
HIPC_DEVICE float hipc_dot_unit(const hipc_unit_q6_k64& v, XP xq, int i) {
  const uint32_t QL[8] = {v.l0.x, v.l0.y, v.l0.z, v.l0.w, v.l1.x, v.l1.y, v.l1.z, v.l1.w};
  const int h = v.u / 2, p = v.u % 2;
  // the highs of chunk p at bits 0-1 (and of chunk p + 2 at bits 4-5) of each byte: one
  // run-time shift per word, then the chunks' constant ones
  const uint32_t QH[8] = {v.h0.x >> 2 * p, v.h0.y >> 2 * p, v.h0.z >> 2 * p, v.h0.w >> 2 * p,
                          v.h1.x >> 2 * p, v.h1.y >> 2 * p, v.h1.z >> 2 * p, v.h1.w >> 2 * p};
  const int blk0 = (i / 4) * 8 + 4 * h + p;  // x block of chunk p of the half (then p + 2)
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < 2; ++k) {  // chunk p + 2k: the low (k 0) or high (k 1) nibbles
    const hipc_xb<LO> x = hipc_load_xb<LO>(xq, blk0 + 2 * k);
    int q[8];
#pragma unroll
    for (int w = 0; w < 8; ++w)
      q[w] = (int)(((QL[w] >> (4 * k)) & 0x0f0f0f0fu) | ((k ? QH[w] : QH[w] << 4) & 0x30303030u));
    const int t0 = hipc_idot_words<LO, 4>(q, x, 0) - 32 * x.meta.z;
    const int t1 = hipc_idot_words<LO, 4>(q + 4, x, 4) - 32 * (x.meta.y - x.meta.z);
    const uint32_t sw = v.sc[k] >> (16 * p);  // scales of chunk p + 2k: bytes 2(p + 2k), + 1
    acc += x.scale() * ((float)(int8_t)sw * (float)t0 + (float)(int8_t)(sw >> 8) * (float)t1);
  }
  return hipc_f16_to_f32(v.d) * acc;
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
HIPC_GENERIC_DOT2(f16)
HIPC_GENERIC_DOT2(f32)

// Bytes of one weight row of K values in a dense storage type (row pointers in kernels).
#define HIPC_ROW_BYTES_f32(K) ((size_t)(K) * 4)
#define HIPC_ROW_BYTES_bf16(K) ((size_t)(K) * 2)
#define HIPC_ROW_BYTES_f16(K) ((size_t)(K) * 2)

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
// 8 consecutive values of a KV cache row as bf16 (the flash attention's K/V tiles): a bfloat16
// cache's as stored, a float32 one's rounded
HIPC_DEVICE uint4 hipc_bf16x8_bf16(const uint16_t* p) { return *(const uint4*)p; }
HIPC_DEVICE uint4 hipc_bf16x8_f32(const float* p) {
  const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
  return uint4{hipc_f32_to_bf16(a.x) | hipc_f32_to_bf16(a.y) << 16, hipc_f32_to_bf16(a.z) | hipc_f32_to_bf16(a.w) << 16,
               hipc_f32_to_bf16(b.x) | hipc_f32_to_bf16(b.y) << 16, hipc_f32_to_bf16(b.z) | hipc_f32_to_bf16(b.w) << 16};
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
// B from a [k][n] tile (n contiguous: attention's V): ldmatrix.trans hands lane l the pairs
// (k 2q..2q+1, col g) of each 8x8 matrix, matrix j from the rows k = 8j..8j+7 (lanes 8j..8j+7)
HIPC_DEVICE hipc_mma_b hipc_mma_load_b_t(const uint16_t* s, int ld) {
  const int lane = hipc_thread() % 32;
  const uint32_t p = (uint32_t)__cvta_generic_to_shared(s + (lane % 16) * ld);
  hipc_mma_b b;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
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
// a lane's accumulator elements span HIPC_MMA_COLS columns; element i is in column slot
// hipc_mma_colslot(i), column hipc_mma_col(lane, slot)
#define HIPC_MMA_COLS 2
HIPC_DEVICE int hipc_mma_colslot(int i) { return i % 2; }
// likewise HIPC_MMA_ROWS rows (g and g + 8), each shared by the HIPC_MMA_ROW_LANES lanes of a quad
#define HIPC_MMA_ROWS 2
#define HIPC_MMA_ROW_LANES 4
HIPC_DEVICE int hipc_mma_rowslot(int i) { return i / 2; }
// an accumulator tile rounded to bf16 into a [16][ld] shared tile (the flash kernel's P), column pairs as words
HIPC_DEVICE void hipc_mma_store_bf16(uint16_t* s, int ld, const hipc_mma_c& c) {
  const int lane = hipc_thread() % 32, g = lane / 4, col = 2 * (lane % 4);
  *(uint32_t*)(s + g * ld + col) = hipc_f32_to_bf16(c[0]) | hipc_f32_to_bf16(c[1]) << 16;
  *(uint32_t*)(s + (g + 8) * ld + col) = hipc_f32_to_bf16(c[2]) | hipc_f32_to_bf16(c[3]) << 16;
}

// The FA2-style flash kernel's (attention_flash_mma.hip.j2) operands. Two B fragments at once
// (ldmatrix.x4): columns 0..7 and 8..15 of a [n][k] tile (K), matrices j from lanes 8j..8j+7 at
// (row l % 8 + 8 (l / 16), k ((l / 8) % 2) * 8), or of a [k][n] tile (V, .trans), lanes at
// (row k = l % 16, column (l / 16) * 8).
HIPC_DEVICE void hipc_mma_load_b2(const uint16_t* s, int ld, hipc_mma_b& b0, hipc_mma_b& b1) {
  const int lane = hipc_thread() % 32;
  const uint32_t p = (uint32_t)__cvta_generic_to_shared(s + (lane % 8 + 8 * (lane / 16)) * ld + ((lane / 8) % 2) * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(b0.r[0]), "=r"(b0.r[1]), "=r"(b1.r[0]), "=r"(b1.r[1])
               : "r"(p)
               : "memory");
}
HIPC_DEVICE void hipc_mma_load_b2_t(const uint16_t* s, int ld, hipc_mma_b& b0, hipc_mma_b& b1) {
  const int lane = hipc_thread() % 32;
  const uint32_t p = (uint32_t)__cvta_generic_to_shared(s + (lane % 16) * ld + (lane / 16) * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(b0.r[0]), "=r"(b0.r[1]), "=r"(b1.r[0]), "=r"(b1.r[1])
               : "r"(p)
               : "memory");
}
// two float32 -> bf16 pairs in one instruction (round to nearest even): lo in the low half
HIPC_DEVICE uint32_t hipc_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// 16 bytes global -> shared without registers (sm_80+), zero-filled where !valid; a group per
// commit, waited for (all of this thread's) before a barrier makes them visible to the block
HIPC_DEVICE void hipc_cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
               "l"(src), "r"(valid ? 16 : 0) : "memory");
}
HIPC_DEVICE void hipc_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
HIPC_DEVICE void hipc_cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// all but the group committed last (a double buffer: this piece landed, the next in flight)
HIPC_DEVICE void hipc_cp_async_wait_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
HIPC_DEVICE float hipc_exp2_approx(float x) {  // ex2.approx.ftz: 2^-inf = 0, ~2 ulp
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

#elif defined(HIPC_MMA_HOST)
// Host tests only (tests/host_simt.py, HIPC_HOST_SIMT, wave 32): mma.sync.m16n8k16's fragment
// layouts above, emulated. Loads read the tile directly (what ldmatrix hands each lane); an
// mma gathers the wave's fragments (the harness's hipc_host_wave_gather) and each lane sums
// its own four products in float32.
#define HIPC_MMA_N 8
struct hipc_mma_a { uint32_t r[4]; };
struct hipc_mma_b { uint32_t r[2]; };
struct hipc_mma_c {
  float v[4];
  HIPC_DEVICE float& operator[](int i) { return v[i]; }
  HIPC_DEVICE float operator[](int i) const { return v[i]; }
};
void hipc_host_wave_gather(const uint32_t* mine, int n, uint32_t* all);
HIPC_DEVICE uint32_t hipc_host_pair(const uint16_t* p) { return (uint32_t)p[0] | (uint32_t)p[1] << 16; }
HIPC_DEVICE hipc_mma_a hipc_mma_load_a(const uint16_t* s, int ld) {
  const int g = hipc_thread() % 32 / 4, q = hipc_thread() % 4;
  return {{hipc_host_pair(s + g * ld + 2 * q), hipc_host_pair(s + (g + 8) * ld + 2 * q),
           hipc_host_pair(s + g * ld + 2 * q + 8), hipc_host_pair(s + (g + 8) * ld + 2 * q + 8)}};
}
HIPC_DEVICE hipc_mma_b hipc_mma_load_b(const uint16_t* s, int ld) {
  const int g = hipc_thread() % 32 / 4, q = hipc_thread() % 4;
  return {{hipc_host_pair(s + g * ld + 2 * q), hipc_host_pair(s + g * ld + 2 * q + 8)}};
}
HIPC_DEVICE float hipc_host_half(uint32_t w, int k) {
  return __builtin_bit_cast(float, (k % 2 ? w >> 16 : w & 0xffffu) << 16);
}
HIPC_DEVICE void hipc_mma(hipc_mma_c& c, const hipc_mma_a& a, const hipc_mma_b& b) {
  uint32_t mine[6] = {a.r[0], a.r[1], a.r[2], a.r[3], b.r[0], b.r[1]}, all[32 * 6];
  hipc_host_wave_gather(mine, 6, all);
  const int g = hipc_thread() % 32 / 4, q = hipc_thread() % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * q + i % 2;
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) {
      const uint32_t aw = all[((row % 8) * 4 + (k % 8) / 2) * 6 + row / 8 + 2 * (k / 8)];
      const uint32_t bw = all[(col * 4 + (k % 8) / 2) * 6 + 4 + k / 8];
      acc += hipc_host_half(aw, k) * hipc_host_half(bw, k);
    }
    c.v[i] += acc;
  }
}
HIPC_DEVICE int hipc_mma_row(int lane, int i) { return lane / 4 + 8 * (i / 2); }
HIPC_DEVICE int hipc_mma_col(int lane, int i) { return 2 * (lane % 4) + i % 2; }
#define HIPC_MMA_COLS 2
HIPC_DEVICE int hipc_mma_colslot(int i) { return i % 2; }
#define HIPC_MMA_ROWS 2
#define HIPC_MMA_ROW_LANES 4
HIPC_DEVICE int hipc_mma_rowslot(int i) { return i / 2; }
// as HIPC_MMA_NV's (the generic flash kernel's P tiles: its wide-head form on NVIDIA)
HIPC_DEVICE void hipc_mma_store_bf16(uint16_t* s, int ld, const hipc_mma_c& c) {
  const int lane = hipc_thread() % 32, g = lane / 4, col = 2 * (lane % 4);
  *(uint32_t*)(s + g * ld + col) = hipc_f32_to_bf16(c[0]) | hipc_f32_to_bf16(c[1]) << 16;
  *(uint32_t*)(s + (g + 8) * ld + col) = hipc_f32_to_bf16(c[2]) | hipc_f32_to_bf16(c[3]) << 16;
}
// the flash kernel's operands as the NVIDIA forms above hand them (read from the tile directly)
HIPC_DEVICE void hipc_mma_load_b2(const uint16_t* s, int ld, hipc_mma_b& b0, hipc_mma_b& b1) {
  b0 = hipc_mma_load_b(s, ld), b1 = hipc_mma_load_b(s + 8 * ld, ld);
}
HIPC_DEVICE hipc_mma_b hipc_mma_load_b_t(const uint16_t* s, int ld) {
  const int g = hipc_thread() % 32 / 4, q = hipc_thread() % 4;
  const auto col = [&](int k) { return (uint32_t)s[k * ld + g] | (uint32_t)s[(k + 1) * ld + g] << 16; };
  return {{col(2 * q), col(2 * q + 8)}};
}
HIPC_DEVICE void hipc_mma_load_b2_t(const uint16_t* s, int ld, hipc_mma_b& b0, hipc_mma_b& b1) {
  b0 = hipc_mma_load_b_t(s, ld), b1 = hipc_mma_load_b_t(s + 8, ld);
}
HIPC_DEVICE uint32_t hipc_bf16x2(float lo, float hi) { return hipc_f32_to_bf16(lo) | hipc_f32_to_bf16(hi) << 16; }
HIPC_DEVICE void hipc_cp_async16(void* dst, const void* src, bool valid) {
  if (valid) __builtin_memcpy(dst, src, 16);
  else __builtin_memset(dst, 0, 16);
}
HIPC_DEVICE void hipc_cp_async_commit() {}
HIPC_DEVICE void hipc_cp_async_wait_all() {}
HIPC_DEVICE void hipc_cp_async_wait_one() {}
HIPC_DEVICE float hipc_exp2_approx(float x) { return exp2f(x); }

#elif defined(HIPC_MMA_WMMA) || defined(HIPC_MMA_WMMA12) || defined(HIPC_MMA_MFMA)
// AMD: 16 x 16 x 16 bf16 -> f32 tiles. Lane l holds row l % 16 of A (column l % 16 of B) at
// HIPC_MMA_KA consecutive k from hipc_mma_k0(l), and HIPC_MMA_ACC accumulator floats, element i
// at (row hipc_mma_row(l, i), column l % 16). Per instruction (RDNA3 and RDNA4 ISA guides, "Wave
// Matrix Multiply Accumulate"; CDNA3 ISA, "Matrix fused multiply-add" operand layouts; AMD's
// matrix instruction calculator):
#if defined(HIPC_MMA_WMMA)
//   v_wmma_f32_16x16x16_bf16, gfx11 (RDNA3/3.5), wave32: A and B 16 k a lane (8 VGPRs), lanes
//   16..31 repeating lanes 0..15; C element i of lane l at row 2i + l / 16
#define HIPC_MMA_KA 16
#define HIPC_MMA_ACC 8
HIPC_DEVICE int hipc_mma_k0(int) { return 0; }
HIPC_DEVICE int hipc_mma_row(int lane, int i) { return 2 * i + lane / 16; }
#elif defined(HIPC_MMA_WMMA12)
//   v_wmma_f32_16x16x16_bf16, gfx12 (RDNA4), wave32: A and B 8 k a lane (4 VGPRs), lanes 0..15
//   holding k 0..7 and lanes 16..31 k 8..15; C element i of lane l at row i + 8 (l / 16)
#define HIPC_MMA_KA 8
#define HIPC_MMA_ACC 8
HIPC_DEVICE int hipc_mma_k0(int lane) { return 8 * (lane / 16); }
HIPC_DEVICE int hipc_mma_row(int lane, int i) { return i + 8 * (lane / 16); }
#else
//   v_mfma_f32_16x16x16_bf16 (gfx942; gfx90a's v_mfma_f32_16x16x16bf16_1k), wave64: A and B 4 k a
//   lane (2 VGPRs), lane l holding k 4(l / 16)..4(l / 16)+3; C element i of lane l at row 4(l / 16) + i
#define HIPC_MMA_KA 4
#define HIPC_MMA_ACC 4
HIPC_DEVICE int hipc_mma_k0(int lane) { return 4 * (lane / 16); }
HIPC_DEVICE int hipc_mma_row(int lane, int i) { return 4 * (lane / 16) + i; }
#endif
#define HIPC_MMA_N 16
// fragments as plain arrays (the same loads on the device and in the host tests); a KA-run of
// k is 8, 16 or 32 bytes, loaded as one or two vector reads
struct __attribute__((aligned(HIPC_MMA_KA >= 8 ? 16 : 8))) hipc_mma_a { uint16_t v[HIPC_MMA_KA]; };
typedef hipc_mma_a hipc_mma_b;
struct hipc_mma_c {
  float v[HIPC_MMA_ACC];
  HIPC_DEVICE float& operator[](int i) { return v[i]; }
  HIPC_DEVICE float operator[](int i) const { return v[i]; }
};
HIPC_DEVICE hipc_mma_a hipc_mma_load_a(const uint16_t* s, int ld) {
  const int lane = hipc_thread() % HIPC_WAVE;
  return *(const hipc_mma_a*)(s + (lane % 16) * ld + hipc_mma_k0(lane));
}
HIPC_DEVICE hipc_mma_b hipc_mma_load_b(const uint16_t* s, int ld) { return hipc_mma_load_a(s, ld); }
// B from a [k][n] tile (n contiguous: attention's V), one value per k
HIPC_DEVICE hipc_mma_b hipc_mma_load_b_t(const uint16_t* s, int ld) {
  const int lane = hipc_thread() % HIPC_WAVE;
  hipc_mma_b b;
#pragma unroll
  for (int e = 0; e < HIPC_MMA_KA; ++e) b.v[e] = s[(hipc_mma_k0(lane) + e) * ld + lane % 16];
  return b;
}
#if defined(HIPC_HOST_SIMT)
// the host tests' harness (tests/host_simt.py) carries the instruction out across the wave's
// lanes from the ISA's own operand layout, as the hardware would
void hipc_mma_emulate(float* c, const uint16_t* a, const uint16_t* b);
HIPC_DEVICE void hipc_mma(hipc_mma_c& c, const hipc_mma_a& a, const hipc_mma_b& b) { hipc_mma_emulate(c.v, a.v, b.v); }
#else
typedef short hipc_vka __attribute__((ext_vector_type(HIPC_MMA_KA)));
typedef float hipc_vacc __attribute__((ext_vector_type(HIPC_MMA_ACC)));
HIPC_DEVICE void hipc_mma(hipc_mma_c& c, const hipc_mma_a& a, const hipc_mma_b& b) {
  const hipc_vka va = __builtin_bit_cast(hipc_vka, a), vb = __builtin_bit_cast(hipc_vka, b);
  const hipc_vacc vc = __builtin_bit_cast(hipc_vacc, c);
#if defined(HIPC_MMA_WMMA)
  c = __builtin_bit_cast(hipc_mma_c, __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(va, vb, vc));
#elif defined(HIPC_MMA_WMMA12)
  c = __builtin_bit_cast(hipc_mma_c, __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(va, vb, vc));
#else
  c = __builtin_bit_cast(hipc_mma_c, __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(va, vb, vc, 0, 0, 0));
#endif
}
#endif
HIPC_DEVICE int hipc_mma_col(int lane, int) { return lane % 16; }
#define HIPC_MMA_COLS 1
HIPC_DEVICE int hipc_mma_colslot(int) { return 0; }
// every accumulator element of a lane is in a row of its own; 16 lanes share a row
#define HIPC_MMA_ROWS HIPC_MMA_ACC
#define HIPC_MMA_ROW_LANES 16
HIPC_DEVICE int hipc_mma_rowslot(int i) { return i; }
// an accumulator tile rounded to bf16 into a [16][ld] shared tile (the flash kernel's P)
HIPC_DEVICE void hipc_mma_store_bf16(uint16_t* s, int ld, const hipc_mma_c& c) {
  const int lane = hipc_thread() % HIPC_WAVE;
#pragma unroll
  for (int i = 0; i < HIPC_MMA_ACC; ++i) s[hipc_mma_row(lane, i) * ld + lane % 16] = (uint16_t)hipc_f32_to_bf16(c[i]);
}
#endif

#if defined(HIPC_WGMMA)
// ---- sm_90a: TMA tile loads, mbarriers, wgmma (the prefill GEMM, linear_wgmma) ------------
// A tensor map as cuTensorMapEncodeTiled writes it (the runtime encodes it at launch; the
// kernel takes it by value as a __grid_constant__ parameter, whose address TMA reads).
struct alignas(128) hipc_tmap { unsigned long long v[16]; };
HIPC_DEVICE uint32_t hipc_smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
HIPC_DEVICE void hipc_mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// the barriers' initialisation made visible to the copy engine (the async proxy)
HIPC_DEVICE void hipc_mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
HIPC_DEVICE void hipc_mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
HIPC_DEVICE void hipc_mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
HIPC_DEVICE void hipc_mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// a 2-D box (c0: the inner coordinate, in elements; c1: the row) into shared memory at dst,
// completing `bar`'s transaction count; parts of the box outside the tensor read as zeros
HIPC_DEVICE void hipc_tma_load(uint32_t dst, const hipc_tmap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
// A wgmma shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format") for a K-major
// tile whose rows are 128 bytes (64 bf16) in the 128-byte swizzle TMA writes: 8-row groups
// 1024 bytes apart (the stride byte offset), the leading byte offset unused in this mode. A
// 16-deep k step inside the 128-byte row is the start address plus 32 bytes.
HIPC_DEVICE unsigned long long hipc_wgmma_desc(uint32_t addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | 1ull << 16 | (unsigned long long)(1024 >> 4) << 32 | 1ull << 62;
}
HIPC_DEVICE void hipc_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
HIPC_DEVICE void hipc_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
HIPC_DEVICE void hipc_wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// keeps the compiler from moving accesses to an accumulator register across the asynchronous MMAs
HIPC_DEVICE void hipc_reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// Thread block clusters (__cluster_dims__): the CTAs of one cluster share x tiles (one TMA copy
// multicast into each) and add up their K halves through each other's shared memory. A CTA's
// rank counts x fastest, then y, then z (PTX %cluster_ctarank).
HIPC_DEVICE void hipc_cluster_arrive() { asm volatile("barrier.cluster.arrive.release;" ::: "memory"); }
HIPC_DEVICE void hipc_cluster_wait() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }
// this CTA's shared address `addr` as the same offset in cluster CTA `rank` (a shared::cluster address)
HIPC_DEVICE uint32_t hipc_cluster_map(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// (release at CTA scope, as for a local arrival: what it orders is this CTA's wgmmas having read
// the stage, which wgmma.wait_group already guarantees; .release.cluster costs a MEMBAR.GPU)
HIPC_DEVICE void hipc_mbar_arrive_cluster(uint32_t bar) {  // bar: from hipc_cluster_map
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}
// hipc_tma_load's box written at dst in every CTA of `mask` (cluster ranks), each completing
// its own barrier at offset `bar`
HIPC_DEVICE void hipc_tma_load_multicast(uint32_t dst, const hipc_tmap* map, int c0, int c1, uint32_t bar,
                                         uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;"
      ::"r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
}
HIPC_DEVICE void hipc_st_shared_f4(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
HIPC_DEVICE void hipc_ld_cluster_f4(uint32_t addr, float& a, float& b, float& c, float& d) {
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(a), "=f"(b), "=f"(c), "=f"(d)
               : "r"(addr)
               : "memory");
}
// a barrier among the `threads` threads (whole warps) that use barrier `id` (1..15; 0 is hipc_sync's)
HIPC_DEVICE void hipc_named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
#endif
