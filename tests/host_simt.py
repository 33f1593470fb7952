"""Running GPU kernels' source on the host (HIPC_HOST_SIMT): the prelude, a harness that runs
each block's threads in step as fibers on one host thread (barriers and shuffles switch to the
next, the grid's blocks one after another), and the tests' code, built as one shared
library. The tests under tests/compiler/test_gpu_*_host.py check kernels this way on a
machine with no GPU.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from hipc.compiler.codegen.environment import template_text

CXX = shutil.which("g++") or shutil.which("clang++")

HARNESS = """
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sys/mman.h>
#include <ucontext.h>
#include <vector>
// A block's threads are fibers on one host thread, resumed in turn by grid3's scheduler: a
// barrier or shuffle is a few context switches, where as OS threads it was a futex wake-up
// per thread (hundreds of threads on a few cores; minutes for a kernel with many shuffles).
// Each pass resumes the waiting fibers in the opposite order of the last, so a read that a
// barrier should have ordered after another thread's write sees it unwritten in one of them.
static int t_id;  // the running fiber's thread index (set by the scheduler)
static ucontext_t g_sched;
static std::vector<ucontext_t> g_fiber;
static bool g_progress;  // a barrier arrival or release, or a fiber's end, this pass
constexpr size_t FIBER_STACK = 256 << 10;
static char* fiber_stack(int t) {  // one lazily committed stack per thread index, kept
  static std::vector<char*> stacks;
  while ((int)stacks.size() <= t) {
    void* m = mmap(nullptr, FIBER_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) { perror("host_simt: mmap"); abort(); }
    stacks.push_back((char*)m);
  }
  return stacks[t];
}
static void yield_fiber() { swapcontext(&g_fiber[t_id], &g_sched); }
struct Barrier {
  explicit Barrier(int n) : n(n) {}
  void arrive_and_wait() {
    const unsigned gen = generation;
    g_progress = true;
    if (++count == n) {
      count = 0, ++generation;
      return;
    }
    while (generation == gen) yield_fiber();
  }
  int n, count = 0;
  unsigned generation = 0;
};
static int g_dim, g_bx, g_by, g_bz, g_gx;
static Barrier* g_bar;  // the block's (hipc_sync)
static std::vector<Barrier*> g_wbar;  // each wave's (shuffles: waves may run apart)
static float g_slots[1024];
int hipc_thread() { return t_id; }
int hipc_block_dim() { return g_dim; }
int hipc_block_x() { return g_bx; }
int hipc_block_y() { return g_by; }
int hipc_block_z() { return g_bz; }
int hipc_grid_x() { return g_gx; }
void hipc_sync() { g_bar->arrive_and_wait(); }
void hipc_sync_wave() { g_wbar[t_id / HIPC_WAVE]->arrive_and_wait(); }
static std::vector<uint64_t> g_dyn;  // the block's dynamic shared memory
void* hipc_dynamic_shared() { return g_dyn.data(); }
static float exchange(float v, int from) {
  Barrier* w = g_wbar[t_id / HIPC_WAVE];
  g_slots[t_id] = v;
  w->arrive_and_wait();
  const float r = g_slots[from];
  w->arrive_and_wait();
  return r;
}
float hipc_shfl_xor(float v, int m) { return exchange(v, t_id ^ m); }
// HIPC_MMA_HOST's mma (the prelude's mma.sync emulation): every lane's n fragment words, in
// lane order, to every lane
static uint32_t g_words[1024 * 8];
void hipc_host_wave_gather(const uint32_t* mine, int n, uint32_t* all) {
  Barrier* w = g_wbar[t_id / HIPC_WAVE];
  for (int i = 0; i < n; ++i) g_words[t_id * 8 + i] = mine[i];
  w->arrive_and_wait();
  const int base = t_id / HIPC_WAVE * HIPC_WAVE;
  for (int l = 0; l < HIPC_WAVE; ++l)
    for (int i = 0; i < n; ++i) all[l * n + i] = g_words[(base + l) * 8 + i];
  w->arrive_and_wait();
}
float hipc_shfl(float v, int lane) { return exchange(v, t_id / HIPC_WAVE * HIPC_WAVE + lane); }
static void (*g_body)(void*);
static void* g_kernel;
static std::vector<char> g_done;
static void fiber_main() {
  g_body(g_kernel);
  g_done[t_id] = 1;
  g_progress = true;
}  // returns to uc_link: the scheduler
// `shared` bytes of dynamic shared memory per block, all ones (NaN in bf16 and float32) to start
template <class F>
void grid3(int gx, int gy, int gz, int threads, F kernel, size_t shared = 0) {
  g_kernel = &kernel;
  g_body = [](void* k) { (*(F*)k)(); };
  g_fiber.resize(threads);
  for (int bz = 0; bz < gz; ++bz)
  for (int by = 0; by < gy; ++by)
    for (int bx = 0; bx < gx; ++bx) {
      g_dyn.assign((shared + 7) / 8, ~0ull);
      Barrier bar(threads);
      std::vector<std::unique_ptr<Barrier>> waves;
      g_wbar.clear();
      for (int w = 0; w < threads / HIPC_WAVE; ++w) {
        waves.emplace_back(new Barrier(HIPC_WAVE));
        g_wbar.push_back(waves.back().get());
      }
      g_bar = &bar, g_dim = threads, g_bx = bx, g_by = by, g_bz = bz, g_gx = gx;
      g_done.assign(threads, 0);
      for (int t = 0; t < threads; ++t) {
        getcontext(&g_fiber[t]);
        g_fiber[t].uc_stack.ss_sp = fiber_stack(t);
        g_fiber[t].uc_stack.ss_size = FIBER_STACK;
        g_fiber[t].uc_link = &g_sched;
        makecontext(&g_fiber[t], fiber_main, 0);
      }
      for (int left = threads, pass = 0; left; ++pass) {
        g_progress = false;
        for (int i = 0; i < threads; ++i) {
          const int t = pass % 2 ? threads - 1 - i : i;
          if (g_done[t]) continue;
          t_id = t;
          swapcontext(&g_sched, &g_fiber[t]);
          left -= g_done[t];
        }
        if (!g_progress && left) {
          fprintf(stderr, "host_simt: block (%d, %d, %d): %d threads wait at barriers the others never reach\\n", bx, by, bz, left);
          abort();
        }
      }
    }
}
template <class F>
void grid(int gx, int gy, int threads, F kernel, size_t shared = 0) {
  grid3(gx, gy, 1, threads, kernel, shared);
}
"""

# The AMD matrix instructions carried out across a wave's lanes, from the operand layouts as the
# ISA guides state them (RDNA3 / RDNA4 "Wave Matrix Multiply Accumulate", CDNA3 "Matrix fused
# multiply-add"), written here apart from the prelude's loads so that a kernel whose fragments
# disagree with the hardware's fails. a_at(r, k) / b_at(k, n): (lane, element) holding A[r][k] /
# B[k][n]; c_at(lane, i): the (row, column) of accumulator element i.
MMA_EMULATION = """
#if defined(HIPC_MMA_WMMA)  // v_wmma_f32_16x16x16_bf16 on gfx11: lanes 16..31 repeat 0..15
static void a_at(int r, int k, int& lane, int& e) { lane = r, e = k; }
static void c_at(int lane, int i, int& r, int& n) { r = 2 * i + lane / 16, n = lane % 16; }
#elif defined(HIPC_MMA_WMMA12)  // gfx12: lanes 16..31 hold k 8..15
static void a_at(int r, int k, int& lane, int& e) { lane = r + 16 * (k / 8), e = k % 8; }
static void c_at(int lane, int i, int& r, int& n) { r = i + 8 * (lane / 16), n = lane % 16; }
#elif defined(HIPC_MMA_MFMA)  // v_mfma_f32_16x16x16_bf16, wave64: 4 k per lane, 16 lanes per k group
static void a_at(int r, int k, int& lane, int& e) { lane = r + 16 * (k / 4), e = k % 4; }
static void c_at(int lane, int i, int& r, int& n) { r = 4 * (lane / 16) + i, n = lane % 16; }
#endif
static uint16_t g_ma[1024][16], g_mb[1024][16];  // each lane's operands, as it holds them
static std::atomic<int> g_mma_unequal{0};  // gfx11: upper lanes whose operands differ from the lower
extern "C" int hipc_mma_unequal_lanes() { return g_mma_unequal; }
static float bf16_value(uint16_t v) { const uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
void hipc_mma_emulate(float* c, const uint16_t* a, const uint16_t* b) {
  const int lane = t_id % HIPC_WAVE, w0 = t_id - lane;
  memcpy(g_ma[t_id], a, HIPC_MMA_KA * 2), memcpy(g_mb[t_id], b, HIPC_MMA_KA * 2);
  g_wbar[t_id / HIPC_WAVE]->arrive_and_wait();
#if defined(HIPC_MMA_WMMA)
  // the hardware reads lanes 0..15 only; a kernel must still hand lanes 16..31 the same
  if (lane >= 16 && (memcmp(a, g_ma[t_id - 16], 32) || memcmp(b, g_mb[t_id - 16], 32))) ++g_mma_unequal;
#endif
  float d[HIPC_MMA_ACC];
  for (int i = 0; i < HIPC_MMA_ACC; ++i) {
    int r, n, la, ea, lb, eb;
    c_at(lane, i, r, n);
    d[i] = c[i];
    for (int k = 0; k < 16; ++k) {
      a_at(r, k, la, ea);
      a_at(n, k, lb, eb);  // B's column n is laid out as A's row n
      d[i] += bf16_value(g_ma[w0 + la][ea]) * bf16_value(g_mb[w0 + lb][eb]);
    }
  }
  g_wbar[t_id / HIPC_WAVE]->arrive_and_wait();  // every lane has read the operands
  memcpy(c, d, sizeof d);
}
"""


def build(
    root: Path, name: str, code: str, wave: int = 32, mma: str | None = None, defines: str = ""
) -> ctypes.CDLL:
    """`code` (kernels and their extern "C" wrappers, calling `grid(gx, gy, threads, f)` or
    `grid3(gx, gy, gz, threads, f)`)
    after the prelude and the harness, compiled into ROOT/NAME.so and loaded. `mma`: an AMD
    HIPC_MMA_* macro, the matrix instruction emulated across the wave (MMA_EMULATION), or
    HIPC_MMA_HOST (mma.sync's, emulated by the prelude; wave 32). `defines`: lines put before
    the prelude (e.g. "#define HIPC_QSPLIT 0": quantized blocks in GGUF's order)."""
    if CXX is None:
        pytest.skip("no C++ compiler")
    prelude = template_text("hip/prelude.h").replace("#pragma once", "")
    src = root / f"{name}.cpp"
    head = f"#define HIPC_WAVE {wave}\n#define HIPC_HOST_SIMT\n{defines}"
    harness = HARNESS
    if mma:
        head += f"#define {mma} 1\n"
    if mma and mma != "HIPC_MMA_HOST":
        harness += "#include <atomic>\n#include <cstring>\n" + MMA_EMULATION
    src.write_text(f"{head}{prelude}{harness}{code}")
    so = root / f"{name}.so"
    cmd = [CXX, "-std=c++20", "-O1", "-DHIPC_HOST", "-shared", "-fPIC", "-pthread", str(src)]
    subprocess.run([*cmd, "-o", str(so)], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(so))
