// What a kernel boundary costs in a decode-like graph, and what a counter hand-off saves.
//
// A chain of KERNELS GEMV-like kernels (one 512-thread block per SM, each streaming its own
// MB MiB of "weights" and a value the kernel before wrote) is captured in a CUDA graph and
// replayed, five ways:
//   plain   - launched back to back (no overlap)
//   pdl     - programmatic dependent launch, as hipc's decode graph: each block issues its
//             first loads, waits (griddepcontrol.wait: the kernel before finished and flushed),
//             then lets the next kernel launch (griddepcontrol.launch_dependents)
//   counter - launched as pdl, but a block waits on a counter instead: every block of every
//             kernel adds 1 (release) when done; kernel k waits (acquire) until the count
//             reaches the blocks of kernels 0..k-1 (reset by a memset node at the graph's start)
//   none    - pdl without any wait (wrong results; the floor)
//   persist - PHASES kernels' work in one kernel (launched as pdl): its blocks stay resident
//             and meet at a grid barrier (a 64-bit counter) between phases, the next phase's
//             first loads issued before they wait there
// and prints us a step, us a kernel, and GB/s. Build and run (sm_90):
//   nvcc -O3 -arch=sm_90 -o /tmp/kb docs/benchmarks/kernel_boundary.cu && /tmp/kb [MB] [KERNELS] [PHASES]
// On the H200 (session 19, docs/benchmarks/gpu-h200.md; e1a9570's copy of this file), us a
// boundary over `none`, 160 kernels of 12 / 33 MiB: plain 1.66 / 2.17, pdl 0.86 / 1.93, counter 1.22 / 2.30, persist
// (5 phases) 1.23 / 1.67: a grid barrier on a counter costs what a PDL boundary does.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                     \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

enum Mode { PLAIN = 0, PDL = 1, COUNTER = 2, NONE = 3, PERSIST = 4 };
constexpr int THREADS = 512, RING = 6;

