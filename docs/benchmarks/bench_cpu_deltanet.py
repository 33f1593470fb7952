"""The CPU deltanet kernel alone (templates/cpu/deltanet.cpp.j2) at Qwen3.5-35B-A3B's
linear-attention shape: 16 key / 32 value heads of 128, conv 4, tiled value heads.

    python docs/benchmarks/bench_cpu_deltanet.py [--tokens 1 64 512] [--threads 1]

Renders the kernel as the compiler does, adds a timing main (random inputs, the states
carried from call to call), builds it with `g++ -O3 -march=native -fopenmp` and prints the
best wall and CPU microseconds per token over the repeats. CPU time is the measure on a
shared box (with one thread it counts only the work itself).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.base import CPU_INDENT
from hipc.compiler.kernels.deltanet import CPU

SHAPE = dict(NK=16, NV=32, DK=128, DV=128, KC=4)

MAIN = r"""
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>
KERNEL
int main(int argc, char** argv) {
  const int T = atoi(argv[1]), reps = atoi(argv[2]);
  const int NK = NK_, NV = NV_, DK = DK_, DV = DV_, KC = KC_, C = 2 * NK * DK + NV * DV;
  std::vector<float> x((size_t)T * C), z((size_t)T * NV * DV), b((size_t)T * NV),
      a((size_t)T * NV), cw((size_t)C * KC), A(NV), dt(NV), nw(DV), cs((size_t)(KC - 1) * C),
      ss((size_t)NV * DK * DV), y((size_t)T * NV * DV);
  std::vector<int32_t> sq(T, 0);  // every row one sequence's, in slot 0
  srand(1);
  for (auto* v : {&x, &z, &b, &a, &cw, &nw, &dt})
    for (auto& e : *v) e = (float)rand() / RAND_MAX - 0.5f;
  for (auto& e : A) e = -0.5f;
  double wall = 1e9, cpu = 1e9;
  for (int it = 0; it < reps; ++it) {
    auto t0 = std::chrono::steady_clock::now();
    clock_t c0 = clock();
    dn(T, sq.data(), x.data(), C, z.data(), NV * DV, b.data(), NV, a.data(), NV, cw.data(), A.data(),
       dt.data(), nw.data(), cs.data(), ss.data(), y.data(), NV * DV);
    wall = std::min(wall, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    cpu = std::min(cpu, (double)(clock() - c0) / CLOCKS_PER_SEC);
  }
  printf("T=%4d  wall %7.1f us/token  cpu %7.1f us/token\n", T, wall / T * 1e6, cpu / T * 1e6);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    kernel = render(
        "cpu/deltanet.cpp.j2", fn="dn", nodes=["bench"], params=CPU.render(CPU_INDENT),
        scale=SHAPE["DK"] ** -0.5, l2_eps=1e-6, norm_eps=1e-6, v_tiled=True, dt_bias=True,
        ba_packed=False, qkvz_packed=False, chunk=64, conv_wtype="float32", **SHAPE,
    )  # fmt: skip
    src = MAIN.replace("KERNEL", kernel)
    for k, v in SHAPE.items():
        src = src.replace(f"{k}_", str(v))
    with tempfile.TemporaryDirectory() as d:
        cpp, exe = Path(d) / "dn.cpp", Path(d) / "dn"
        cpp.write_text(src)
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-o", exe, cpp], check=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        for t in args.tokens:
            reps = "300" if t == 1 else "8"
            subprocess.run([exe, str(t), reps], env=env, check=True)


if __name__ == "__main__":
    main()
