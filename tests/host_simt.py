"""Running GPU kernels' source on the host (HIPC_HOST_SIMT): the prelude, a harness that runs
each block's threads in step as host threads (barriers and shuffles through a sleeping
barrier, the grid's blocks one after another), and the tests' code, built as one shared
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
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
// a barrier that sleeps (std::barrier spins: hundreds of spinning threads on a few cores)
struct Barrier {
  explicit Barrier(int n) : n(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(m);
    const unsigned gen = generation;
    if (++count == n) {
      count = 0, ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
  }
  int n, count = 0;
  unsigned generation = 0;
  std::mutex m;
  std::condition_variable cv;
};
static thread_local int t_id;
static int g_dim, g_bx, g_by;
static Barrier* g_bar;  // the block's (hipc_sync)
static std::vector<Barrier*> g_wbar;  // each wave's (shuffles: waves may run apart)
static float g_slots[1024];
int hipc_thread() { return t_id; }
int hipc_block_dim() { return g_dim; }
int hipc_block_x() { return g_bx; }
int hipc_block_y() { return g_by; }
void hipc_sync() { g_bar->arrive_and_wait(); }
static float exchange(float v, int from) {
  Barrier* w = g_wbar[t_id / HIPC_WAVE];
  g_slots[t_id] = v;
  w->arrive_and_wait();
  const float r = g_slots[from];
  w->arrive_and_wait();
  return r;
}
float hipc_shfl_xor(float v, int m) { return exchange(v, t_id ^ m); }
// HIPC_MMA_HOST's mma: every lane's n fragment words, in lane order, to every lane
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
template <class F>
void grid(int gx, int gy, int threads, F kernel) {
  for (int by = 0; by < gy; ++by)
    for (int bx = 0; bx < gx; ++bx) {
      Barrier bar(threads);
      std::vector<std::unique_ptr<Barrier>> waves;
      g_wbar.clear();
      for (int w = 0; w < threads / HIPC_WAVE; ++w) {
        waves.emplace_back(new Barrier(HIPC_WAVE));
        g_wbar.push_back(waves.back().get());
      }
      g_bar = &bar, g_dim = threads, g_bx = bx, g_by = by;
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t) ts.emplace_back([=] { t_id = t; kernel(); });
      for (auto& th : ts) th.join();
    }
}
"""


def build(root: Path, name: str, code: str, wave: int = 32, mma: bool = False) -> ctypes.CDLL:
    """`code` (kernels and their extern "C" wrappers, calling `grid(gx, gy, threads, f)`)
    after the prelude and the harness, compiled into ROOT/NAME.so and loaded. `mma`: the
    prelude's hipc_mma_* as HIPC_MMA_HOST (mma.sync's layouts emulated; wave 32)."""
    if CXX is None:
        pytest.skip("no C++ compiler")
    prelude = template_text("hip/prelude.h").replace("#pragma once", "")
    src = root / f"{name}.cpp"
    mma_macro = "#define HIPC_MMA_HOST 1\n" if mma else ""
    src.write_text(
        f"#define HIPC_WAVE {wave}\n#define HIPC_HOST_SIMT\n{mma_macro}{prelude}{HARNESS}{code}"
    )
    so = root / f"{name}.so"
    cmd = [CXX, "-std=c++20", "-O1", "-DHIPC_HOST", "-shared", "-fPIC", "-pthread", str(src)]
    subprocess.run([*cmd, "-o", str(so)], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(so))
