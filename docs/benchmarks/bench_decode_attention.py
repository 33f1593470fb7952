"""The decode attention kernels alone on one GPU: the batch-1 forms, or with --batch the batch
step's (see bench_batch below). Batch-1: every form (compiler/kernels/attention.py
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

    # the batch step's attention at 16, 32, 64 rows x contexts 256, 1024, 4096 (8B heads)
    python docs/benchmarks/bench_decode_attention.py --batch 16,32,64 --prebuild DIR
    python docs/benchmarks/bench_decode_attention.py --batch 16,32,64 --cache DIR --out FILE

--batch: the one-block-per-row kernels (attention.hip.j2: "head" one query head a block,
"g4" a KV head's group) against the split-context one (attention_batch.hip.j2) at each
splits count and a few geometries and load forms (BATCH_FORMS' comment; --forms picks them,
--shapes l8 | smol | q35, Qwen3.5's full attention, one shape a run), every row its own sequence at about the context (rows end
0..21 positions short of it), its blocks scattered over a pool; timed as a graph of launches
cycling over copies of the step's cache (different blocks of the pool: L2 holds none), with
programmatic launch as batch steps launch it, as TB/s of K and V read beside the device's
copy rate (a 1 GiB device-to-device copy, read + write, measured in the same run).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from hipc.base.launch_plan import KV_BLOCK  # noqa: E402
from hipc.compiler.kernels.attention import (  # noqa: E402
    ATTN_WAVES,
    BATCH_WAVES,
    AttentionParams,
    batch_attention,
    batch_splits,
    decode_attention,
    kv_context,
    prefill_signature,
)
from hipc.compiler.kernels.base import GPU_INDENT  # noqa: E402
from hipc.compiler.reference.executor import round_bf16  # noqa: E402
from hipc.compiler.targets import GpuTarget  # noqa: E402
from hipc.runtime.backends.gpu_common import PackedArgs  # noqa: E402

from gpu_kernels import DeviceKernels, compiled, kernels_source, rope  # noqa: E402

SHAPES = {"l8": (32, 8, 128), "smol": (9, 3, 64)}
# --batch also: Qwen3.5's full-attention layers (16 / 2 heads of 256)
BATCH_SHAPES = {**SHAPES, "q35": (16, 2, 256)}
# the tile form's default first (1 lane per score, 64-key tiles, 512 blocks, 16-block merge
# steps), then the other forms and the tile geometries it was chosen over
FORMS = (
    "tile", "head", "gqa", "tile:b128", "tile:b256", "tile:l4", "tile:m8", "tile:k32",
)  # fmt: skip
POSITIONS = (0, 128, 512, 2048)  # 0: one key, no merge (the fixed cost)
CTX = 8192
L2_BYTES = 60 << 20


def params(shape: str) -> AttentionParams:
    NH, NKV, D = BATCH_SHAPES[shape]
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


# the batch step's forms: the one-block-per-row kernels, then the split one as
# {sN|d}[wW][uU][p][q][bB][rR] (N splits, or d: the splits batch_splits picks for the step's
# rows; W waves a block, U loads in flight per lane, the defaults where not named; p: pipelined,
# the next pass's loads issued before this pass's math; q: q read from shared memory; B: at
# least B blocks an SM in the launch bounds; R: a ring of R passes in shared memory)
BATCH_FORMS = (
    "head", "g4", "s1", "s2", "s4", "s8", "s16", "s2w8u4", "s4w8u4", "s2u4", "s4u4",
)  # fmt: skip
BATCH_CONTEXTS = (256, 1024, 4096)
FORM = re.compile(r"(s\d+|d)(?:w(\d+))?(?:u(\d+))?(p?)(q?)(?:b(\d+))?(?:r(\d+))?")


def form_key(f: str, rows: int, NKV: int) -> str:
    """batch_specs' key of form f at a step of `rows` rows (a d form's splits follow the rows)."""
    return f"{f}:{batch_splits(rows, NKV)}" if f.startswith("d") else f


def batch_specs(arch: str, shape: str, forms, rows_list=(1,)) -> dict:
    """form_key -> (fn, template, ctx, splits or 0, threads) of the batch step's kernels."""
    p, target = params(shape), GpuTarget(arch)
    kv_ctx = kv_context("bfloat16", CTX)
    out = {}
    for f in forms:
        if f in ("head", "g4"):
            G = 1 if f == "head" else p.NH // p.NKV
            ctx = dict(nodes=["att"], waves=ATTN_WAVES, group=G, wave=target.wave,
                       params=prefill_signature(kv_ctx["kv_type"]).render(GPU_INDENT),
                       **kv_ctx, **p.context())  # fmt: skip
            out[f] = (f"{shape}_b{f}", "attention", ctx, 0, ATTN_WAVES * target.wave)
            continue
        sn, waves, unroll, pipe, q_shared, min_blocks, ring = FORM.fullmatch(f).groups()
        each = [int(sn[1:])] if sn != "d" else sorted({batch_splits(R, p.NKV) for R in rows_list})
        for splits in each:
            k = batch_attention(f"{shape}_{f}_{splits}", p, target, ["att"], CTX, "bfloat16",
                                splits, waves=int(waves or BATCH_WAVES),
                                unroll=int(unroll) if unroll else None, pipe=bool(pipe),
                                q_shared=bool(q_shared),
                                min_blocks=int(min_blocks or 0),
                                ring=int(ring or 0))  # fmt: skip
            key = f if sn != "d" else f"{f}:{splits}"
            out[key] = (k.fn, k.template, k.ctx, splits, k.threads)
    return out


