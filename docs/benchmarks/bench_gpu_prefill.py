"""Prefill (time to first token) on the GPU: hipc beside PyTorch eager and llama.cpp, one run.

Run on the GPU machine (docs/benchmarks/README.md says how the device tool carries it):

    python docs/benchmarks/bench_gpu_prefill.py --models l8 --tokens 512,4096 --out $OUT/prefill.md \
        [--layers N] [--llamacpp-bin DIR --peers DIR] [--no-torch] [--compile-args "..."]

For each model shape (bench_gpu.py's SHAPES: random bf16 weights, written here; --layers
keeps the first N layers, for quick development runs: the table says so):
  1. `hipc compile --target sm_90` (its default prefill chunk, or --chunk; plus --compile-args).
  2. hipc: a T-token prompt prefilled from position 0 (engine.forward; one step when T <= the
     chunk): median of --repeats after a warm-up; tok/s = T / time, TTFT = the time itself
     (the last token's logits copied to the host included).
  3. PyTorch eager: transformers' LlamaForCausalLM on the same weights in bf16 (sdpa
     attention), the same prompt, logits of the last token only (logits_to_keep=1).
  4. llama.cpp: `llama-bench -p 512,4096 -n 0 -fa 1 -ngl 99` on an F16 GGUF of the same shape
     (--llamacpp-bin DIR holding llama-bench, --peers DIR holding mkgguf.py).
TFLOP/s count the matrix products a prefill must do (every layer's linears over T tokens,
causal attention's QK^T and PV over T(T+1)/2 pairs, the LM head for one token) over the
time, beside the measured bf16 matrix ceiling (torch's 8192^3 product on random data).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu import GGUF_NAME, SHAPES, log, wait_for, write_model


def prefill_flops(name: str, T: int, layers: int) -> float:
    vocab, d, ff, _, h, kv, _, _ = SHAPES[name]
    hd = d // h
    linear = d * (h * hd + 2 * kv * hd) + h * hd * d + 3 * d * ff
    attention = 2 * 2 * h * hd * T * (T + 1) / 2  # QK^T and PV, causal
    return layers * (2 * T * linear + attention) + 2 * vocab * d


def ceiling() -> float:
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (s.elapsed_time(e) / 1e3)


def bench_hipc(artifact: Path, tokens: list[int], repeats: int, vocab: int) -> dict:
    from hipc.runtime.engine import load_engine

    eng = load_engine(artifact, target="cuda")
    out = {}
    for T in tokens:
        ids = np.random.default_rng(T).integers(0, vocab, T).tolist()
        eng.forward(ids, 0)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            eng.forward(ids, 0)
            times.append(time.perf_counter() - t)
        out[T] = statistics.median(times)
    eng.close()
    return out


def check(folder: Path, artifact: Path, T: int, vocab: int) -> tuple[float, float]:
    """hipc's prefill logits (every row) against transformers in float32 on the same weights:
    (max |diff| / max |ref|, top-1 agreement)."""
    import torch
    import transformers

    from hipc.runtime.engine import load_engine

    ids = np.random.default_rng(7).integers(0, vocab, T).tolist()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model = model.cuda().eval()
    with torch.no_grad():
        want = model(torch.tensor([ids], device="cuda")).logits[0].cpu().numpy()
    del model
    torch.cuda.empty_cache()
    eng = load_engine(artifact, target="cuda")
    got = eng.logits(ids)
    eng.close()
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return err, float(np.mean(got.argmax(-1) == want.argmax(-1)))


def bench_torch(folder: Path, tokens: list[int], repeats: int, vocab: int) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    model.eval()
    out = {}
    with torch.no_grad():
        for T in tokens:
            ids = torch.tensor(
                [np.random.default_rng(T).integers(0, vocab, T).tolist()], device="cuda"
            )
            model(ids, logits_to_keep=1)
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                model(ids, logits_to_keep=1).logits.float().cpu()
                times.append(time.perf_counter() - t)
            out[T] = statistics.median(times)
    del model
    torch.cuda.empty_cache()
    return out


def bench_llamacpp(bin_dir: Path, peers: Path, name: str, work: Path, tokens: list[int]) -> dict:
    bench = bin_dir / "llama-bench"
    gguf_path = work / f"{name}-f16.gguf"
    if not gguf_path.exists():
        subprocess.run(
            [sys.executable, str(peers / "mkgguf.py"), GGUF_NAME[name], str(gguf_path)],
            check=True,
            capture_output=True,
        )
    if not wait_for(bench):
        log(f"llama.cpp: {bench} is not there")
        return {}
    cmd = [str(bench), "-m", str(gguf_path), "-ngl", "99", "-fa", "1", "-n", "0", "-r", "3"]
    cmd += ["-p", ",".join(map(str, tokens)), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    try:
        rows = json.loads(proc.stdout)
    except json.JSONDecodeError:
        log("llama-bench failed:", proc.stderr[-500:])
        return {}
    return {int(r["n_prompt"]): int(r["n_prompt"]) / r["avg_ts"] for r in rows if r["n_prompt"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="l8")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-prefill"))
    ap.add_argument("--compile-args", default="", help="extra `hipc compile` flags")
    ap.add_argument("--chunk", type=int, default=None, help="--prefill-chunk (default: hipc's)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument(
        "--check", type=int, default=0, metavar="T",
        help="also compare T tokens' logits with transformers (float32) on the same weights",
    )  # fmt: skip
    ap.add_argument("--llamacpp-bin", type=Path, default=None, help="folder with llama-bench")
    ap.add_argument("--peers", type=Path, default=Path(__file__).parent / "peers")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    peak = ceiling()
    rows = [
        f"bf16 matrix ceiling (torch 8192^3, random data): {peak / 1e12:.0f} TFLOP/s",
        "",
        "| model | T | engine | TTFT ms | tok/s | TFLOP/s | % ceiling |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in args.models.split(","):
        if args.layers:
            v, d, ff, _, h, kv, theta, tied = SHAPES[name]
            SHAPES[name] = (v, d, ff, args.layers, h, kv, theta, tied)
        layers = SHAPES[name][3]
        label = f"{name} ({layers} layers)"
        folder, artifact = args.work / name, args.work / f"{name}.hipc"
        t = time.perf_counter()
        write_model(name, folder)
        log(f"{name}: wrote random bf16 weights in {time.perf_counter() - t:.0f} s")
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "hipc.cli.main", "compile", str(folder), "--target"]
        cmd += [args.target, "-o", str(artifact), "-q"]
        if args.chunk:
            cmd += ["--prefill-chunk", str(args.chunk)]
        subprocess.run(cmd + args.compile_args.split(), check=True)
        log(f"{name}: compiled in {time.perf_counter() - t:.0f} s")
        if args.check:
            err, top1 = check(folder, artifact, args.check, SHAPES[name][0])
            rows.insert(1, f"{label}: {args.check} tokens' logits vs transformers float32: "
                        f"max rel {err:.2e}, top-1 {top1:.3f}")  # fmt: skip
            log(rows[1])
        results = {"hipc": bench_hipc(artifact, tokens, args.repeats, SHAPES[name][0])}
        if not args.no_torch:
            results["PyTorch eager"] = bench_torch(folder, tokens, args.repeats, SHAPES[name][0])
        if args.llamacpp_bin:
            results["llama.cpp"] = bench_llamacpp(
                args.llamacpp_bin, args.peers, name, args.work, tokens
            )
        for T in tokens:
            for engine, res in results.items():
                if T not in res:
                    continue
                sec = res[T]
                flops = prefill_flops(name, T, layers)
                rows.append(
                    f"| {label} | {T} | {engine} | {sec * 1e3:.1f} | {T / sec:,.0f} | "
                    f"{flops / sec / 1e12:.0f} | {100 * flops / sec / peak:.0f} |"
                )
                log(rows[-1])
    table = "\n".join(rows)
    print(table)
    if args.out:
        args.out.write_text(f"`{' '.join(sys.argv)}`\n\n{table}\n")


if __name__ == "__main__":
    main()
