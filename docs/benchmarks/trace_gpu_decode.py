"""A timeline of the decode graph as it runs on an NVIDIA GPU: when each kernel's blocks arrive,
are released by the kernel before, and finish.

    python docs/benchmarks/trace_gpu_decode.py ARTIFACT [--position 64] [--replays 20]

The artifact's program is compiled again with HIPC_TRACE (prelude.h: thread 0 of each block
stores globaltimer at its arrival at hipc_wait_prior() and at its release, in release order; the
quantized GEMVs also mark when each block's last wave is done), loaded in place of the artifact's
kernels, and the decode graph captured as the runtime captures it (programmatic launches where
marked) is replayed. A kernel's blocks are released only once the kernel before has finished,
so the records fall into one run per launch, matched to the launch list in order. Per kernel kind
(the mean over its launches and the replays, us):

- run: from the release of its first block (the kernel before done) to the release of the next
  kernel's first block (this one done): its share of the step, boundaries included;
- early: how long before that release its blocks arrived, the median block (the overlap
  programmatic launch gave it: its loads before the wait issued while the kernel before ran);
- late: how long after the release its last block arrived (blocks that found no room on an SM
  before the kernel before drained). A block arrives at hipc_wait_prior(), so after issuing
  the loads it makes before its wait (a GEMV's ring);
- work: the release to its blocks' last wave done (the kernels with a hipc_trace_scope: the
  quantized GEMVs, the per-head decode attention), so run - work is the time between its work
  and the next kernel's release;
- m0, m1, m2: the release to the last block's marks (hipc_trace_mark: the decode attention's q
  rotated, first tile's scores, values summed), where a kernel has them.

globaltimer ticks in 32 ns steps on recent GPUs; means over 32 layers and the replays resolve
below that. The trace's own cost is one atomic and a few stores a block.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from itertools import pairwise

import numpy as np
from profile_gpu_decode import kind_of  # this folder (sys.path[0] when run as a script)

from hipc.runtime.engine import load_engine

RECORDS = 1 << 16  # records per replay (blocks that reach hipc_wait_prior)
WORDS = 8  # per record (prelude: HIPC_TRACE_WORDS)


def traced_module(eng) -> tuple[int, int, int]:
    """Compile the artifact's program with HIPC_TRACE and point the engine's kernels at it;
    the addresses of its record count and records, and the records' bytes."""
    from hipc.compiler.toolchains.gpu import gpu_toolchain

    b = eng.backend
    arch = b.gpu.target
    info = eng.artifact.manifest["targets"][arch]
    source = eng.artifact.file(info["source"]).read_text()
    image = gpu_toolchain(arch).compile(f"#define HIPC_TRACE {RECORDS}\n" + source)
    b._driver.load_module(image)
    b._functions = b._load_functions(eng.artifact.file(info["code_object"]))
    d = b._driver
    n_ptr, _ = d._call("cuModuleGetGlobal", d._module, b"hipc_trace_n")
    buf_ptr, nbytes = d._call("cuModuleGetGlobal", d._module, b"hipc_trace")
    return int(n_ptr), int(buf_ptr), int(nbytes)


def segments(rec: np.ndarray) -> list[np.ndarray]:
    """The records (release order) cut into one run per launch: a new run where the grid size
    changes or a block index repeats."""
    out, start, seen = [], 0, set()
    for i, r in enumerate(rec):
        block = int(r[3]) & 0xFFFFFFFF
        if i > start and (r[2] != rec[start][2] or block in seen):
            out.append(rec[start:i])
            start, seen = i, set()
        seen.add(block)
    out.append(rec[start:])
    return out


