"""Where a GPU decode (or prefill) step's time goes: each launch of the step timed alone.

    python docs/benchmarks/profile_gpu_decode.py ARTIFACT [--position 512] [--prefill T [--start S]]
    python docs/benchmarks/profile_gpu_decode.py ARTIFACT --batch R [--position 256]
    python docs/benchmarks/profile_gpu_decode.py ARTIFACT --ablate [--position 64] [--swap KIND=GEOMETRY ...]

Runs the step's launch list with a CUDA event between launches, captured into one graph (no
host in between), so each kernel's GPU time is measured without launch overhead; prints the
time per kernel kind, then the whole step. --prefill T: a T-token prefill step from position
--start (0; the cache filled before it) instead of a decode step at --position (the last token's
logits only, as a prompt runs; the launches marked to overlap run back to back here, so their
overlap is not counted). --batch R: a batch step of R sequences (one row each, all at
--position; the launch list of the bucket that holds R rows, as the batching engine steps it).
--ablate: each kernel kind's cost inside the decode graph as it runs (launches overlapping):
the graph replayed whole, then once without each kind's launches (the numbers are garbage
then, the time is not), so a kind's cost is the difference, boundaries and overlap included.
--swap KIND=GEOMETRY (with --ablate, repeatable): the graph with that kind's quantized GEMVs
rendered in another geometry (gemv_swap.py), one model compile for many geometries.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from hipc.runtime.engine import load_engine


def _is_hash(part: str) -> bool:
    return len(part) == 6 and all(c in "0123456789abcdef" for c in part)


def kind_of(kernel: str) -> str:
    """A kernel's name without its specialization hash (linear_q4_0_6144x4096_none_gemv)."""
    return "_".join(p for p in kernel.split("_") if not _is_hash(p))


def batch_step(b, rows: int, position: int):
    """A step of `rows` sequences at `position` (each its own blocks), as a function that runs
    it (the bucket's captured graph, the logits copied back)."""
    blocks = position // b.kv_block + 1
    if rows * blocks > b.kv_blocks:
        raise SystemExit(
            f"--batch {rows} at {position}: {rows * blocks} KV blocks, the pool has {b.kv_blocks}"
        )
    tables = np.zeros((rows, b.kv_table), np.int32)
    tables[:, :blocks] = np.arange(rows * blocks).reshape(rows, blocks)
    ids = np.random.default_rng(0).integers(0, b.vocab, rows)
    pos = np.full(rows, position, np.int32)
    return lambda: b.step(ids, pos, np.arange(rows, dtype=np.int32), tables, np.arange(rows))


def kernel_times(
    eng, position: int, prefill: int = 0, reps: int = 5, start: int = 0, batch: int = 0
) -> tuple[dict, list]:
    """Seconds per step by kernel kind (the name without its specialization hash), and the
    launch list: a decode step at `position` (or a `prefill`-token prefill step from `start`,
    or a `batch`-row batch step), each launch timed alone by CUDA events captured between
    launches."""
    b = eng.backend
    T = prefill or 1
    ids = np.random.default_rng(0).integers(0, eng.vocab_size, max(position, start + T)).tolist()
    rows = 1
    if batch:
        batch_step(b, batch, position)()  # leaves the step's inputs on the device
        T = rows = next(k for k in b.buckets if k >= batch)
        launches = b.gpu.batch(T)
    elif prefill:
        if start:
            eng.forward(ids[:start], 0)
        eng.forward(ids[start : start + T], start)  # leaves the step's inputs on the device
        launches = b.gpu.launches(T)
    else:
        eng.forward(ids, 0)
        b.forward(np.array([5]), position, False)  # captures the graph
        launches = b.gpu.decode
    d = b._driver
    from cuda.bindings import driver as cu

    # Event records captured into a graph between the kernels: the GPU runs them back to
    # back (no host in between), and each gap is one kernel's time.
    events = [cu.cuEventCreate(0)[1] for _ in range(len(launches) + 1)]
    packed = [b._pack(launch, T, rows) for launch in launches]
    external = cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL
    d.synchronize()
    d.begin_capture()
    cu.cuEventRecordWithFlags(events[0], d._stream, external)
    for k, launch in enumerate(launches):
        b._launch(launch, launch.grid_dims(T, rows), packed[k])
        cu.cuEventRecordWithFlags(events[k + 1], d._stream, external)
    timed = d.instantiate(d.end_capture())
    per_kind: dict[str, float] = defaultdict(float)
    for _ in range(reps):
        d.graph_launch(timed)
        d.synchronize()
        for k, launch in enumerate(launches):
            ms = cu.cuEventElapsedTime(events[k], events[k + 1])[1]
            # the kernel's name without its specialization hash (linear_q4_0_6144x4096_none_gemv)
            shape = kind_of(launch.kernel)
            per_kind[shape] += ms / 1e3 / reps
    d.destroy_graph(None, timed)
    for e in events:
        cu.cuEventDestroy(e)
    return per_kind, launches


