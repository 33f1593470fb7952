"""The flash prefill attention kernel alone on the GPU: time per layer at model shapes.

    python docs/benchmarks/bench_gpu_flash.py [--forms mma,mma:8,generic] [--tokens 512,4096]
        [--start 0] [--out F]

Renders the flash kernel as compiler/kernels/attention.py does for the device's arch (bfloat16
KV cache, the cache filled for positions 0..start+T-1, a T-token prompt from position --start),
in each of --forms (FORM[:wW][:bB][:rR]: "mma", NVIDIA's FA2-style attention_flash_mma.hip.j2, with W warps of
R m tiles (16 rows each) and registers for B blocks per SM; "generic", attention_flash.hip.j2, the AMD forms' template and the
NVIDIA kernel before it), and times them: median of --repeats samples of 5 back-to-back
launches each, after 3 warm-up rounds, the forms of a shape timed in turns. TFLOP/s count
causal attention's QK^T and PV over the (query, key) pairs a causal mask keeps. --start 2048
--tokens 2048 is the second step of hipc's 4,096-token prefill (2,048-token steps).
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
from hipc.compiler.kernels.attention import AttentionParams, flash_attention
from hipc.compiler.kernels.linear import MMA_TILES
from hipc.compiler.targets import GpuTarget
from hipc.runtime.backends.gpu_common import DEFAULT_SHARED_LIMIT, PackedArgs

from gpu_kernels import compiled, open_driver

SHAPES = {
    "l8": (32, 8, 128),
    "smol": (9, 3, 64),
    "q35": (16, 2, 256),
}  # query heads, KV heads, head dim
# q35: the full-attention layers of Qwen3.5-35B-A3B (bench_gpu_hybrid.py's shape)
BATCH = 5  # launches per timed sample (one synchronize after them)


def environment():
    from hipc.compiler.codegen.environment import environment as installed

    return installed()


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
    ap.add_argument("--forms", default="mma,mma:r2,generic")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--models", default="l8,smol")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cache", type=Path, default=None, help="code objects by source hash")
    ap.add_argument("--prebuild", default=None, metavar="ARCH",
                    help="build the code object into --cache for ARCH and stop (no GPU)")  # fmt: skip
    a = ap.parse_args()
    d = None if a.prebuild else open_driver()
    arch = a.prebuild or d.arch
    tokens = [int(t) for t in a.tokens.split(",")]
    rows = [
        "| form | shape | start+T | us | TFLOP/s | max abs diff vs first form |",
        "|---|---|---|---|---|---|",
    ]
    rng = np.random.default_rng(0)
    bufs: list[int] = []

    def up(x: np.ndarray) -> int:
        x = np.ascontiguousarray(x)
        ptr = d.malloc(x.nbytes)
        d.h2d(ptr, x.ctypes.data, x.nbytes)
        bufs.append(ptr)
        return ptr

    # every form's kernels in one module, so that each shape's forms are timed in turns, after
    # the GPU has warmed up
    env = environment()
    forms = a.forms.split(",")
    ctx = a.start + max(tokens)  # the block tables' stride: one sequence, block b is pool block b
    specs = {}
    for m in a.models.split(","):
        NH, NKV, D = SHAPES[m]
        p = AttentionParams(NH=NH, NKV=NKV, D=D, scale=D**-0.5, window=0, interleaved=False,
                            norm_eps=0.0)  # fmt: skip
        for v in forms:
            form, *more = v.split(":")
            keys = {"w": "waves", "b": "min_blocks", "r": "tiles"}
            extra = {keys[x[0]]: int(x[1:]) for x in more}
            fn = f"flash_{m}_{'_'.join([form, *more])}"
            specs[v, m] = flash_attention(
                fn, p, GpuTarget(arch), [m], "bfloat16", ctx, form, **extra
            )
    blob = compiled(program(env, arch, list(specs.values())), arch, a.cache)
    if d is None:
        return
    d.load_module(blob)
    fns = {}
    for key, k in specs.items():
        f = d.get_function(k.fn)
        if k.shared > DEFAULT_SHARED_LIMIT:
            d.set_dynamic_shared(f, k.shared)
        fns[key] = (f, k)
    for m in a.models.split(","):
        NH, NKV, D = SHAPES[m]
        for T in tokens:
            S = a.start
            q = rng.standard_normal((T, NH * D)).astype(np.float32)
            ang = rng.uniform(0, 2 * np.pi, (S + T, D // 2))
            kv = rng.standard_normal((S + T, NKV, D)).astype(np.float32).view(np.uint32) >> 16
            out = up(np.full((T, NH * D), np.nan, np.float32))
            args = PackedArgs([
                ("u64", up(q)), ("i32", NH * D), ("i32", T),
                ("u64", up(np.arange(S, S + T, dtype=np.int32))), ("u64", up(np.zeros(T, np.int32))),
                ("u64", up(np.arange(-(-ctx // KV_BLOCK), dtype=np.int32))),
                ("u64", 0), ("u64", up(np.cos(ang).astype(np.float32))),
                ("u64", up(np.sin(ang).astype(np.float32))), ("u64", up(kv.astype(np.uint16))),
                ("u64", up(kv.astype(np.uint16))), ("u64", out),
            ])  # fmt: skip
            times = {v: [] for v in forms}
            outs = {}
            for i in range(a.repeats + 3):  # 3 warm-up rounds
                for v in forms:
                    f, k = fns[v, m]
                    grid = (-(-T // k.ctx["bq"]), NH, 1)
                    d.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(BATCH):
                        d.launch(f, grid, (k.threads, 1, 1), k.shared, args.address)
                    d.synchronize()
                    if i >= 3:
                        times[v].append((time.perf_counter() - t0) / BATCH)
                    if i == 0:  # each form's output, to compare the forms with each other
                        got = np.empty((T, NH * D), np.float32)
                        d.d2h(got.ctypes.data, out, got.nbytes)
                        d.synchronize()
                        assert not np.isnan(got).any(), (m, T, v, "outputs left unwritten")
                        outs[v] = got
                        poison = np.full_like(got, np.nan)  # held: h2d reads it
                        d.h2d(out, poison.ctypes.data, got.nbytes)
            for v in forms:
                us = statistics.median(times[v]) * 1e6
                flops = 4 * NH * D * (T * S + T * (T + 1) / 2)
                diff = float(np.abs(outs[v] - outs[forms[0]]).max())
                rows.append(
                    f"| {v} | {m} | {S}+{T} | {us:.1f} | {flops / us / 1e6:.1f} | {diff:.1e} |"
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
