"""The GPU Gated DeltaNet kernel alone at Qwen3.5-35B-A3B's linear-layer shape (16 key / 32
value heads of 128, conv 4, bf16 conv weight): one layer's decode step and prefill per token,
for each split of a state column over lanes (1, 2, 4), with the state bytes each step moves.

Run on the GPU machine from the repo root (PYTHONPATH as for tests/gpu):

    python docs/benchmarks/bench_gpu_deltanet.py [--out FILE.md] [--steps 200]

Times are host wall time over back-to-back launches of one kernel, synchronised once
(launch overhead included, as a captured decode graph would not add it: an upper bound).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from hipc.compiler.kernels.base import GpuKernel  # noqa: E402
from hipc.compiler.kernels.deltanet import DeltaNetParams, gpu_kernel  # noqa: E402
from hipc.compiler.targets import GpuTarget  # noqa: E402

from gpu_kernels import DeviceKernels  # noqa: E402

P = DeltaNetParams(
    NK=16, NV=32, DK=128, DV=128, KC=4, scale=128**-0.5, l2_eps=1e-6, norm_eps=1e-6,
    v_tiled=False, dt_bias=True, ba_packed=False, qkvz_packed=False, chunk=64,
    conv_wtype="bfloat16",
)  # fmt: skip


def variants(arch: str) -> dict[int, GpuKernel]:
    """lanes -> the kernel with its state columns split over that many lanes."""
    wave = GpuTarget(arch).wave
    return {n: gpu_kernel(f"dn_l{n}", P, wave, ["bench"], lanes=n) for n in (1, 2, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    ks: dict[int, GpuKernel] = {}

    def build(arch):
        ks.update(variants(arch))
        return [(k.fn, k.template, k.ctx, 0) for k in ks.values()]

    dev = DeviceKernels(build)
    C = 2 * P.NK * P.DK + P.NV * P.DV
    rng = np.random.default_rng(0)
    f32 = np.float32
    T_max = 4096
    x = dev.upload(rng.standard_normal((T_max, C)).astype(f32))
    z = dev.upload(rng.standard_normal((T_max, P.NV * P.DV)).astype(f32))
    ba = dev.upload(rng.standard_normal((T_max, P.NV)).astype(f32))
    w = dev.upload(rng.integers(0x3C00, 0x3F00, (C, P.KC)).astype(np.uint16))  # bf16 ~0.01-0.5
    A = dev.upload(-rng.uniform(0.5, 8, P.NV).astype(f32))
    dt = dev.upload(rng.uniform(-1, 1, P.NV).astype(f32))
    nw = dev.upload(np.ones(P.DV, f32))
    conv = dev.upload(np.zeros((P.KC - 1, C), f32))
    ssm = dev.upload(np.zeros((P.NV, P.DK, P.DV), f32))
    y = dev.upload(np.zeros((T_max, P.NV * P.DV), f32))
    state_bytes = 2 * 4 * P.NV * P.DK * P.DV  # read and written once per launch
    rows = [f"# deltanet kernel, Qwen3.5-35B linear layer ({dev.arch})", ""]
    rows += [
        "| lanes | threads | decode us/step | state GB/s | prefill 512 us/token | prefill 4096 us/token |"
    ]
    rows += ["|---|---|---|---|---|---|"]
    for lanes, k in ks.items():
        if k.threads > 1024:
            continue

        def run(T, n, k=k):
            a = [("i32", T), ("u64", x), ("i32", C), ("u64", z), ("i32", P.NV * P.DV),
                 ("u64", ba), ("i32", P.NV), ("u64", ba), ("i32", P.NV), ("u64", w), ("u64", A),
                 ("u64", dt), ("u64", nw), ("u64", conv), ("u64", ssm), ("u64", y),
                 ("i32", P.NV * P.DV)]  # fmt: skip
            dev.launch(k.fn, (P.NK,), k.threads, a)
            dev.d.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                dev.launch(k.fn, (P.NK,), k.threads, a)
            dev.d.synchronize()
            return (time.perf_counter() - t) / n

        decode = run(1, args.steps)
        p512, p4096 = run(512, 5) / 512, run(4096, 2) / 4096
        rows.append(
            f"| {lanes} | {k.threads} | {decode * 1e6:.1f} | {state_bytes / decode / 1e9:.0f} | "
            f"{p512 * 1e6:.2f} | {p4096 * 1e6:.2f} |"
        )
    dev.close()
    text = "\n".join(rows) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
