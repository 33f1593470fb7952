"""The CPU quantized GEMVs on the file's blocks against the same weights in row lanes.

Run:  python docs/benchmarks/bench_cpu_lanes.py [--threads 1] [--types q5_0,q8_0,q4_k,q6_k]

Compiles a shim around templates/cpu/hipc_cpu.h (`g++ -O3 -march=native -fopenmp`), writes
random blocks of each type at SmolLM2-135M's shapes (and the 8B's down-projection width;
the K-quants at 2048-wide and 8B shapes),
repacks them with the compiler's lane_quant_blocks, checks both kernels against float64
NumPy on gguf-py's dequantization, then times decode (T = 1) "cold": each call reads another
copy of the matrix (>= 256 MB in all), as decode streams a model that does not fit the
caches, next to the core's plain read rate from the same buffers. Needs AVX512-VNNI, or AVX2
(linear_lanes_avx2.h).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO.parent))

SHIM = r"""
#include "hipc_cpu.h"
#include <chrono>
typedef void (*mm_fn)(const float*, int, int, const void*, int, float*, int);
static mm_fn pick(int i) {
  static const mm_fn fns[] = {
    hipc::matmul_a16_q5_0, hipc::matmul_a16_lanes_q5_0, hipc::matmul_q5_0, hipc::matmul_lanes_q5_0,
    hipc::matmul_a16_q5_1, hipc::matmul_a16_lanes_q5_1, hipc::matmul_q5_1, hipc::matmul_lanes_q5_1,
    hipc::matmul_a16_q8_0, hipc::matmul_a16_lanes_q8_0, hipc::matmul_q8_0, hipc::matmul_lanes_q8_0,
    hipc::matmul_a16_q4_0, hipc::matmul_a16_lanes_q4_0, hipc::matmul_q4_0, hipc::matmul_lanes_q4_0,
    hipc::matmul_a16_q4_1, hipc::matmul_a16_lanes_q4_1, hipc::matmul_q4_1, hipc::matmul_lanes_q4_1,
    hipc::matmul_a16_q4_k, hipc::matmul_a16_lanes_q4_k, hipc::matmul_q4_k, hipc::matmul_lanes_q4_k,
    hipc::matmul_a16_q5_k, hipc::matmul_a16_lanes_q5_k, hipc::matmul_q5_k, hipc::matmul_lanes_q5_k,
    hipc::matmul_a16_q6_k, hipc::matmul_a16_lanes_q6_k, hipc::matmul_q6_k, hipc::matmul_lanes_q6_k,
    hipc::matmul_a16_q3_k, hipc::matmul_a16_lanes_q3_k, hipc::matmul_q3_k, hipc::matmul_lanes_q3_k,
  };
  return fns[i];
}
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
extern "C" {
const char* hb_isa() { return hipc::cpu_isa(); }
int hb_fifth_bytes() { return hipc::detail::kLaneFifthBytes; }
void hb_call(int f, const float* x, int T, int K, const void* W, int N, float* y) { pick(f)(x, T, K, W, N, y, N); }
// seconds per call, cycling through `copies` matrices `stride` bytes apart
double hb_time(int f, const float* x, int T, int K, const unsigned char* W, long stride, int copies, int N,
               float* y, int calls) {
  for (int i = 0; i < copies; ++i) pick(f)(x, T, K, W + (long)i * stride, N, y, N);
  const double t0 = now();
  for (int i = 0; i < calls; ++i) pick(f)(x, T, K, W + (long)(i % copies) * stride, N, y, N);
  return (now() - t0) / calls;
}
// bytes per second of a plain 64-byte-load sweep over n bytes
double hb_read(const unsigned char* p, long n, int reps) {
  __m256i acc = _mm256_setzero_si256();
  const double t0 = now();
  for (int r = 0; r < reps; ++r)
    for (long o = 0; o < n; o += 256)
      for (int i = 0; i < 256; i += 32) acc = _mm256_xor_si256(acc, _mm256_loadu_si256((const __m256i*)(p + o + i)));
  const double dt = now() - t0;
  volatile int sink = _mm256_extract_epi32(acc, 0);
  (void)sink;
  return (double)n * reps / dt;
}
}
"""

TYPES = {
    "q5_0": 0,
    "q5_1": 4,
    "q8_0": 8,
    "q4_0": 12,
    "q4_1": 16,
    "q4_k": 20,
    "q5_k": 24,
    "q6_k": 28,
    "q3_k": 32,
}
BLOCK = {"q5_0": 22, "q5_1": 24, "q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 144, "q5_k": 176}
BLOCK |= {"q6_k": 210, "q3_k": 110}
QK = {t: 256 if t.endswith("_k") else 32 for t in BLOCK}
# SmolLM2-135M: q/o (576 x 576), k/v (192), gate+up merged (3072), the tied LM head, and an
# 8B-wide row for contrast
SHAPES = [(576, 576), (192, 576), (3072, 576), (576, 1536), (49152, 576), (1024, 4096)]
# the K-quants (rows of whole 256-element super-blocks): a 2048-wide model's q, gate+up and
# down, and the 8B's down
K_SHAPES = [(2048, 2048), (11264, 2048), (2048, 5632), (4096, 14336)]


def build(workdir: Path, cflags: list[str]) -> ctypes.CDLL:
    src = workdir / "shim.cpp"
    src.write_text(SHIM)
    lib = workdir / "shim.so"
    subprocess.run(
        ["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
         *cflags, f"-I{REPO / 'templates' / 'cpu'}", str(src), "-o", str(lib)],
        check=True,
    )  # fmt: skip
    so = ctypes.CDLL(str(lib))
    so.hb_isa.restype = ctypes.c_char_p
    so.hb_time.restype = ctypes.c_double
    so.hb_read.restype = ctypes.c_double
    i, vp, lg = ctypes.c_int, ctypes.c_void_p, ctypes.c_long
    so.hb_call.argtypes = [i, vp, i, i, vp, i, vp]
    so.hb_time.argtypes = [i, vp, i, i, vp, lg, i, i, vp, i]
    so.hb_read.argtypes = [vp, lg, i]
    return so


def random_blocks(wtype: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random quants, scales of either sign over three decades."""
    from gguf import GGMLQuantizationType, quants

    nb = k // QK[wtype]
    raw = rng.integers(0, 256, (rows, nb, BLOCK[wtype]), dtype=np.uint8)
    d = (rng.choice([-1, 1], (rows, nb)) * 10 ** rng.uniform(-4, -1, (rows, nb))).astype(np.float16)
    at = {"q6_k": 208, "q3_k": 108}.get(wtype, 0)
    raw[..., at : at + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    if wtype in ("q4_1", "q5_1", "q4_k", "q5_k"):
        m = (rng.standard_normal((rows, nb)) * 1e-2).astype(np.float16)
        raw[..., 2:4] = m.view(np.uint8).reshape(rows, nb, 2)
    raw = raw.reshape(rows, -1)
    qt = getattr(GGMLQuantizationType, wtype.upper())
    return raw, quants.dequantize(raw, qt).astype(np.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", default="q5_0,q8_0")
    ap.add_argument("--tokens", default="1", help="rows of x a call, e.g. 1,2,4 (batch decode)")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--cflags", default="", help="extra g++ flags, e.g. -DHIPC_LANE_PREFETCH=0")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from hipc.compiler.passes.repack import lane_quant_blocks

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        so = build(Path(tmp), args.cflags.split())
        isa = so.hb_isa().decode()
        print(f"isa {isa}, {args.threads} thread(s)")
        fifth = "bytes" if so.hb_fifth_bytes() else "masks"  # the build's arrangement
        buf = np.zeros(256 << 20, np.uint8)
        buf[:] = 1
        read = max(so.hb_read(buf.ctypes.data, buf.nbytes, 2) for _ in range(3))
        print(f"plain read from 256 MB: {read / 1e9:.1f} GB/s")
        rows = []
        for wtype in args.types.split(","):
            f0 = TYPES[wtype]
            for n, k in K_SHAPES if wtype.endswith("_k") else SHAPES:
                raw, w = random_blocks(wtype, n, k, rng)
                lanes = np.ascontiguousarray(lane_quant_blocks(raw, wtype, fifth))
                for T in map(int, args.tokens.split(",")):
                    x = rng.standard_normal((T, k)).astype(np.float32)
                    ref = x.astype(np.float64) @ w.T
                    scale = np.abs(ref).max()
                    errs = []
                    for f, mat in ((f0, raw), (f0 + 1, lanes), (f0 + 2, raw), (f0 + 3, lanes)):
                        y = np.zeros((T, n), np.float32)
                        so.hb_call(f, x.ctypes.data, T, k, mat.ctypes.data, n, y.ctypes.data)
                        errs.append(np.abs(y - ref).max() / scale)
                    times = []
                    for f, mat in ((f0, raw), (f0 + 1, lanes)):
                        nbytes = mat.nbytes
                        copies = max(2, (256 << 20) // nbytes)
                        big = np.empty((copies, nbytes), np.uint8)
                        big[:] = mat.reshape(-1)
                        y = np.zeros((T, n), np.float32)
                        calls = max(args.calls, copies)
                        t = min(
                            so.hb_time(
                                f, x.ctypes.data, T, k, big.ctypes.data, nbytes, copies, n,
                                y.ctypes.data, calls,
                            )
                            for _ in range(3)
                        )  # fmt: skip
                        times.append((t, raw.nbytes / t / 1e9))
                        del big
                    rows.append((wtype, n, k, T, raw.nbytes / 1e6, times, errs))
                    print(f"{wtype} {n}x{k} T={T}: file {times[0][0] * 1e6:.1f} us, lanes "
                          f"{times[1][0] * 1e6:.1f} us", flush=True)  # fmt: skip
        print()
        print(
            "| type | N x K | T | MB | file blocks us (GB/s) | lanes us (GB/s) | speedup "
            "| max err a16 file / lanes / a8 file / lanes |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---|")
        for wtype, n, k, T, mb, times, errs in rows:
            (tf, bf), (tl, bl) = times
            print(
                f"| {wtype} | {n} x {k} | {T} | {mb:.2f} | {tf * 1e6:.1f} ({bf:.1f}) "
                f"| {tl * 1e6:.1f} ({bl:.1f}) | {tf / tl:.2f}x "
                f"| {' / '.join(f'{e:.1e}' for e in errs)} |"
            )


if __name__ == "__main__":
    main()
