"""hipc vs llama.cpp decode on one GGUF (written for MoE and hybrid shapes; any file llama-bench
reads serves, the real SmolLM2 too: cpu-amd-epyc.md), CPU, same threads, rounds alternating.

    python docs/benchmarks/bench_cpu_moe.py --llama-bench /path/to/llama-bench \
        [--gguf FILE | [--writer hybrid] --preset cpu-0.7b --type q4_0] [--artifact PATH] \
        [--threads 2] [--tokens 64] [--rounds 5] [--prefill-tokens 128] [--depth 1024]
        [--out docs/benchmarks/cpu-moe.md]

Without --gguf the model is a random-weight GGUF (write_moe_gguf.py, or with --writer hybrid
write_hybrid_gguf.py's Qwen3.5 shapes, writes it when --gguf is not given);
hipc compiles that same file for the CPU target (unless --artifact names a compiled one).

Each round runs, one after the other (A B A B ..., so both see the same background load):
  * llama.cpp: `llama-bench -m FILE -p 0 -n TOKENS -t THREADS -r 1 -o json` (its own
    one-token warm-up, then TOKENS single-token decode steps from an empty context);
  * hipc: the compiled engine in this process, TOKENS single-token forward calls from
    position 0, the argmax fed back (one warm-up pass before the first round, and as
    llama-bench, one untimed token before each timed run).
With --prefill-tokens P each round also times one P-token forward: llama-bench `-p P -n 0
--repack 0` (its default weight repacking dies of SIGILL in prompt processing on this AMX
machine; decode runs with the repacking, its faster setting here) and hipc's forward of P
random token ids from position 0, each after an untimed run of the same prompt (llama-bench's
warm-up: without it hipc's prefill, timed right after llama-bench's process, read ~20% low).
With --depth N the decode runs after an N-token prompt (llama-bench `-d N`; hipc prefills N
random ids untimed, then decodes from position N): the attention over a long context.
Reported: decode tokens/s by the wall clock (median and best over rounds), and by CPU
time: tokens per second of the process's CPU time, for llama.cpp the difference of the
CPU time of a `-n TOKENS+1` and a `-n 1` run (load and warm-up cancel). With --threads 1
the CPU-time figures measure the work itself, whatever else runs on the machine; with
more threads they also count spinning at barriers, and the wall clock is the measure.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def llama_bench(
    binary: str, gguf: Path, tokens: int, threads: int, prompt: int = 0, depth: int = 0
) -> tuple[float, float]:
    """(tok/s as llama-bench reports it, CPU seconds of the whole run): decode `tokens`
    steps after `depth` positions, or with `prompt` one prompt of that many tokens (weight
    repacking off)."""
    cmd = [binary, "-m", str(gguf), "-p", str(prompt), "-n", str(tokens), "-t", str(threads)]
    if prompt:
        cmd += ["--repack", "0"]
    if depth:
        cmd += ["-d", str(depth)]
    c0 = children_cpu()
    proc = subprocess.run([*cmd, "-r", "1", "-o", "json"], capture_output=True, text=True)
    cpu = children_cpu() - c0
    if proc.returncode != 0:
        sys.exit(f"llama-bench failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    (row,) = json.loads(proc.stdout)
    return float(row["avg_ts"]), cpu


def hipc_decode(engine, tokens: int, depth: int = 0) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of `tokens` single-token steps from position
    `depth` (the positions before it prefilled with random ids, untimed)."""
    import numpy as np

    engine.reset()
    engine.forward([1], 0)  # llama-bench's warm-up: one token, then the timed run
    engine.reset()
    if depth:
        engine.forward(np.random.default_rng(1).integers(3, engine.vocab_size, depth).tolist(), 0)
    tok = 1
    t0, c0 = time.perf_counter(), time.process_time()
    for pos in range(depth, depth + tokens):
        tok = int(np.argmax(engine.forward([tok], pos)))
    return time.perf_counter() - t0, time.process_time() - c0


def hipc_prefill(engine, tokens: int) -> float:
    """Seconds of one forward over `tokens` random ids from position 0."""
    import numpy as np

    ids = np.random.default_rng(0).integers(3, engine.vocab_size, tokens).tolist()
    engine.reset()
    engine.forward(ids, 0)  # llama-bench's warm-up: the whole prompt once, untimed
    engine.reset()
    t0 = time.perf_counter()
    engine.forward(ids, 0)
    return time.perf_counter() - t0


WRITERS = {"moe": ("write_moe_gguf", "cpu-0.7b"), "hybrid": ("write_hybrid_gguf", "cpu-moe-0.7b")}


