"""Compile-time variants of one 8B GGUF, timed against each other in the decode graph, on one GPU.

    python docs/benchmarks/bench_gpu_variants.py --model l8_q4_k_m --work /tmp/hq \
        --variant "base=" --variant "qkv 8x1=HIPC_QUANT_GEMV_TABLE=q4_k:short=8,1,1,132,1,3,8" \
        [--context 512] [--profile] [--llamacpp-bin DIR] --out $OUT/variants.md

The Llama-3-8B shape in llama-quantize's types for --model (bench_gpu_quant.write_l8: random
blocks) is compiled once per --variant NAME=VAR=VALUE[;VAR=VALUE] (compile-time environment
variables: a geometry table, an experiment's switch) and each artifact is timed by
bench_gpu.bench_hipc (a --context-token prefill, 128-token decode from an empty cache and
after --context tokens, and 128 tokens as `hipc generate` runs them, greedy and at
temperature 0.8: the device's pick feeding the next step, queued ahead) in alternating rounds, so that drift between them shows; with
--profile each decode graph is profiled by kind (profile_gpu_decode.py --ablate --position
64); llama.cpp's llama-bench on the same file when given (the same prefill and depths); the
copy ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_gpu_quant as bq  # noqa: E402


def compile_variant(gguf: Path, name: str, env: dict, activations: str) -> Path:
    out = gguf.with_name(f"{gguf.stem}-{name.replace(' ', '-')}.hipc")
    cmd = [sys.executable, "-m", "hipc.cli.main", "compile", str(gguf), "--target", "sm_90"]
    cmd += ["--activations", activations, "-o", str(out), "-q"]
    subprocess.run(cmd, check=True, env={**os.environ, **env})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="l8_q4_k_m", choices=bq.L8_MODELS)
    ap.add_argument("--activations", default="int8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--llamacpp-bin", type=Path)
    ap.add_argument(
        "--context", type=int, default=512, help="prefill tokens, and decode after them"
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-variants"))
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=VAR=VALUE[;VAR=VALUE]: a build with those compile-time variables (repeatable)",
    )
    ap.add_argument("--profile", action="store_true", help="profile_gpu_decode.py --ablate each")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    variants = {}
    for v in args.variant:
        name, _, env = v.partition("=")
        # a ";" starts the next VAR=VALUE only where an upper-case name and "=" follow, so
        # that a value may hold ";" itself (HIPC_QUANT_GEMV_TABLE's entries)
        pairs = re.split(r";(?=[A-Z_][A-Z0-9_]*=)", env)
        variants[name] = dict(kv.split("=", 1) for kv in pairs if kv)
    if not variants:
        ap.error("no --variant")
    from bench_gpu import bench_hipc, ceilings

    args.work.mkdir(parents=True, exist_ok=True)
    bw = ceilings()["copy_bytes_per_s"]
    bq.log(f"copy ceiling {bw / 1e12:.2f} TB/s")
    path = args.work / f"{args.model}.gguf"
    if not path.exists():
        bq.write_l8(path, args.model)
    read, types = bq.decode_bytes(path)
    notes = [f"{args.model}: {types}; {read / 1e9:.3f} GB read per decode token"]
    arts = {}
    for name, env in variants.items():
        t = time.perf_counter()
        arts[name] = compile_variant(path, name, env, args.activations)
        notes.append(f"{name}: compiled in {time.perf_counter() - t:.0f} s")
    rows = []
    for r in range(args.rounds):
        for name, art in arts.items():
            m = bench_hipc(art, args.repeats, args.context, 128)
            gb = m["decode_eval0"] * read / 1e9
            rows.append(
                [f"hipc, {name} (round {r + 1})", f"{m['prefill']:,.0f}", f"{m['decode_eval0']:,.1f}",
                 f"{m['decode_eval']:,.1f}", f"{gb:,.0f}", f"{100 * gb * 1e9 / bw:.0f}%",
                 f"{m['greedy0']:,.1f}", f"{m['drawn0']:,.1f}", str(m["kernels"])]
            )  # fmt: skip
            bq.log(" | ".join(rows[-1]))
    if args.profile:
        for name, art in arts.items():
            cmd = [sys.executable, str(HERE / "profile_gpu_decode.py"), str(art), "--ablate"]
            prof = subprocess.run([*cmd, "--position", "64"], capture_output=True, text=True)
            notes.append(f"{name}, profile_gpu_decode.py --ablate --position 64:\n{prof.stdout}")
    if args.llamacpp_bin:
        lc = bq.llama_bench(args.llamacpp_bin, path, args.repeats, args.context)
        if lc:
            gb = lc["decode"] * read / 1e9
            rows.append(
                ["llama.cpp (llama-bench, same file)", f"{lc['prefill']:,.0f}", f"{lc['decode']:,.1f}",
                 f"{lc.get(f'decode_d{args.context}', 0):,.1f}", f"{gb:,.0f}", f"{100 * gb * 1e9 / bw:.0f}%", "", "", ""]
            )  # fmt: skip
    n = args.context
    head = ["engine", f"prefill {n} tok/s", "decode @0 (tg128)", f"decode @{n}", "GB/s @0",
            "% of copy", "greedy @0 (generate's loop)", "T 0.8 @0 (drawn on the device)",
            "decode launches"]  # fmt: skip
    lines = [f"copy ceiling {bw / 1e12:.2f} TB/s (same run)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" + "---:|" * (len(head) - 1)]  # fmt: skip
    lines += ["| " + " | ".join(row) + " |" for row in rows] + [""] + notes
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
