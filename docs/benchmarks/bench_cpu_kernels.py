"""Micro-benchmark of the CPU matmul building blocks in templates/cpu/hipc_cpu.h.

Run:  python docs/benchmarks/bench_cpu_kernels.py [--quick] [--threads 2] [--activations int16]

Compiles a tiny C++ shim around the header with `g++ -O3 -march=native -fopenmp`, then
times the SmolLM2-135M weight shapes (Q4_1 attention/MLP projections, the Q8_0 tied LM
head) at T=1 (decode GEMV) and T=512 (prefill), next to a plain memory-read bandwidth
ceiling measured by a C loop in the same shim.

Decode GEMVs are timed "cold": the call cycles through enough copies of the weight
matrix (>= 256 MB) that every call streams its weights from memory, as in real decode
where the 96 MB model does not fit in the caches. "hot" rows repeat one matrix (L2/L3
resident) and show the compute ceiling of the kernel. Finally the whole decode stack
(30 layers x q,k,v,o,gate,up,down + LM head, real sizes, all distinct buffers) is run
per token to give a measured per-token matmul time next to the sum of the GEMV times.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
HEADER_DIR = REPO / "templates" / "cpu"

SHIM = r"""
#include "hipc_cpu.h"
#include <chrono>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>

typedef void (*mm_fn)(const float*, int, int, const void*, int, float*, int);
static mm_fn pick(int t) {
  switch (t) {
    case 0: return HIPC_BENCH_A16 ? hipc::matmul_a16_q4_0 : hipc::matmul_q4_0;
    case 1: return HIPC_BENCH_A16 ? hipc::matmul_a16_q4_1 : hipc::matmul_q4_1;
    case 2: return HIPC_BENCH_A16 ? hipc::matmul_a16_q8_0 : hipc::matmul_q8_0;
    case 3: return hipc::matmul_f32;
    case 4: return hipc::matmul_f16;
    default: return hipc::matmul_bf16;
  }
}
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
extern "C" {
const char* hb_isa() { return hipc::cpu_isa(); }
// 2 MB aligned buffer; huge != 0 asks for transparent huge pages (madvise).
void* hb_alloc(size_t bytes, int huge) {
  const size_t a = (size_t)2 << 20;
  void* p = aligned_alloc(a, (bytes + a - 1) / a * a);
  if (p && huge) madvise(p, (bytes + a - 1) / a * a, MADV_HUGEPAGE);
  return p;
}
void hb_free(void* p) { free(p); }
int hb_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}
// Best-of-`reps` average seconds per call; each rep makes `iters` calls cycling over
// the nW weight buffers.
double hb_time_matmul(int type, const float* x, int T, int K, const void* const* Ws, int nW,
                      int N, float* y, int iters, int reps) {
  mm_fn f = pick(type);
  for (int i = 0; i < std::min(nW, 4); ++i) f(x, T, K, Ws[i], N, y, N);  // warm up
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    for (int i = 0; i < iters; ++i) f(x, T, K, Ws[i % nW], N, y, N);
    best = std::min(best, (now() - t0) / iters);
  }
  return best;
}
// Read bandwidth ceiling: parallel integer sum over n 64-bit words (1-cycle adds, so
// the loop is load-bound), best of reps, bytes/s.
double hb_read_bw(const unsigned long long* a, long long n, int reps) {
  double best = 1e30;
  volatile unsigned long long sink = 0;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    unsigned long long s = 0;
#pragma omp parallel for simd schedule(static) reduction(+ : s)
    for (long long i = 0; i < n; ++i) s += a[i];
    best = std::min(best, now() - t0);
    sink = sink + s;
  }
  return (double)n * sizeof(unsigned long long) / best;
}
// One decode step of the matmuls of a decoder stack: for each layer, 7 GEMVs with
// (type, K, N) from the tables, weights Ws[layer*7 + i]; then the LM head.
// If flush is given, flush_n words are read (untimed) before every step, so the weights
// come from DRAM rather than from a large last-level cache.
double hb_decode_stack(int layers, const int* types, const int* Ks, const int* Ns,
                       const void* const* Ws, int head_type, int head_K, int head_N,
                       const void* head_W, float* x, float* y, int steps,
                       const unsigned long long* flush, long long flush_n) {
  double best = 1e30;
  for (int s = 0; s < steps; ++s) {
    if (flush) hb_read_bw(flush, flush_n, 1);
    const double t0 = now();
    for (int l = 0; l < layers; ++l)
      for (int i = 0; i < 7; ++i) pick(types[i])(x, 1, Ks[i], Ws[l * 7 + i], Ns[i], y, Ns[i]);
    pick(head_type)(x, 1, head_K, head_W, head_N, y, head_N);
    best = std::min(best, now() - t0);
  }
  return best;
}
}
"""

TYPES = {
    "q4_0": (0, 18),
    "q4_1": (1, 20),
    "q8_0": (2, 34),
    "f32": (3, 128),
    "f16": (4, 64),
    "bf16": (5, 64),
}
F16_FIELDS = {"q4_0": [0], "q4_1": [0, 2], "q8_0": [0]}


def bytes_per_row(wtype: str, K: int) -> int:
    return K // 32 * TYPES[wtype][1]


def build(out_dir: Path, extra_flags: list[str]) -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        sys.exit("g++ not found")
    src = out_dir / "bench_shim.cpp"
    lib_path = out_dir / "bench_shim.so"
    src.write_text(SHIM)
    cmd = [
        cxx,
        "-O3",
        "-march=native",
        "-fopenmp",
        "-shared",
        "-fPIC",
        f"-I{HEADER_DIR}",
        *extra_flags,
    ]
    subprocess.run([*cmd, str(src), "-o", str(lib_path)], check=True)
    lib = ctypes.CDLL(str(lib_path))
    P, Int = ctypes.c_void_p, ctypes.c_int
    lib.hb_isa.restype = ctypes.c_char_p
    lib.hb_time_matmul.restype = ctypes.c_double
    lib.hb_time_matmul.argtypes = [Int, P, Int, Int, P, Int, Int, P, Int, Int]
    lib.hb_alloc.restype = ctypes.c_void_p
    lib.hb_alloc.argtypes = [ctypes.c_size_t, Int]
    lib.hb_free.argtypes = [P]
    lib.hb_read_bw.restype = ctypes.c_double
    lib.hb_read_bw.argtypes = [P, ctypes.c_longlong, Int]
    lib.hb_decode_stack.restype = ctypes.c_double
    lib.hb_decode_stack.argtypes = [
        Int,
        P,
        P,
        P,
        P,
        Int,
        Int,
        Int,
        P,
        P,
        P,
        Int,
        P,
        ctypes.c_longlong,
    ]
    return lib


def make_weights(wtype: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights in the block layout with sane (finite, normal) f16 scales."""
    if wtype == "f32":
        return rng.standard_normal((N, K), dtype=np.float32)
    if wtype in ("f16", "bf16"):
        return rng.integers(0x3000, 0x3C00, size=(N, K), dtype=np.uint16)
    bb = TYPES[wtype][1]
    w = rng.integers(0, 256, size=(N, K // 32, bb), dtype=np.uint8)
    for off in F16_FIELDS[wtype]:
        w[:, :, off : off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return w


def time_matmul(lib, wtype, T, K, N, copies, rng, iters, reps=3):
    bufs = [make_weights(wtype, N, K, rng) for _ in range(copies)]
    ptrs = (ctypes.c_void_p * copies)(*[b.ctypes.data for b in bufs])
    x = rng.standard_normal((T, K), dtype=np.float32)
    y = np.empty((T, N), np.float32)
    tcode = TYPES[wtype][0]
    return lib.hb_time_matmul(
        tcode, x.ctypes.data, T, K, ptrs, copies, N, y.ctypes.data, iters, reps
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS (default 2)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--prefill-T", type=int, default=512)
    ap.add_argument("--cflags", default="", help="extra g++ flags, e.g. '-DHIPC_RL_COLS=6'")
    ap.add_argument(
        "--activations",
        choices=["int8", "int16"],
        default="int8",
        help="quantized matmuls with int8 activations (matmul_q*) or int16 (matmul_a16_q*, the default of compiled models)",
    )
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by libgomp when the shim loads
    os.environ.setdefault("OMP_PROC_BIND", "close")

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="hipc_bench_") as tmp:
        a16 = "1" if args.activations == "int16" else "0"
        lib = build(Path(tmp), [f"-DHIPC_BENCH_A16={a16}", *args.cflags.split()])
        print(f"ISA path: {lib.hb_isa().decode()}   OpenMP threads: {lib.hb_threads()}")

        big = np.ones(64 << 20, np.uint64)  # 512 MB
        bw = lib.hb_read_bw(big.ctypes.data, big.size, 5)
        del big
        print(f"memory read ceiling (512 MB parallel sum): {bw / 1e9:.1f} GB/s\n")

        shapes = [
            ("attn q/o", "q4_1", 576, 576),
            ("attn k/v", "q4_1", 192, 576),
            ("mlp gate/up", "q4_1", 1536, 576),
            ("mlp down", "q4_1", 576, 1536),
            ("lm head", "q8_0", 49152, 576),
        ]
        pre_T = args.prefill_T
        hdr = f"{'matrix':<12} {'type':<5} {'N x K':>12} {'T':>4} {'cache':>5} {'ms':>9} {'GB/s':>7} {'%bw':>5} {'GFLOP/s':>8}"
        print(hdr)
        print("-" * len(hdr))
        gemv_ms = {}
        for name, wtype, N, K in shapes:
            wbytes = N * bytes_per_row(wtype, K)
            runs = [(1, "cold"), (1, "hot"), (pre_T, "hot")]
            for T, mode in runs:
                if mode == "cold":
                    copies = max(2, (256 << 20) // wbytes + 1)
                    iters = copies * (1 if args.quick else 2)
                else:
                    copies = 1
                    iters = max(3, int((2e9 if T == 1 else 2e10) / (2 * N * K * T)))
                    if args.quick:
                        iters = max(2, iters // 4)
                sec = time_matmul(lib, wtype, T, K, N, copies, rng, iters)
                gbs = wbytes / sec / 1e9
                gflops = 2.0 * N * K * T / sec / 1e9
                if T == 1 and mode == "cold":
                    gemv_ms[(wtype, N, K)] = sec * 1e3
                print(
                    f"{name:<12} {wtype:<5} {f'{N}x{K}':>12} {T:>4} {mode:>5} {sec * 1e3:>9.4f} "
                    f"{gbs:>7.1f} {100 * gbs * 1e9 / bw:>4.0f}% {gflops:>8.1f}"
                )

        # implied decode time per token from the cold GEMV times
        L = 30
        per_layer = (
            2 * gemv_ms[("q4_1", 576, 576)]  # q, o
            + 2 * gemv_ms[("q4_1", 192, 576)]  # k, v
            + 2 * gemv_ms[("q4_1", 1536, 576)]  # gate, up
            + gemv_ms[("q4_1", 576, 1536)]  # down
        )
        head = gemv_ms[("q8_0", 49152, 576)]
        implied = L * per_layer + head
        layer_bytes = (2 * 576 + 2 * 192 + 3 * 1536) * bytes_per_row("q4_1", 576)
        total_bytes = L * layer_bytes + 49152 * bytes_per_row("q8_0", 576)
        print(
            "\n30 layers x (q,k,v,o,gate,up,down) + LM head:"
            f"\nimplied decode matmul time per token (sum of cold GEMVs): {implied:.3f} ms"
            f" = {1e3 / implied:.0f} tok/s ceiling for the matmuls"
            f" ({total_bytes / 1e6:.1f} MB of weights, bandwidth floor {total_bytes / bw * 1e3:.3f} ms)"
        )

        # measured: the whole stack, distinct buffers per layer
        tcodes = [TYPES["q4_1"][0]] * 7
        Ks = [576, 576, 576, 576, 576, 576, 1536]
        Ns = [576, 192, 192, 576, 1536, 1536, 576]
        bufs = [
            make_weights("q4_1", n, k, rng) for _ in range(L) for n, k in zip(Ns, Ks, strict=True)
        ]
        ptrs = (ctypes.c_void_p * len(bufs))(*[b.ctypes.data for b in bufs])
        head_w = make_weights("q8_0", 49152, 576, rng)
        x = rng.standard_normal(1536, dtype=np.float32)
        y = np.empty(49152, np.float32)
        arr = lambda v: (ctypes.c_int * len(v))(*v)  # noqa: E731
        steps = 10 if args.quick else 30
        flush = np.ones(64 << 20, np.uint64)  # 512 MB

        def in_arena(huge: int) -> tuple[int, list[int], int]:
            """Copy all stack weights into one 2 MB aligned (optionally THP) buffer."""
            sizes = [b.nbytes for b in bufs] + [head_w.nbytes]
            offs = np.concatenate([[0], np.cumsum([(n + 4095) // 4096 * 4096 for n in sizes])])
            base = lib.hb_alloc(int(offs[-1]), huge)
            for b, o in zip([*bufs, head_w], offs[:-1], strict=True):
                ctypes.memmove(base + int(o), b.ctypes.data, b.nbytes)
            return base, [base + int(o) for o in offs[:-2]], base + int(offs[-2])

        runs = [("numpy buffers, cache-warm", ptrs, head_w.ctypes.data, None)]
        runs.append(
            ("numpy buffers, caches flushed before each token", ptrs, head_w.ctypes.data, flush)
        )
        arenas = []
        for huge, label in ((0, "4 KB pages"), (1, "2 MB pages (THP)")):
            base, wp, hp = in_arena(huge)
            arenas.append(base)
            runs.append(
                (f"one arena, {label}, flushed", (ctypes.c_void_p * len(wp))(*wp), hp, flush)
            )
        for label, wptrs, hptr, fl in runs:
            sec = lib.hb_decode_stack(
                L, arr(tcodes), arr(Ks), arr(Ns), wptrs, TYPES["q8_0"][0], 576, 49152,
                hptr, x.ctypes.data, y.ctypes.data, steps,
                None if fl is None else fl.ctypes.data, 0 if fl is None else fl.size,
            )  # fmt: skip
            print(
                f"measured decode stack ({label}): {sec * 1e3:.3f} ms/token"
                f" = {1 / sec:.0f} tok/s for the matmuls, {total_bytes / sec / 1e9:.1f} GB/s"
                f" ({100 * total_bytes / sec / bw:.0f}% of the read ceiling)"
            )
        for base in arenas:
            lib.hb_free(base)


if __name__ == "__main__":
    main()
