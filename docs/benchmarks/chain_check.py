"""Decode chains (compiler/codegen/chain.py) on a GPU: the same GGUF compiled with chains
(HIPC_DECODE_CHAIN=1) and without, their logits compared over a prompt and greedy
decode steps (the same GEMV code, so they should agree to rounding), then each artifact's
decode timed in the engine loop (bench_gpu.bench_hipc), one after the other.

    python docs/benchmarks/chain_check.py --models l8_q4_0,l8_q4_k_m --layers 2 --time-layers 32

--table 'l8_q4_k_m:q4_k:long=...;...|...': a model's chain builds with that geometry table.
--layers: the checked model's layers (Llama-3-8B's shape otherwise, random blocks in
llama-quantize's default types: bench_gpu_quant.write_l8); --time-layers 0 skips timing.
Prints a table last.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def row(rows: list[str], text: str) -> None:
    rows.append(text)
    log(text)  # as it comes, in case the call's time runs out


def build(model: str, layers: int, vocab: int, work: Path) -> Path:
    import bench_gpu_quant as bq

    path = work / f"{model}-L{layers}.gguf"
    if not path.exists():
        t = time.perf_counter()
        bq.L8 = {**bq.L8, "L": layers, "vocab": vocab}
        bq.write_l8(path, model)
        log(f"{path.name}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s")
    return path


def compile_(gguf: Path, chain: bool, table: str = "") -> Path:
    out = gguf.with_name(f"{gguf.stem}-{'chain' if chain else 'plain'}.hipc")
    env = {**os.environ, "HIPC_DECODE_CHAIN": "1" if chain else "0"}
    if chain and table:  # geometries that let more GEMVs chain (one block size)
        env["HIPC_QUANT_GEMV_TABLE"] = table
    cmd = [sys.executable, "-m", "hipc.cli.main", "compile", str(gguf), "--target", "sm_90"]
    cmd += ["--activations", "int8", "-o", str(out), "-q"]
    subprocess.run(cmd, check=True, env=env)
    return out


def logits_of(artifact: Path, prompt: list[int], steps: int) -> np.ndarray:
    from hipc.runtime.engine import load_engine

    eng = load_engine(artifact, target="cuda")
    chains = sum("linear_chain" in launch.kernel for launch in eng.backend.gpu.decode)
    V = eng.vocab_size
    out = [np.array(eng.forward(prompt, 0), np.float32).reshape(-1)[-V:]]
    tok = int(out[-1].argmax())
    for i in range(steps):
        out.append(np.array(eng.forward([tok], len(prompt) + i), np.float32).reshape(-1)[-V:])
        tok = int(out[-1].argmax())
    eng.close()
    log(f"{artifact.name}: {chains} chain launches a decode step")
    return np.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="l8_q4_0,l8_q4_k_m")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--time-layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-chain"))
    ap.add_argument("--table", default="", help="MODEL:HIPC_QUANT_GEMV_TABLE for its chain builds")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    prompt = np.random.default_rng(3).integers(0, args.vocab, 37).tolist()
    tables = dict(t.split(":", 1) for t in filter(None, args.table.split("|")))
    for model in args.models.split(","):
        g = build(model, args.layers, args.vocab, args.work)
        table = tables.get(model, "")
        a, b = (logits_of(compile_(g, c, table), prompt, args.steps) for c in (True, False))
        scale = float(np.abs(b).max())
        diff = float(np.abs(a - b).max())
        top = float(np.mean(a.argmax(-1) == b.argmax(-1)))
        row(rows, f"| {model} {args.layers} layers | chain vs plain logits | max |diff| {diff:.3g} "
                  f"(of {scale:.3g}), top-1 agree {top:.0%} |")  # fmt: skip
    if args.time_layers:
        from bench_gpu import bench_hipc

        for model in args.models.split(","):
            g = build(model, args.time_layers, 128256, args.work)
            arts = {c: compile_(g, c, tables.get(model, "")) for c in (False, True)}
            for c in (False, True, False, True):
                r = bench_hipc(arts[c], args.repeats, 512, 128)
                name = "chain" if c else "plain"
                row(rows, f"| {model} {args.time_layers} layers | {name} | decode @0 "
                          f"{r['decode_eval0']:.1f} tok/s, @512 {r['decode_eval']:.1f} |")  # fmt: skip
            for p in arts.values():
                subprocess.run(["rm", "-rf", str(p)], check=False)
            g.unlink()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