__device__ __forceinline__ uint4 ldnc(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long ld_acquire64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// the first RING loads of a stream
__device__ __forceinline__ void load_ring(const uint4* __restrict__ w, size_t n16, uint4 (&ring)[RING], size_t tid,
                                          size_t stride) {
#pragma unroll
  for (int s = 0; s < RING; ++s) ring[s] = tid + s * stride < n16 ? ldnc(w + tid + s * stride) : make_uint4(0, 0, 0, 0);
}

// a phase's stream after its ring is loaded; the block's sum of it
__device__ __forceinline__ unsigned stream_rest(const uint4* __restrict__ w, size_t n16, uint4 (&ring)[RING], size_t tid,
                                                size_t stride) {
  unsigned acc = 0;
  for (size_t i = tid; i < n16; i += RING * stride) {
#pragma unroll
    for (int s = 0; s < RING; ++s) {
      const uint4 v = ring[s];
      acc += v.x ^ v.y ^ v.z ^ v.w;
      const size_t j = i + (RING + s) * stride;
      if (j < n16) ring[s] = ldnc(w + j);
    }
  }
  __shared__ unsigned red[THREADS / 32];
  for (int o = 16; o; o /= 2) acc += __shfl_xor_sync(~0u, acc, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = acc;
  __syncthreads();
  unsigned t = 0;
  for (int i = 0; i < THREADS / 32; ++i) t += red[i];
  __syncthreads();
  return t;
}

__global__ void __launch_bounds__(THREADS, 1)
    step_kernel(const uint4* __restrict__ w, size_t n16, const float* in, float* out, int mode,
                unsigned* counter, unsigned target) {
  const size_t tid = (size_t)blockIdx.x * THREADS + threadIdx.x, stride = (size_t)gridDim.x * THREADS;
  uint4 ring[RING];
  load_ring(w, n16, ring, tid, stride);
  if (mode == PDL || mode == COUNTER || mode == NONE) {
    if (mode == PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (mode == COUNTER) {
      if (threadIdx.x == 0)
        while (ld_acquire(counter) < target) __nanosleep(32);
      __syncthreads();
    }
    asm volatile("griddepcontrol.launch_dependents;" :::);
  }
  const float x = in[blockIdx.x];  // the kernel before's result
  const unsigned t = stream_rest(w, n16, ring, tid, stride);
  if (threadIdx.x == 0) {
    out[blockIdx.x] = x + (float)(t & 1);
    if (mode == COUNTER) {
      __threadfence();
      atomicAdd(counter, 1u);
    }
  }
}

__global__ void __launch_bounds__(THREADS, 1)
    persist_kernel(const uint4* __restrict__ w, size_t n16, int phases, const float* in, float* out,
                   unsigned long long* counter) {
  const size_t tid = (size_t)blockIdx.x * THREADS + threadIdx.x, stride = (size_t)gridDim.x * THREADS;
  __shared__ unsigned long long base_s;
  uint4 ring[RING];
  load_ring(w, n16, ring, tid, stride);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
  // every launch adds (phases - 1) x blocks: the count before this one's is a multiple of that
  const unsigned long long per = (unsigned long long)(phases - 1) * gridDim.x;
  if (threadIdx.x == 0) base_s = ld_acquire64(counter) / per * per;
  __syncthreads();
  const unsigned long long base = base_s;
  for (int p = 0; p < phases; ++p) {
    if (p > 0) {
      if (threadIdx.x == 0)
        while (ld_acquire64(counter) < base + (unsigned long long)p * gridDim.x) __nanosleep(20);
      __syncthreads();
    }
    const float x = in[(size_t)p * gridDim.x + blockIdx.x];
    const unsigned t = stream_rest(w + n16 * p, n16, ring, tid, stride);
    if (threadIdx.x == 0) out[(size_t)p * gridDim.x + blockIdx.x] = x + (float)(t & 1);
    if (p + 1 < phases) {
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1ull);
      }
      load_ring(w + n16 * (p + 1), n16, ring, tid, stride);
    }
  }
}

int main(int argc, char** argv) {
  const double mb = argc > 1 ? atof(argv[1]) : 12.0;
  const int kernels = argc > 2 ? atoi(argv[2]) : 160;
  const int phases = argc > 3 ? atoi(argv[3]) : 5;  // kernels a persistent launch does
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t n16 = (size_t)(mb * (1 << 20)) / 16;
  uint4* w;
  float* act;
  unsigned* counter;
  unsigned long long* counter64;
  CK(cudaMalloc(&w, n16 * 16 * kernels));
  CK(cudaMemset(w, 1, n16 * 16 * kernels));
  CK(cudaMalloc(&act, sizeof(float) * sms * (kernels + 1)));
  CK(cudaMemset(act, 0, sizeof(float) * sms * (kernels + 1)));
  CK(cudaMalloc(&counter, sizeof(unsigned)));
  CK(cudaMalloc(&counter64, sizeof(unsigned long long)));
  CK(cudaMemset(counter64, 0, sizeof(unsigned long long)));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const char* names[] = {"plain", "pdl", "counter", "none", "persist"};
  double ms_step[5] = {0, 0, 0, 0, 0};
  for (int round = 0; round < 2; ++round) {
    for (int mode = 0; mode < 5; ++mode) {
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      CK(cudaMemsetAsync(counter, 0, sizeof(unsigned), st));
      const int launches = mode == PERSIST ? kernels / phases : kernels;
      for (int k = 0; k < launches; ++k) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(sms);
        cfg.blockDim = dim3(THREADS);
        cfg.stream = st;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = mode == PLAIN || k == 0 ? 0 : 1;
        if (mode == PERSIST) {
          CK(cudaLaunchKernelEx(&cfg, persist_kernel, (const uint4*)(w + n16 * phases * k), n16, phases,
                                (const float*)(act + sms * phases * k), act + sms * (phases * k + 1), counter64));
          continue;
        }
        CK(cudaLaunchKernelEx(&cfg, step_kernel, (const uint4*)(w + n16 * k), n16, (const float*)(act + sms * k),
                              act + sms * (k + 1), mode, counter, (unsigned)(sms * k)));
      }
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
      CK(cudaStreamSynchronize(st));
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      const int reps = 30;
      CK(cudaEventRecord(a, st));
      for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(ge, st));
      CK(cudaEventRecord(b, st));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      if (round == 1) ms_step[mode] = ms / reps;
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
    }
  }
  const double bytes = n16 * 16.0 * kernels;
  printf("%d kernels of %.1f MiB, %d blocks of %d threads\n", kernels, mb, sms, THREADS);
  printf("| mode | us a step | us a kernel | GB/s | vs none (us a boundary) |\n|---|---:|---:|---:|---:|\n");
  for (int mode = 0; mode < 5; ++mode)
    printf("| %s | %.1f | %.2f | %.0f | %+.2f |\n", names[mode], ms_step[mode] * 1e3, ms_step[mode] * 1e3 / kernels,
           bytes / (ms_step[mode] * 1e-3) / 1e9, (ms_step[mode] - ms_step[NONE]) * 1e3 / kernels);
  return 0;
}