def write_model(writer: str, preset: str, qtype: str, out: Path) -> Path:
    name = WRITERS[writer][0]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    if preset not in tool.PRESETS:
        sys.exit(f"--preset: {preset} is not one of {name}.py's ({', '.join(tool.PRESETS)})")
    if not out.exists():
        tool.write(out, dict(tool.PRESETS[preset]), qtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary")
    ap.add_argument("--gguf", type=Path, help="the GGUF (default: write --preset)")
    ap.add_argument("--writer", choices=sorted(WRITERS), default="moe", help="the preset's writer")
    ap.add_argument("--preset", help="the writer's preset (moe: cpu-0.7b, hybrid: cpu-moe-0.7b)")
    ap.add_argument("--type", default="q4_0", choices=["q4_0", "q8_0"])
    ap.add_argument("--workdir", type=Path, default=Path("bench-moe"))
    ap.add_argument("--artifact", type=Path, help="a compiled artifact of the same GGUF")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill-tokens", type=int, default=0, help="also time a prompt (0: no)")
    ap.add_argument("--depth", type=int, default=0, help="decode after this many positions")
    ap.add_argument("--out", type=Path, help="append the Markdown table to this file")
    args = ap.parse_args()
    if not os.access(args.llama_bench, os.X_OK):
        sys.exit(f"--llama-bench: {args.llama_bench} is not an executable")
    # before libgomp loads (the runtime's backend reads it then)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    args.workdir.mkdir(parents=True, exist_ok=True)
    preset = args.preset or WRITERS[args.writer][1]
    gguf = args.gguf or write_model(
        args.writer, preset, args.type, args.workdir / f"{preset}-{args.type}.gguf"
    )
    if not gguf.is_file():
        sys.exit(f"--gguf: {gguf} is not a file")
    artifact = args.artifact or args.workdir / (gguf.stem + ".hipc")
    compile_cmd = ["compile", str(gguf), "--target", "cpu", "-o", str(artifact), "-q"]
    if args.artifact is None:
        ctx = max(512, args.depth + args.tokens + 1, args.prefill_tokens)
        cmd = [sys.executable, "-m", "hipc.cli.main", *compile_cmd, "--max-context", str(ctx)]
        print("$", shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)

    from hipc.runtime.engine import load_engine

    engine = load_engine(artifact, threads=args.threads)
    hipc_decode(engine, min(args.tokens, 8))  # pages the weights in, warms the caches
    llama_bench(args.llama_bench, gguf, 1, args.threads)  # the same for llama.cpp's mmap
    rows = {"llama.cpp": [], "hipc": []}  # (wall tok/s, cpu tok/s) per round
    pre = {"llama.cpp": [], "hipc": []}  # prefill tok/s per round
    load0 = os.getloadavg()
    for r in range(args.rounds):
        lb = (args.llama_bench, gguf)
        tps, cpu_long = llama_bench(*lb, args.tokens + 1, args.threads, depth=args.depth)
        _, cpu_short = llama_bench(*lb, 1, args.threads, depth=args.depth)
        rows["llama.cpp"].append((tps, args.tokens / max(cpu_long - cpu_short, 1e-9)))
        wall, cpu = hipc_decode(engine, args.tokens, args.depth)
        rows["hipc"].append((args.tokens / wall, args.tokens / cpu))
        if args.prefill_tokens:
            n = args.prefill_tokens
            pre["llama.cpp"].append(llama_bench(args.llama_bench, gguf, 0, args.threads, n)[0])
            pre["hipc"].append(n / hipc_prefill(engine, n))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.1f} tok/s" for k, v in rows.items()),
              flush=True)  # fmt: skip
    load1 = os.getloadavg()

    def stats(name: str) -> tuple[float, float, float]:
        wall = [w for w, _ in rows[name]]
        cpu = [c for _, c in rows[name]]
        return statistics.median(wall), max(wall), statistics.median(cpu)

    lw, lb, lc = stats("llama.cpp")
    hw, hb, hc = stats("hipc")
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    md = [
        f"### {gguf.name}, {args.threads} thread(s), {args.tokens} decode tokens"
        + (f" after {args.depth}" if args.depth else "")
        + ", "
        f"{args.rounds} rounds ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"CPU: {cpu}, {os.cpu_count()} cores; load average {load0[0]:.1f} before, "
        f"{load1[0]:.1f} after.",
        "",
        "| engine | decode tok/s, wall (median) | wall (best) | tok per CPU-second (median) |",
        "|---|---|---|---|",
        f"| llama.cpp (llama-bench) | {lw:.1f} | {lb:.1f} | {lc:.1f} |",
        f"| hipc (compiled, cpu) | {hw:.1f} | {hb:.1f} | {hc:.1f} |",
        f"| hipc / llama.cpp | {hw / lw:.2f}x | {hb / lb:.2f}x | {hc / lc:.2f}x |",
        *(
            [
                "",
                f"Prefill, one {args.prefill_tokens}-token prompt (median tok/s, wall): "
                f"llama.cpp {statistics.median(pre['llama.cpp']):.1f}, hipc "
                f"{statistics.median(pre['hipc']):.1f} "
                f"({statistics.median(pre['hipc']) / statistics.median(pre['llama.cpp']):.2f}x).",
            ]
            if args.prefill_tokens
            else []
        ),
        "",
        "Rounds (wall tok/s, llama.cpp / hipc): "
        + ", ".join(
            f"{a[0]:.1f} / {b[0]:.1f}" for a, b in zip(rows["llama.cpp"], rows["hipc"], strict=True)
        ),
        "",
        "```sh",
        shlex.join([sys.executable, *sys.argv]),
        "```",
        "",
    ]
    text = "\n".join(md)
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
