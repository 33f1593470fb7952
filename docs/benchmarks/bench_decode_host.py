"""Where a batch-1 decode step's time goes outside its graph: host work, copies, wake-ups.

    python docs/benchmarks/bench_decode_host.py ARTIFACT [--steps 300] [--position 64]
    python docs/benchmarks/bench_decode_host.py --layers 4 --model l8_q4_0 --work DIR

The second form writes a Llama-3-8B-shaped GGUF with --layers layers (bench_gpu_quant's random
blocks in llama-quantize's types) and compiles it first: the host's share of a step does not
depend on the depth, and a short model compiles in seconds.

Each row is microseconds per step at --position (the median of three runs of --steps steps),
the rows adding one piece each:
  graph back to back    the decode graph replayed with no host in between
  graph, wait           one replay then a wait for it (launch latency and wake-up)
  + inputs, logits      the runtime's copies around it as separate driver calls
  logits in the graph   the same with the logits copy captured into the graph
  backend, view         GpuBackend.submit + collect(copy=False)
  backend, copy         GpuBackend.forward (a copy of the row out of the pinned buffer)
  engine forward        CompiledEngine.forward([token], position)
  engine forward, view  the same with copy=False: bench_gpu.py's decode loop
  engine argmax         submit(argmax=True) + collect_argmax: hipc generate's greedy step
  ... pipelined         the same with the next step queued before each collect (submit_next,
                        the pick fed on the device): hipc generate's greedy loop
  engine draw ...       that loop drawing each token at temperature 0.8 on the device
  row copy alone        one row of logits copied out of the pinned buffer
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def per_step_us(fn, steps: int, after=None) -> float:
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        if after:
            after()
        runs.append((time.perf_counter() - t) / steps * 1e6)
    return statistics.median(runs)


def build(layers: int, model: str, work: Path) -> Path:
    sys.path.insert(0, str(HERE))
    import bench_gpu_quant as q

    work.mkdir(parents=True, exist_ok=True)
    q.L8 = {**q.L8, "L": layers}
    gguf_path, art = work / f"{model}-{layers}.gguf", work / f"{model}-{layers}.hipc"
    q.write_l8(gguf_path, model)
    cmd = [sys.executable, "-m", "hipc.cli.main", "compile", str(gguf_path), "--target", "sm_90"]
    subprocess.run([*cmd, "--activations", "int8", "-o", str(art), "-q"], check=True)
    gguf_path.unlink()
    return art


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", nargs="?", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model", default="l8_q4_0")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-host"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--position", type=int, default=64)
    args = ap.parse_args()
    from hipc.runtime.engine import load_engine

    art = args.artifact or build(args.layers, args.model, args.work)
    eng = load_engine(art, target="cuda")
    b, n, pos = eng.backend, args.steps, args.position
    d = b._driver
    ids = np.random.default_rng(0).integers(0, eng.vocab_size, pos).tolist()
    eng.forward(ids, 0)
    b.forward(np.array([5]), pos, False)  # the decode graph, captured
    exe = b._graphs[("decode", 1)][1]
    row = 4 * b.vocab
    one = np.array([5])

    def copies():
        d.h2d(b.bases.ids, b._inputs_addr, b._inputs_host.nbytes)
        d.graph_launch(exe)
        d.d2h(b._logits_addr, b.bases.logits, row)
        d.synchronize()

    d.synchronize()
    d.begin_capture()
    for launch in b.gpu.decode:
        b._launch(launch, launch.grid_dims(1, 1), b._pack(launch, 1, 1))
    d.d2h(b._logits_addr, b.bases.logits, row)
    graph = d.end_capture()
    with_d2h = d.instantiate(graph)

    def in_graph():
        d.h2d(b.bases.ids, b._inputs_addr, b._inputs_host.nbytes)
        d.graph_launch(with_d2h)
        d.synchronize()

    def view():
        b.submit(one, pos, False)
        b.collect(copy=False)

    def argmax():
        eng.submit([5], pos, argmax=True)
        eng.collect_argmax()

    def pipelined(inv_t: float = 0.0) -> float:  # hipc generate's loop: steps queued ahead
        if not (eng.can_draw if inv_t else eng.can_submit_next):
            return float("nan")
        extra = (lambda: {"draw": (inv_t, 0.5)}) if inv_t else dict
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            eng.submit([5], pos, argmax=True, **extra())
            for p in range(pos + 1, pos + n):
                eng.submit_next(p, **extra())
                eng.collect_argmax()
            eng.collect_argmax()
            runs.append((time.perf_counter() - t) / n * 1e6)
        return statistics.median(runs)

    rows = [
        ("graph back to back", per_step_us(lambda: d.graph_launch(exe), n, d.synchronize)),
        ("graph, wait", per_step_us(lambda: (d.graph_launch(exe), d.synchronize()), n)),
        ("+ inputs, logits", per_step_us(copies, n)),
        ("logits in the graph", per_step_us(in_graph, n)),
        ("backend, view", per_step_us(view, n)),
        ("backend, copy", per_step_us(lambda: b.forward(one, pos, False), n)),
        ("engine forward", per_step_us(lambda: eng.forward([5], pos), n)),
        ("engine forward, view", per_step_us(lambda: eng.forward([5], pos, copy=False), n)),
        ("engine argmax", per_step_us(argmax, n)),
        ("engine argmax, pipelined", pipelined()),
        ("engine draw at T 0.8, pipelined", pipelined(1 / 0.8)),
        ("row copy alone", per_step_us(lambda: b._logits_host[0:1].copy(), n)),
    ]
    d.destroy_graph(graph, with_d2h)
    eng.close()
    print(f"{art.name}: {len(b.gpu.decode)} launches a step, position {pos}, {n} steps a run")
    print("| step | us |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:,.1f} |")


if __name__ == "__main__":
    main()
