"""The batch-1 decode attention kernels alone on one GPU: every form (compiler/kernels/attention.py
decode_attention: "head", "gqa", "tile[:options]") at a few positions, for the Llama-3-8B
(32 / 8 heads of 128) and SmolLM2 (9 / 3 heads of 64) shapes, bf16 KV cache, compiled for the
model's whole context (8192) as an artifact compiles it.

    # here (no GPU needed): build the code object ahead of time
    python docs/benchmarks/bench_decode_attention.py --prebuild .work/decattn-fatbins
    # on the GPU machine
    python docs/benchmarks/bench_decode_attention.py --cache .work/decattn-fatbins --out FILE

Each (shape, form, position) is checked once against NumPy in float64 (the output, NaN-poisoned
before, within 1e-5), then timed as a captured graph of back-to-back launches, each on another
copy of the cache (copies enough that L2 holds none of them: in a decode step the weights
stream through L2 between two steps' attention): "pdl" launched as decode launches them (the
next kernel starts while this one finishes, so its work before hipc_wait_prior() overlaps:
about what the kernel adds to a step), "alone" without (its whole latency: the table, the
cache rows and the merge).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from hipc.base.launch_plan import KV_BLOCK  # noqa: E402
from hipc.compiler.kernels.attention import AttentionParams, decode_attention  # noqa: E402
from hipc.compiler.reference.executor import round_bf16  # noqa: E402
from hipc.compiler.targets import GpuTarget  # noqa: E402
from hipc.runtime.backends.gpu_common import PackedArgs  # noqa: E402

from gpu_kernels import DeviceKernels, compiled, kernels_source, rope  # noqa: E402

SHAPES = {"l8": (32, 8, 128), "smol": (9, 3, 64)}
# the tile form's default first (1 lane per score, 64-key tiles, 512 blocks, 16-block merge
# steps), then the other forms and the tile geometries it was chosen over
FORMS = (
    "tile", "head", "gqa", "tile:b128", "tile:b256", "tile:l4", "tile:m8", "tile:k32",
)  # fmt: skip
POSITIONS = (0, 128, 512, 2048)  # 0: one key, no merge (the fixed cost)
CTX = 8192
L2_BYTES = 60 << 20


def params(shape: str) -> AttentionParams:
    NH, NKV, D = SHAPES[shape]
    return AttentionParams(
        NH=NH, NKV=NKV, D=D, scale=D**-0.5, window=0, interleaved=False, norm_eps=0.0
    )


def specs(arch: str, shapes, forms) -> dict:
    return {
        (s, f): decode_attention(
            f"{s}_{f.replace(':', '_')}",
            params(s),
            GpuTarget(arch),
            ["att"],
            CTX,
            "bfloat16",
            form=f,
        )
        for s in shapes
        for f in forms
    }


def as_built(sp: dict) -> list:
    return [(k.fn, k.template, k.ctx, k.shared) for k in sp.values()]


def numpy_attention(qr, keys, vals, kn, vn) -> np.ndarray:
    """float64 attention of the query heads qr [NH, D] over the cached rows [n, NKV, D] and the
    new row (kn, vn: [NKV, D] bf16 bits)."""
    NH, D = qr.shape
    G = NH // keys.shape[1]
    kn, vn = ((x.astype(np.uint32) << 16).view(np.float32) for x in (kn, vn))
    K = np.concatenate([keys, kn[None]]).astype(np.float64)
    V = np.concatenate([vals, vn[None]]).astype(np.float64)
    want = np.empty((NH, D))
    for h in range(NH):
        sc = K[:, h // G] @ qr[h] * D**-0.5
        e = np.exp(sc - sc.max())
        want[h] = e @ V[:, h // G] / e.sum()
    return want


def graph_us(d, fn, grid, threads, shared, packed, overlap: bool) -> float:
    """us per launch of a graph of len(packed) back-to-back launches, one per argument set."""
    d.synchronize()
    d.begin_capture()
    for p in packed:
        d.launch(fn, grid, (threads, 1, 1), shared, p.address, overlap=overlap)
    ge = d.instantiate(d.end_capture())
    d.graph_launch(ge)
    d.synchronize()
    reps = 5
    t = time.perf_counter()
    for _ in range(reps):
        d.graph_launch(ge)
    d.synchronize()
    return (time.perf_counter() - t) / (reps * len(packed)) * 1e6


def bench(dev, sp: dict, shapes, forms, positions) -> list[str]:
    d = dev.d
    rows = []
    for s in shapes:
        NH, NKV, D = SHAPES[s]
        rng = np.random.default_rng(1)
        q = rng.standard_normal(NH * D).astype(np.float32)
        k = rng.standard_normal(NKV * D).astype(np.float32)
        v = rng.standard_normal(NKV * D).astype(np.float32)
        ang = rng.uniform(0, 2 * np.pi, (CTX, D // 2))
        cos_t, sin_t = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        qb, kb, vb, cb, sb = (dev.upload(x) for x in (q, k, v, cos_t, sin_t))
        seq0 = dev.upload(np.zeros(1, np.int32))
        table = dev.upload(np.arange(-(-CTX // KV_BLOCK), dtype=np.int32))  # block b at b
        for pos in positions:
            rows_n = -(-(pos + 1) // KV_BLOCK) * KV_BLOCK
            keys = round_bf16(rng.standard_normal((rows_n, NKV, D)).astype(np.float32))
            vals = round_bf16(rng.standard_normal((rows_n, NKV, D)).astype(np.float32))

            def bits(a):
                return (a.view(np.uint32) >> 16).astype(np.uint16)

            nbytes = keys.nbytes  # keys and values in bf16
            copies = min(512, max(64, -(-2 * L2_BYTES // nbytes)))
            caches = [(dev.upload(bits(keys)), dev.upload(bits(vals))) for _ in range(copies)]
            start = dev.upload(np.array([pos], np.int32))
            qr = rope(q.reshape(NH, D).astype(np.float64), cos_t[pos], sin_t[pos], False)

            for f in forms:
                spec = sp[s, f]
                partial = dev.poisoned(NH * spec.grid[1] * (D + 2))
                counters = dev.upload(np.zeros(NH, np.uint32))
                out = dev.poisoned(NH * D)
                fixed = [qb, kb, vb, start, seq0, table, 0, 0, cb, sb]
                packed = [
                    PackedArgs([("u64", a) for a in [*fixed, kc, vc, partial, counters, out]])
                    for kc, vc in caches
                ]
                fn = dev.function(spec.fn)  # (DeviceKernels opted it in to its shared bytes)
                grid = (spec.grid[0], spec.grid[1], 1)
                d.launch(fn, grid, (spec.threads, 1, 1), spec.shared, packed[0].address)
                got = dev.read(out, (NH, D))
                # row pos as the kernel stored it (its float32 RoPE may round the new key to
                # the neighbouring bf16)
                new = [dev.read(c + pos * NKV * D * 2, (NKV, D), np.uint16) for c in caches[0]]
                want = numpy_attention(qr, keys[:pos], vals[:pos], *new)
                err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                pdl = graph_us(d, fn, grid, spec.threads, spec.shared, packed, True)
                alone = graph_us(d, fn, grid, spec.threads, spec.shared, packed, False)
                bad = "" if err <= 1e-5 else f" WRONG ({err:.1e})"
                rows.append(
                    f"| {s} | {pos} | {f} | {spec.grid[0]}x{spec.grid[1]}x{spec.threads} | "
                    f"{pdl:.2f} | {alone:.2f} |{bad}"
                )
                print(rows[-1], flush=True)
            dev.free()
            qb, kb, vb, cb, sb = (dev.upload(x) for x in (q, k, v, cos_t, sin_t))
            seq0 = dev.upload(np.zeros(1, np.int32))
            table = dev.upload(np.arange(-(-CTX // KV_BLOCK), dtype=np.int32))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--positions", default=",".join(map(str, POSITIONS)))
    ap.add_argument("--cache", type=Path, help="code objects built ahead (--prebuild)")
    ap.add_argument("--prebuild", type=Path, help="build the code object for --arch into DIR")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shapes, forms = args.shapes.split(","), args.forms.split(",")
    positions = [int(x) for x in args.positions.split(",")]
    if args.prebuild:
        compiled(kernels_source(as_built(specs(args.arch, shapes, forms)), args.arch), args.arch,
                 args.prebuild)  # fmt: skip
        print(f"built into {args.prebuild}")
        return
    sp: dict = {}
    dev = DeviceKernels(lambda arch: as_built(sp.update(specs(arch, shapes, forms)) or sp),
                        cache=args.cache)  # fmt: skip
    head = [
        "| shape | position | form | grid x threads | us pdl | us alone |",
        "|---|---:|---|---|---:|---:|",
    ]
    rows = bench(dev, sp, shapes, forms, positions)
    dev.close()
    text = "\n".join(head + rows) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
