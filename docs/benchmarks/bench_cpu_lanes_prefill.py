"""The CPU row-lanes kernels at prefill (T tokens a call), two builds of them side by side.

Run:  python docs/benchmarks/bench_cpu_lanes_prefill.py [--tokens 128] [--threads 1] \
          [--types q5_0,q4_0,q4_k,q6_k] [--base -DHIPC_NOPAIR | --base-ref GIT_REF] [--rounds 3]

Compiles bench_cpu_lanes.py's shim twice, once as the "base" (with --base's g++ flags: by
default -DHIPC_NOPAIR, the AVX2 kernels' one-half-at-a-time path; or with --base-ref, the
templates/cpu of that commit) and once as the working tree's "head",
writes random blocks of each type at SmolLM2-135M's shapes, checks both builds against float64
NumPy on gguf-py's dequantization, then times each call warm (the same matrix each call: a
prefill reads its weights once for many tokens) with int16 (a16) and int8 (a8) activations, in
alternating rounds, best of each. GOP/s counts 2 * T * N * K.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_cpu_lanes as bl

# SmolLM2-135M's prefill matrices (N x K) per type its Q4_K_M file gives them: q/o, k/v, the
# merged gate+up, the down projection
SHAPES = {
    "q4_0": [(576, 576), (3072, 576)],
    "q4_1": [(576, 576), (3072, 576)],
    "q5_0": [(576, 576), (960, 576), (3072, 576)],
    "q5_1": [(576, 576), (3072, 576)],
    "q8_0": [(576, 576), (576, 1536)],
    "q3_k": [(576, 1536)],
    "q4_k": [(576, 1536), (1536, 1536)],
    "q5_k": [(576, 1536)],
    "q6_k": [(576, 1536)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", default="q5_0,q4_0,q4_k,q6_k")
    ap.add_argument("--base", default="-DHIPC_NOPAIR", help="g++ flags of the base build")
    ap.add_argument("--base-ref", help="build the base from templates/cpu at this git commit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from hipc.compiler.passes.repack import lane_quant_blocks

    T = args.tokens
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {}
        base_flags = args.base.split()
        if args.base_ref:  # that commit's headers, found before the working tree's
            ref_dir = Path(tmp) / "ref"
            ref_dir.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(bl.REPO), "archive", args.base_ref, "templates/cpu"],
                check=True, capture_output=True,
            ).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", str(ref_dir)], input=archive, check=True)
            base_flags = [f"-I{ref_dir / 'templates' / 'cpu'}"]
        for name, flags in (("base", base_flags), ("head", [])):
            (Path(tmp) / name).mkdir()
            builds[name] = bl.build(Path(tmp) / name, flags)
        so = builds["head"]
        base = args.base_ref or args.base
        print(f"isa {so.hb_isa().decode()}, {args.threads} thread(s), T = {T}, base: {base}")
        fifth = "bytes" if so.hb_fifth_bytes() else "masks"
        rows = []
        for wtype in args.types.split(","):
            for n, k in SHAPES[wtype]:
                raw, w = bl.random_blocks(wtype, n, k, rng)
                lanes = np.ascontiguousarray(lane_quant_blocks(raw, wtype, fifth))
                x = rng.standard_normal((T, k)).astype(np.float32)
                ref = x.astype(np.float64) @ w.T
                best, errs = {}, {}
                for act, f in (("a16", bl.TYPES[wtype] + 1), ("a8", bl.TYPES[wtype] + 3)):
                    for name, lib in builds.items():
                        y = np.zeros((T, n), np.float32)
                        lib.hb_call(f, x.ctypes.data, T, k, lanes.ctypes.data, n, y.ctypes.data)
                        errs[act, name] = np.abs(y - ref).max() / np.abs(ref).max()
                    for _ in range(args.rounds):  # alternating: drift shows in both
                        for name, lib in builds.items():
                            y = np.zeros((T, n), np.float32)
                            t = lib.hb_time(
                                f, x.ctypes.data, T, k, lanes.ctypes.data, 0, 1, n, y.ctypes.data,
                                args.calls,
                            )  # fmt: skip
                            best[act, name] = min(best.get((act, name), t), t)
                rows.append((wtype, n, k, best, errs))
                print(
                    f"{wtype} {n}x{k}: "
                    + ", ".join(f"{a} {nm} {t * 1e6:.0f} us" for (a, nm), t in best.items()),
                    flush=True,
                )
        print()
        print(
            "| type | N x K | a16 base GOP/s | a16 head | x | a8 base | a8 head | x | max err a16 / a8 (head) |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---|")
        for wtype, n, k, best, errs in rows:
            ops = 2 * T * n * k / 1e9
            cells = []
            for act in ("a16", "a8"):
                b, h = best[act, "base"], best[act, "head"]
                cells += [f"{ops / b:.1f}", f"{ops / h:.1f}", f"{b / h:.2f}x"]
            err = f"{errs['a16', 'head']:.1e} / {errs['a8', 'head']:.1e}"
            print(f"| {wtype} | {n} x {k} | {' | '.join(cells)} | {err} |")


if __name__ == "__main__":
    main()