def batch_reference(q, pos, tables, t, kp, vp, cos_t, sin_t, NH, NKV, D) -> np.ndarray:
    """float64 attention of row t (query q[t], rotated at pos[t]) over its positions 0..pos[t]
    of the pools kp, vp [slots, NKV, D] (bf16 bits) through its block table."""
    c = np.arange(pos[t] + 1)
    slots = tables[t, c // KV_BLOCK] * KV_BLOCK + c % KV_BLOCK
    K, V = (((a[slots].astype(np.uint32) << 16).view(np.float32)).astype(np.float64)
            for a in (kp, vp))  # fmt: skip
    qr = rope(q[t].reshape(NH, D).astype(np.float64), cos_t[pos[t]], sin_t[pos[t]], False)
    G = NH // NKV
    sc = np.einsum("kgd,nkd->kgn", qr.reshape(NKV, G, D), K) * D**-0.5
    e = np.exp(sc - sc.max(-1, keepdims=True))
    return (np.einsum("kgn,nkd->kgd", e, V) / e.sum(-1)[..., None]).reshape(NH * D)


def bench_batch(dev, sp: dict, shape: str, forms, rows_list, contexts, copy: float) -> list:
    """Each (rows, context, form): checked against NumPy on a few rows, then timed."""
    d = dev.d
    NH, NKV, D = BATCH_SHAPES[shape]
    rng = np.random.default_rng(2)
    row_bytes = NKV * D * 2  # a position's keys (or values) of every KV head
    # copies of each step's cache, enough that L2 holds none; one pool for every case
    steps = [(R, C, max(1, min(16, -(-2 * L2_BYTES // (2 * R * C * row_bytes)))))
             for R in rows_list for C in contexts]  # fmt: skip
    pool_blocks = max(n * R * -(-C // KV_BLOCK) for R, C, n in steps)
    base = round_bf16(rng.standard_normal(1 << 22).astype(np.float32))
    base = (base.view(np.uint32) >> 16).astype(np.uint16)
    kp = np.resize(base, (pool_blocks * KV_BLOCK, NKV, D))
    vp = np.resize(base[::-1], (pool_blocks * KV_BLOCK, NKV, D))
    kb, vb = dev.upload(kp), dev.upload(vp)
    ang = rng.uniform(0, 2 * np.pi, (CTX, D // 2))
    cos_t, sin_t = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    cb, sb = dev.upload(cos_t), dev.upload(sin_t)
    table_len = -(-CTX // KV_BLOCK)
    rows = []
    for R, C, n in steps:
        q = rng.standard_normal((R, NH * D)).astype(np.float32)
        pos = (C - 1 - np.arange(R) * 3 % 22).astype(np.int32)
        seq = np.arange(R, dtype=np.int32)
        nbytes = 2 * int((pos + 1).sum()) * row_bytes
        perm = rng.permutation(pool_blocks)
        tables = []
        for c in range(n):  # copy c: its rows' blocks scattered over its share of the pool
            tb = np.zeros((R, table_len), np.int32)
            nb = -(-C // KV_BLOCK)
            tb[:, :nb] = perm[c * R * nb : (c + 1) * R * nb].reshape(R, -1)
            tables.append(tb)
        qb, pb, seqb = dev.upload(q), dev.upload(pos), dev.upload(seq)
        tbs = [dev.upload(tb) for tb in tables]
        check = sorted({0, R // 2, R - 1})
        want = [batch_reference(q, pos, tables[0], t, kp, vp, cos_t, sin_t, NH, NKV, D)
                for t in check]  # fmt: skip
        for f in forms:
            fn_name, _, _, splits, threads = sp[form_key(f, R, NKV)]
            out = dev.poisoned(R * NH * D)
            # the prefill signature's, the split one's partials and counters before out
            tail = [("u64", a) for a in (0, cb, sb, kb, vb)]
            if splits:
                partial = dev.poisoned(R * NH * splits * (D + 2))
                counters = dev.upload(np.zeros(R * NKV, np.uint32))
                tail += [("u64", partial), ("u64", counters)]
                grid = (R, NKV * splits, 1)
            else:
                grid = (R, NH if f == "head" else NKV, 1)
            packed = [
                PackedArgs([("u64", qb), ("i32", NH * D), ("u64", pb), ("u64", seqb),
                            ("u64", tb), *tail, ("u64", out)])
                for tb in tbs * max(1, -(-8 // n))
            ]  # fmt: skip
            fn = dev.function(fn_name)
            d.launch(fn, grid, (threads, 1, 1), 0, packed[0].address)
            got = dev.read(out, (R, NH * D))
            err = max(float(np.max(np.abs(got[t] - w)) / np.max(np.abs(w)))
                      for t, w in zip(check, want, strict=True))  # fmt: skip
            us = graph_us(d, fn, grid, threads, 0, packed, True)
            bad = "" if err <= 1e-5 else f" WRONG ({err:.1e})"
            tbs_ = nbytes / us / 1e6
            rows.append((R, C, f, us, tbs_, bad))
            print(f"| {shape} | {R} | {C} | {f} | {grid[0]}x{grid[1]}x{threads} | {us:.1f} | "
                  f"{tbs_:.2f} | {tbs_ / copy:.0%} |{bad}", flush=True)  # fmt: skip
    return rows


def batch_main(args) -> None:
    shape = args.shapes.split(",")[0] if args.shapes != ",".join(SHAPES) else "l8"
    forms = args.forms.split(",") if args.forms != ",".join(FORMS) else list(BATCH_FORMS)
    rows_list = [int(x) for x in args.batch.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.prebuild:
        specs = [(*v[:3], 0) for v in batch_specs(args.arch, shape, forms, rows_list).values()]
        compiled(kernels_source(specs, args.arch), args.arch, args.prebuild)
        print(f"built into {args.prebuild}")
        return
    sp: dict = {}

    def build(arch):
        sp.update(batch_specs(arch, shape, forms, rows_list))
        return [(*v[:3], 0) for v in sp.values()]

    dev = DeviceKernels(build, cache=args.cache)
    copy = copy_rate(dev.d)
    print(f"device copy: {copy:.2f} TB/s (read + write)", flush=True)
    head = ["| shape | rows | context | form | grid x threads | us | TB/s K+V | of copy |",
            "|---|---:|---:|---|---|---:|---:|---:|"]  # fmt: skip
    rows = bench_batch(dev, sp, shape, forms, rows_list, contexts, copy)
    dev.close()
    # the summary: each form's us (TB/s) a case, the best, and the first form's us over the best's
    summary = [f"{shape}: device copy {copy:.2f} TB/s; us per launch (TB/s of K+V); "
               f"x: {forms[0]} over the best",
               f"| rows | context | {' | '.join(forms)} | best | x |",
               "|---:|---:|" + "---:|" * len(forms) + "---|---:|"]  # fmt: skip
    for R in rows_list:
        for C in contexts:
            mine = {f: (us, tb) for r, c, f, us, tb, bad in rows if (r, c) == (R, C) and not bad}
            if not mine:
                continue
            best = min(mine, key=lambda f: mine[f][0])
            cells = [f"{mine[f][0]:.1f} ({mine[f][1]:.2f})" if f in mine else "WRONG"
                     for f in forms]  # fmt: skip
            ref = mine.get(forms[0], (float("nan"), 0))[0]
            summary.append(f"| {R} | {C} | {' | '.join(cells)} | {best} | "
                           f"{ref / mine[best][0]:.2f} |")  # fmt: skip
    text = "\n".join(head + [
        f"| {shape} | {r} | {c} | {f} | | {us:.1f} | {tb:.2f} | {tb / copy:.0%} |{bad}"
        for r, c, f, us, tb, bad in rows] + [""] + summary) + "\n"  # fmt: skip
    if args.out:
        args.out.write_text(text)
    print("\n".join(summary))


def copy_rate(d) -> float:
    """TB/s of a 1 GiB device-to-device copy (read + write), timed over 5 copies."""
    n = 1 << 30
    a, b = d.malloc(n), d.malloc(n)
    d.d2d(b, a, n)
    d.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        d.d2d(b, a, n)
    d.synchronize()
    rate = 2 * n * 5 / (time.perf_counter() - t) / 1e12
    d.free(a)
    d.free(b)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--positions", default=",".join(map(str, POSITIONS)))
    ap.add_argument("--cache", type=Path, help="code objects built ahead (--prebuild)")
    ap.add_argument("--prebuild", type=Path, help="build the code object for --arch into DIR")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--batch", help="the batch step's attention at these row counts")
    ap.add_argument("--contexts", default=",".join(map(str, BATCH_CONTEXTS)))
    args = ap.parse_args()
    if args.batch:
        batch_main(args)
        return
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