def replay_ms(eng, position: int, n: int = 50) -> tuple[float, float]:
    """ms per decode step: the runtime's replay with its copies (the logits back), and the
    captured graph alone (kernels launched to overlap, as decode runs them)."""
    b, d = eng.backend, eng.backend._driver
    t = time.perf_counter()
    for i in range(n):
        b.forward(np.array([5]), position + 1 + i, False)
    with_copies = (time.perf_counter() - t) / n * 1e3
    d.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        d.graph_launch(b._graphs[("decode", 1)][1])
    d.synchronize()
    return with_copies, (time.perf_counter() - t) / n * 1e3


def graph_ms(eng, launches, n: int = 100) -> float:
    """ms per replay of a graph of `launches` (a decode step's, at the inputs left on the
    device), captured as the runtime captures decode (programmatic launches where marked)."""
    b, d = eng.backend, eng.backend._driver
    d.synchronize()
    b._capture(("profile", 1), launches, 1, 1)
    graph, exe, _ = b._graphs.pop(("profile", 1))
    for _ in range(5):
        d.graph_launch(exe)
    d.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        d.graph_launch(exe)
    d.synchronize()
    ms = (time.perf_counter() - t) / n * 1e3
    d.destroy_graph(graph, exe)
    return ms


def ablate(eng, position: int, swaps: list[str] = ()) -> None:
    """Each kernel kind's cost in the decode graph: the whole graph's replay time less the
    graph's without that kind's launches (the median of three); then the graph with each of
    `swaps` (KIND=GEOMETRY: that kind's GEMVs in another geometry, gemv_swap.py)."""
    eng.forward(np.random.default_rng(0).integers(0, eng.vocab_size, position).tolist(), 0)
    eng.backend.forward(np.array([5]), position, False)  # the step's inputs on the device
    launches = eng.backend.gpu.decode

    kinds = sorted({kind_of(x.kernel) for x in launches})
    whole = sorted(graph_ms(eng, launches) for _ in range(3))[1]
    print(f"decode graph at position {position}: {whole:.3f} ms ({len(launches)} launches)")
    for k in kinds:
        rest = [x for x in launches if kind_of(x.kernel) != k]
        without = sorted(graph_ms(eng, rest) for _ in range(3))[1]
        n = len(launches) - len(rest)
        print(
            f"{k:48s} {whole - without:7.3f} ms in the graph "
            f"({n} launches, {(whole - without) / n * 1e3:6.2f} us each)"
        )
    from gemv_swap import parse_swap, swapped  # this folder (sys.path[0] when run as a script)

    for text in swaps:
        kind, geometry, next_mb = parse_swap(text)
        variant = swapped(eng, launches, kind, geometry, next_mb)
        ms = sorted(graph_ms(eng, variant) for _ in range(3))[1]
        print(f"swap {text}: {ms:.3f} ms ({(ms - whole) * 1e3:+.1f} us a step)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--position", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=0, metavar="T", help="profile a T-token prefill")
    ap.add_argument("--start", type=int, default=0, help="the prefill step's first position")
    ap.add_argument("--batch", type=int, default=0, metavar="R", help="profile an R-row batch step")
    ap.add_argument("--ablate", action="store_true", help="each kind's cost in the decode graph")
    ap.add_argument("--swap", action="append", default=[], metavar="KIND=GEOMETRY",
                    help="--ablate: also time the graph with KIND's GEMVs in GEOMETRY "
                    "(waves,rows,unroll,max_blocks,min_blocks,stages,xq_chunk[,k64][,pN][,r]); repeatable")  # fmt: skip
    args = ap.parse_args()
    if args.ablate:
        ablate(load_engine(args.artifact, target="cuda"), args.position, args.swap)
        return
    # a batch's sequences each need their own blocks (the pool's default is one sequence)
    pool = args.batch * (args.position + 64) if args.batch else None
    eng = load_engine(args.artifact, target="cuda", kv_pool_tokens=pool)
    per_kind, launches = kernel_times(
        eng, args.position, args.prefill, start=args.start, batch=args.batch
    )
    for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"{k:48s} {v * 1e3:8.3f} ms per step")
    print(f"sum of kernel times (back to back): {sum(per_kind.values()) * 1e3:.3f} ms")
    print(f"{len(launches)} launches")
    if args.batch:
        step, n = batch_step(eng.backend, args.batch, args.position), 20
        step()
        t = time.perf_counter()
        for _ in range(n):
            step()
        ms = (time.perf_counter() - t) / n * 1e3
        print(
            f"the {args.batch}-row step as the runtime replays it (logits copied back): {ms:.3f} ms"
        )
        return
    if args.prefill:
        T, n = args.prefill, 10
        ids = np.random.default_rng(0).integers(0, eng.vocab_size, T).tolist()
        t = time.perf_counter()
        for _ in range(n):
            eng.forward(ids, args.start)
        print(f"the step as the runtime launches it: {(time.perf_counter() - t) / n * 1e3:.3f} ms")
        return
    with_copies, alone = replay_ms(eng, args.position)
    print(f"graph replay incl. copies: {with_copies:.3f} ms per step")
    print(f"graph replay alone: {alone:.3f} ms per step")


if __name__ == "__main__":
    main()