def read_trace(eng, graph_exec, trace: tuple[int, int, int]) -> np.ndarray:
    """One replay's records: (arrived, released, grid size, SM << 32 | block, done, mark 0-2)
    as int64."""
    d = eng.backend._driver
    n_ptr, buf_ptr, nbytes = trace
    d.synchronize()
    d.memset0(n_ptr, 4)
    d.memset0(buf_ptr, nbytes)
    d.graph_launch(graph_exec)
    n = np.zeros(1, np.uint32)
    d.d2h(n.ctypes.data, n_ptr, 4)
    d.synchronize()
    rec = np.zeros((min(int(n[0]), RECORDS), WORDS), np.uint64)
    d.d2h(rec.ctypes.data, buf_ptr, rec.nbytes)
    d.synchronize()
    return rec.astype(np.int64)


def match(launches, runs: list[np.ndarray]) -> list[np.ndarray | None]:
    """Each launch's run of records (None for a launch none of whose blocks waited)."""
    out, k = [], 0
    for launch in launches:
        g = launch.grid_dims(1, 1)
        size = g[0] * g[1] * g[2]
        if k < len(runs) and int(runs[k][0][2]) == size:
            out.append(runs[k])
            k += 1
        else:
            out.append(None)
    if k != len(runs):
        raise SystemExit(f"trace: {len(runs)} runs of records for {k} matched launches")
    return out


def summarize(launches, replays: list[list[np.ndarray | None]]) -> None:
    stats: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    steps = []
    for runs in replays:
        timed = [(x, r) for x, r in zip(launches, runs, strict=True) if r is not None]
        steps.append((timed[-1][1][:, 1].min() - timed[0][1][:, 1].min()) / 1e3)
        for (launch, r), (_, nxt) in pairwise(timed):
            s = stats[kind_of(launch.kernel)]
            release = r[:, 1].min()
            s["run"].append((nxt[:, 1].min() - release) / 1e3)
            s["early"].append((release - np.median(r[:, 0])) / 1e3)
            s["late"].append((r[:, 0].max() - release) / 1e3)
            if r[:, 4].max() > 0:
                s["work"].append((r[:, 4].max() - release) / 1e3)
            for k in range(3):
                if r[:, 5 + k].max() > 0:
                    s[f"m{k}"].append((r[:, 5 + k].max() - release) / 1e3)
    print(
        f"first release to last release: {np.median(steps):.1f} us a step (median of {len(steps)})"
    )
    marks = ("m0", "m1", "m2")
    print(
        f"{'kind':48s} {'n':>4s} {'run':>7s} {'early':>7s} {'late':>7s} {'work':>7s}"
        + "".join(f" {m:>7s}" for m in marks)
        + "  (us)"
    )
    total = 0.0
    for kind, s in sorted(stats.items(), key=lambda kv: -sum(kv[1]["run"])):
        n = len(s["run"]) // len(replays)
        mean = {k: float(np.mean(v)) if v else float("nan") for k, v in s.items()}
        total += mean["run"] * n
        print(
            f"{kind:48s} {n:4d} {mean['run']:7.2f} {mean['early']:7.2f} {mean['late']:7.2f} "
            f"{mean.get('work', float('nan')):7.2f}"
            + "".join(f" {mean.get(m, float('nan')):7.2f}" for m in marks)
        )
    print(f"sum of runs: {total:.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--position", type=int, default=64)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    eng = load_engine(args.artifact, target="cuda")
    b = eng.backend
    eng.forward(np.random.default_rng(0).integers(0, eng.vocab_size, args.position).tolist(), 0)
    trace = traced_module(eng)
    b.forward(np.array([5]), args.position, False)  # the step's inputs on the device
    launches = b.gpu.decode
    b._capture(("trace", 1), launches, 1, 1)
    graph, exe, _ = b._graphs.pop(("trace", 1))
    for _ in range(5):
        b._driver.graph_launch(exe)
    replays = [match(launches, segments(read_trace(eng, exe, trace))) for _ in range(args.replays)]
    b._driver.destroy_graph(graph, exe)
    summarize(launches, replays)


if __name__ == "__main__":
    main()
