"""The GPU Gated DeltaNet kernels alone at Qwen3.5-35B-A3B's linear-layer shape (16 key / 32
value heads of 128, conv 4, bf16 conv weight): one layer's decode step for each split of a
state column over lanes (1, 2, 4: the compiled default is 1), and its prefill per token at
64, 512 and 4096 tokens, token-serial (each lane split) against the chunked prefill (chunks
of 64: prep, solve, scan, norm), with the state bytes a decode step moves.

Run on the GPU machine from the repo root (PYTHONPATH as for tests/gpu):

    python docs/benchmarks/bench_gpu_deltanet.py [--out FILE.md] [--steps 200]

Times are host wall time over back-to-back launches, synchronised once (launch overhead
included, as a captured decode graph would not add it: an upper bound). Before timing, the
chunked prefill's 4096-token output is compared with the serial kernel's from the same
states (relative error printed under the table).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from hipc.base.launch_plan import eval_dim  # noqa: E402
from hipc.compiler.kernels.base import GpuKernel  # noqa: E402
from hipc.compiler.kernels.deltanet import (  # noqa: E402
    DeltaNetParams,
    chunk_launches,
    chunk_mma,
    chunk_work_bytes,
    gpu_chunk_kernel,
    gpu_kernel,
)
from hipc.compiler.targets import GpuTarget  # noqa: E402

from gpu_kernels import DeviceKernels  # noqa: E402

P = DeltaNetParams(
    NK=16, NV=32, DK=128, DV=128, KC=4, scale=128**-0.5, l2_eps=1e-6, norm_eps=1e-6,
    v_tiled=False, dt_bias=True, ba_packed=False, qkvz_packed=False, chunk=64,
    conv_wtype="bfloat16",
)  # fmt: skip
T_MAX = 4096


def kernels(arch: str) -> tuple[dict[int, GpuKernel], dict[str, GpuKernel], list]:
    """(the serial kernel per lanes per column, the chunked ones by label: as compiled (first),
    other _scan column slices, all SIMT; DeviceKernels' specs)."""
    wave, mma = GpuTarget(arch).wave, chunk_mma(arch)
    ks = {n: gpu_kernel(f"dn_l{n}", P, wave, ["bench"], lanes=n) for n in (1, 2, 4)}
    variants = [(mma, 8, False), (mma, 4, False), (mma, 16, False)]
    if mma:
        variants += [("", 8, False), (mma, 8, True), (mma, 32, True)]
    chunks = {
        f"{m or 'SIMT'}, scan {cols} columns{' on it too' if scan else ''}": gpu_chunk_kernel(
            f"dn_chunk{i}", P, wave, ["bench"], m, columns=cols, scan_mma=scan
        )
        for i, (m, cols, scan) in enumerate(variants)
    }
    specs = [(k.fn, k.template, k.ctx, 0) for k in ks.values()]
    return ks, chunks, specs + [(k.fn, k.template, k.ctx, None) for k in chunks.values()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--chunked-only", action="store_true", help="time the chunked forms only")
    args = ap.parse_args()
    ks: dict[int, GpuKernel] = {}
    chunks: dict[str, GpuKernel] = {}

    def build(arch):
        serial, chunked, specs = kernels(arch)
        ks.update(serial)
        chunks.update(chunked)
        return specs

    dev = DeviceKernels(build)
    C = 2 * P.NK * P.DK + P.NV * P.DV
    rng = np.random.default_rng(0)
    f32 = np.float32
    x = dev.upload(rng.standard_normal((T_MAX, C)).astype(f32))
    z = dev.upload(rng.standard_normal((T_MAX, P.NV * P.DV)).astype(f32))
    ba = dev.upload(rng.standard_normal((T_MAX, P.NV)).astype(f32))
    w = dev.upload(rng.integers(0x3C00, 0x3F00, (C, P.KC)).astype(np.uint16))  # bf16 ~0.01-0.5
    A = dev.upload(-rng.uniform(0.5, 8, P.NV).astype(f32))
    dt = dev.upload(rng.uniform(-1, 1, P.NV).astype(f32))
    nw = dev.upload(np.ones(P.DV, f32))
    conv = dev.upload(np.zeros((P.KC - 1, C), f32))
    ssm = dev.upload(np.zeros((P.NV, P.DK, P.DV), f32))
    y = dev.upload(np.zeros((T_MAX, P.NV * P.DV), f32))
    work = dev.upload(np.zeros(chunk_work_bytes(P, T_MAX) // 4, f32))
    # one sequence (slot 0) at positions 0..T-1: one run of rows for the serial kernel
    pos = dev.upload(np.arange(T_MAX, dtype=np.int32))
    seq = dev.upload(np.zeros(T_MAX, np.int32))

    def kargs(T):
        return [("i32", T), ("u64", x), ("i32", C), ("u64", z), ("i32", P.NV * P.DV),
                ("u64", ba), ("i32", P.NV), ("u64", ba), ("i32", P.NV), ("u64", w), ("u64", A),
                ("u64", dt), ("u64", nw), ("u64", conv), ("u64", ssm), ("u64", y),
                ("i32", P.NV * P.DV), ("u64", pos), ("u64", seq)]  # fmt: skip

    def serial(k):
        return lambda T: dev.launch(k.fn, (P.NK,), k.threads, kargs(T))

    def chunked(k):
        def run(T):
            for kernel, grid, threads in chunk_launches(P, k):
                dims = tuple(eval_dim(d, T, T) for d in grid)
                dev.launch(kernel, dims, threads, [*kargs(T), ("u64", work)])

        return run

    def timed(run, T, n):
        run(T)
        dev.d.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            run(T)
        dev.d.synchronize()
        return (time.perf_counter() - t) / n

    def from_zero(run, T):
        """y after one T-token step from zero states."""
        dev.d.memset0(conv, 4 * (P.KC - 1) * C)
        dev.d.memset0(ssm, 4 * P.NV * P.DK * P.DV)
        run(T)
        dev.d.synchronize()
        return dev.read(y, (T, P.NV * P.DV))

    want = from_zero(serial(ks[1]), T_MAX)
    agree = {}
    for label, k in chunks.items():
        got = from_zero(chunked(k), T_MAX)
        agree[label] = float(np.linalg.norm(got - want) / np.linalg.norm(want))

    state_bytes = 2 * 4 * P.NV * P.DK * P.DV  # read and written once per launch
    rows = [f"# deltanet kernels, Qwen3.5-35B linear layer ({dev.arch})", ""]
    rows += ["| kernel | threads | decode us/step | state GB/s | prefill 64 us/token | "
             "prefill 512 us/token | prefill 4096 us/token |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for lanes, k in ks.items():
        if k.threads > 1024 or args.chunked_only:
            continue
        run = serial(k)
        decode = timed(run, 1, args.steps)
        p64, p512 = timed(run, 64, 20) / 64, timed(run, 512, 5) / 512
        p4096 = timed(run, 4096, 2) / 4096
        rows.append(
            f"| serial, {lanes} lane(s) per column | {k.threads} | {decode * 1e6:.1f} | "
            f"{state_bytes / decode / 1e9:.0f} | {p64 * 1e6:.3f} | {p512 * 1e6:.3f} | "
            f"{p4096 * 1e6:.3f} |"
        )
    for label, k in chunks.items():
        run = chunked(k)
        c64, c512 = timed(run, 64, 50) / 64, timed(run, 512, 20) / 512
        c4096 = timed(run, 4096, 5) / 4096
        rows.append(
            f"| chunked (64; _solve: {label}) | 256 | - | - | {c64 * 1e6:.3f} | "
            f"{c512 * 1e6:.3f} | {c4096 * 1e6:.3f} |"
        )
    notes = []
    for label, k in chunks.items():
        parts = []
        for kernel, grid, threads in chunk_launches(P, k):
            dims = tuple(eval_dim(d, T_MAX, T_MAX) for d in grid)
            one = timed(lambda T, kn=kernel, d=dims, t=threads: dev.launch(
                kn, d, t, [*kargs(T), ("u64", work)]), T_MAX, 5)  # fmt: skip
            parts.append(f"{kernel.rsplit('_', 1)[1]} {one * 1e3:.3f} ms")
        notes.append(
            f"- {label}: at 4096 tokens {', '.join(parts)}; vs the serial kernel from zero "
            f"states, relative error {agree[label]:.2e}"
        )
    dev.close()
    text = "\n".join(rows) + "\n\n" + "\n".join(notes) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
