"""The flash prefill attention kernel alone on the GPU: time per layer at model shapes.

    python docs/benchmarks/bench_gpu_flash.py [--templates DIR ...] [--tokens 512,4096] [--out F]

Renders templates/hip/attention_flash.hip.j2 as compiler/kernels/attention.py does for the
device's arch (bfloat16 KV cache, the cache filled for positions 0..T-1, a T-token prompt from
position 0), and times it: median of --repeats samples of 5 back-to-back launches each, after
3 warm-up rounds, the variants of a shape timed in turns. TFLOP/s count causal
attention's QK^T and PV over T(T+1)/2 pairs. Each --templates DIR (another checkout's
templates/, e.g. `git archive REV templates | tar -x -C DIR`) is timed beside the installed
package's templates, so a change to the kernel is measured against the kernel before it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))

from hipc.base.launch_plan import KV_BLOCK
from hipc.base.version import HIPC_VERSION
from hipc.compiler.codegen.environment import c_float
from hipc.compiler.kernels.attention import FLASH_BQ, AttentionParams, flash_attention
from hipc.compiler.kernels.linear import MMA_TILES
from hipc.compiler.targets import GpuTarget
from hipc.runtime.backends.gpu_common import DEFAULT_SHARED_LIMIT, PackedArgs

from gpu_kernels import compiled, open_driver

SHAPES = {"l8": (32, 8, 128), "smol": (9, 3, 64)}  # query heads, KV heads, head dim
BATCH = 5  # launches per timed sample (one synchronize after them)


def environment(folder: Path | None):
    import jinja2

    from hipc.compiler.codegen.environment import environment as installed

    if folder is None:
        return installed()
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True)  # fmt: skip
    env.filters["c_float"] = c_float
    return env


def program(env, arch: str, kernels) -> str:
    prelude = env.loader.get_source(env, "hip/prelude.h")[0].replace("#pragma once", "")
    body = [env.get_template(f"hip/{k.template}.hip.j2").render(fn=k.fn, **k.ctx) for k in kernels]
    return env.get_template("hip/program.hip.j2").render(
        name="bench_flash", qsplit=1, hipc_version=HIPC_VERSION, target=arch,
        wave=GpuTarget(arch).wave, mma_macro=MMA_TILES[arch].macro, wgmma=arch == "sm_90",
        prelude=prelude, kernels=body,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--templates", type=Path, action="append", default=[])
    ap.add_argument("--models", default="l8,smol")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    d = open_driver()
    arch = d.arch
    tokens = [int(t) for t in a.tokens.split(",")]
    rows = ["| templates | shape | T | us | TFLOP/s |", "|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    bufs: list[int] = []

    def up(x: np.ndarray) -> int:
        x = np.ascontiguousarray(x)
        ptr = d.malloc(x.nbytes)
        d.h2d(ptr, x.ctypes.data, x.nbytes)
        bufs.append(ptr)
        return ptr

    # every variant's kernels loaded first (a module stays loaded when the next one is), so
    # that each shape's variants are timed in turns, after the GPU has warmed up
    fns = {}
    for folder in [None, *a.templates]:
        env = environment(folder)
        specs = {}
        for m in a.models.split(","):
            NH, NKV, D = SHAPES[m]
            p = AttentionParams(NH=NH, NKV=NKV, D=D, scale=D**-0.5, window=0, interleaved=False,
                                norm_eps=0.0)  # fmt: skip
            ctx = max(tokens)  # the block tables' stride: one sequence, block b is pool block b
            specs[m] = flash_attention(f"flash_{m}", p, GpuTarget(arch), [m], "bfloat16", ctx)
        d.load_module(compiled(program(env, arch, list(specs.values())), arch))
        for m, k in specs.items():
            f = d.get_function(k.fn)
            if k.shared > DEFAULT_SHARED_LIMIT:
                d.set_dynamic_shared(f, k.shared)
            fns[folder, m] = (f, k)
    variants = [None, *a.templates]
    for m in a.models.split(","):
        NH, NKV, D = SHAPES[m]
        for T in tokens:
            q = rng.standard_normal((T, NH * D)).astype(np.float32)
            ang = rng.uniform(0, 2 * np.pi, (T, D // 2))
            kv = rng.standard_normal((T, NKV, D)).astype(np.float32).view(np.uint32) >> 16
            out = up(np.full((T, NH * D), np.nan, np.float32))
            args = PackedArgs([
                ("u64", up(q)), ("i32", NH * D), ("i32", T),
                ("u64", up(np.arange(T, dtype=np.int32))), ("u64", up(np.zeros(T, np.int32))),
                ("u64", up(np.arange(-(-max(tokens) // KV_BLOCK), dtype=np.int32))),
                ("u64", 0), ("u64", up(np.cos(ang).astype(np.float32))),
                ("u64", up(np.sin(ang).astype(np.float32))), ("u64", up(kv.astype(np.uint16))),
                ("u64", up(kv.astype(np.uint16))), ("u64", out),
            ])  # fmt: skip
            grid = (-(-T // FLASH_BQ), NH, 1)
            times = {v: [] for v in variants}
            for i in range(a.repeats + 3):  # 3 warm-up rounds
                for v in variants:
                    f, k = fns[v, m]
                    d.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(BATCH):
                        d.launch(f, grid, (k.threads, 1, 1), k.shared, args.address)
                    d.synchronize()
                    if i >= 3:
                        times[v].append((time.perf_counter() - t0) / BATCH)
            got = np.empty((T, NH * D), np.float32)
            d.d2h(got.ctypes.data, out, got.nbytes)
            d.synchronize()
            assert not np.isnan(got).any(), (m, T, "outputs left unwritten")
            for v in variants:
                us = statistics.median(times[v]) * 1e6
                flops = 4 * NH * D * T * (T + 1) / 2
                rows.append(
                    f"| {v or 'installed'} | {m} | {T} | {us:.1f} | {flops / us / 1e6:.1f} |"
                )
                print(rows[-1], flush=True)
            for ptr in bufs:
                d.free(ptr)
            bufs.clear()
    text = "\n".join(rows)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    d.close()


if __name__ == "__main__":
    main()
