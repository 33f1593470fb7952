"""The host SIMT harness (host_simt.py) itself: its barriers and shuffles give a block's
threads what the GPU would, a kernel that leaves out a barrier it needs reads wrong values,
and threads stuck at a barrier the others never reach stop the run with a message instead
of hanging, so the kernels' host tests can fail."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import host_simt
import numpy as np
import pytest

CODE = """
// each thread's value beside its two neighbours', through shared memory
HIPC_DEVICE void neighbours(const int* in, int* out, bool sync) {
  __shared__ int s[1024];
  const int t = hipc_thread(), n = hipc_block_dim(), at = hipc_block_x() * n + t;
  s[t] = in[at];
  if (sync) hipc_sync();
  out[at] = s[(t + 1) % n] - s[(t + n - 1) % n];
}
// a wave's sum by butterfly shuffles, then lane 3's value broadcast
HIPC_DEVICE void wave_sums(const float* in, float* sum, float* lane3) {
  const int at = hipc_block_x() * hipc_block_dim() + hipc_thread();
  float v = in[at];
  const float b = hipc_shfl(v, 3);
  for (int m = HIPC_WAVE / 2; m; m /= 2) v += hipc_shfl_xor(v, m);
  sum[at] = v, lane3[at] = b;
}
// thread 0 leaves before the block's barrier
HIPC_DEVICE void stuck(int* out) {
  if (hipc_thread() == 0) return;
  hipc_sync();
  out[hipc_thread()] = 1;
}
extern "C" void run_neighbours(const int* in, int* out, int blocks, int threads, int sync) {
  grid(blocks, 1, threads, [=] { neighbours(in, out, sync); });
}
extern "C" void run_wave_sums(const float* in, float* sum, float* lane3, int blocks, int threads) {
  grid(blocks, 1, threads, [=] { wave_sums(in, sum, lane3); });
}
extern "C" void run_stuck(int* out) { grid(1, 1, 64, [=] { stuck(out); }); }
"""


@pytest.fixture(scope="module", params=[32, 64])
def lib(request, tmp_path_factory):
    wave = request.param
    root = tmp_path_factory.mktemp(f"simt{wave}")
    handle = host_simt.build(root, f"harness{wave}", CODE, wave=wave)
    handle.wave, handle.path = wave, root / f"harness{wave}.so"
    return handle


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("threads", [64, 256])
def test_a_barrier_orders_shared_memory(lib, threads):
    blocks = 3
    x = np.random.default_rng(threads).integers(-1000, 1000, blocks * threads).astype(np.int32)
    rows = x.reshape(blocks, threads)
    want = (np.roll(rows, -1, 1) - np.roll(rows, 1, 1)).reshape(-1)
    out = np.zeros_like(x)
    lib.run_neighbours(ptr(x), ptr(out), blocks, threads, 1)
    np.testing.assert_array_equal(out, want)
    # without the barrier, the first threads resumed read their neighbours' slots unwritten
    out[:] = 0
    lib.run_neighbours(ptr(-x), ptr(out), blocks, threads, 0)
    assert np.count_nonzero(out != -want) >= blocks * threads // 4


def test_shuffles_reach_the_wave_lanes(lib):
    blocks, threads, w = 2, 4 * lib.wave, lib.wave
    x = np.random.default_rng(0).standard_normal(blocks * threads).astype(np.float32)
    s, b = np.full_like(x, np.nan), np.full_like(x, np.nan)
    lib.run_wave_sums(ptr(x), ptr(s), ptr(b), blocks, threads)
    waves = x.reshape(-1, w).astype(np.float64)
    np.testing.assert_allclose(s, np.repeat(waves.sum(1), w), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(b, np.repeat(waves[:, 3], w).astype(np.float32))


def test_threads_stuck_at_a_barrier_stop_the_run(lib):
    # in a child process: the harness aborts it
    script = (
        "import ctypes, numpy as np; "
        f"lib = ctypes.CDLL({str(lib.path)!r}); "
        "out = np.zeros(64, np.int32); lib.run_stuck(out.ctypes.data_as(ctypes.c_void_p))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "63 threads wait at barriers the others never reach" in proc.stderr
