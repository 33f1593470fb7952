"""Qwen3.5 hybrids on the GPU: hipc beside llama.cpp on the same GGUF, in one run.

Run on the GPU machine (docs/benchmarks/README.md says how the device tool carries it):

    python docs/benchmarks/bench_gpu_hybrid.py --out $OUT/hybrid.md --llamacpp-bin DIR \
        [--preset qwen3.5-35b-a3b] [--type q4_0|q8_0|q4_k_m] [--layers N] [--gguf FILE] \
        [--keep-gguf]

The model is write_hybrid_gguf.py's random-weight GGUF (default: the Qwen3.5-35B-A3B shape,
Qwen3_5MoeTextConfig's defaults, Q4_0: ~20 GB at 40 layers; q4_k_m: llama-quantize's Q4_K_M
types, write_moe_gguf.q4_k_m_type; --layers cuts it to save disk
and time; --gguf reuses a file written before, --keep-gguf leaves the written one). hipc
compiles that file (`hipc compile --target sm_90`, timed) and runs, on one engine with
prefix reuse off (a repeated prompt would otherwise come from its snapshot), prefills of
512 and 4096 tokens (random ids, median of --repeats) and 128 greedy decode tokens after
the 512-token prompt (the engine's forward() per token, logits copied back, argmax on the
host). With --llamacpp-bin DIR, `llama-bench -p 512,4096 -n 128 -fa 1 -ngl 99` on the same
file after hipc's artifact is deleted. Decode bandwidth counts the bytes one token reads
(k of the E experts, one embedding row, every other tensor whole) against the device copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu import ceilings, log  # noqa: E402
from bench_gpu_moe import gguf_active_bytes  # noqa: E402
from write_hybrid_gguf import PRESETS, parameters  # noqa: E402
from write_hybrid_gguf import write as write_gguf  # noqa: E402

PROMPTS = (512, 4096)
DECODE = 128


def compile_hipc(src: Path, artifact: Path, target: str, chunk: int) -> float:
    t = time.perf_counter()
    ctx = max(PROMPTS) + DECODE + 64
    cmd = [sys.executable, "-m", "hipc.cli.main", "compile", str(src), "--target", target,
           "-o", str(artifact), "-q", "--max-context", str(ctx), "--prefill-chunk", str(chunk)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t


def bench_hipc(artifact: Path, repeats: int) -> dict:
    from hipc.runtime.engine import load_engine

    t = time.perf_counter()
    eng = load_engine(artifact, target="cuda")
    load_s = time.perf_counter() - t
    if eng.sequence is not None:
        eng.sequence.max_snapshots = 0  # every prefill computed, none restored
    rng = np.random.default_rng(1)
    out = {"load_s": load_s, "kernels": len(eng.backend.gpu.decode)}
    for n in PROMPTS:
        ids = rng.integers(0, eng.vocab_size, n).tolist()
        eng.reset()
        eng.forward(ids, 0)  # warm: the decode graph is captured after the first prefill
        times = []
        for _ in range(repeats):
            eng.reset()
            t = time.perf_counter()
            eng.forward(ids, 0)
            times.append(time.perf_counter() - t)
        out[f"prefill{n}"] = n / statistics.median(times)
    ids = rng.integers(0, eng.vocab_size, PROMPTS[0]).tolist()
    rates = []
    for _ in range(repeats):
        eng.reset()
        tok = int(eng.forward(ids, 0).argmax())
        t = time.perf_counter()
        for i in range(DECODE):
            tok = int(eng.forward([tok], len(ids) + i).argmax())
        rates.append(DECODE / (time.perf_counter() - t))
    out["decode"] = statistics.median(rates)
    eng.close()
    return out


def llama_bench(bin_dir: Path, gguf_path: Path, repeats: int) -> dict | None:
    bench = bin_dir / "llama-bench"
    if not bench.exists():
        log(f"llama.cpp: {bench} not found")
        return None
    prompts = ",".join(str(n) for n in PROMPTS)
    cmd = [str(bench), "-m", str(gguf_path), "-ngl", "99", "-fa", "1", "-p", prompts,
           "-n", str(DECODE), "-r", str(repeats), "-o", "json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    try:
        rows = json.loads(proc.stdout)
    except json.JSONDecodeError:
        log("llama-bench failed:", proc.stderr[-800:])
        return None
    out = {}
    for r in rows:
        out[f"prefill{r['n_prompt']}" if r["n_prompt"] else "decode"] = r["avg_ts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="qwen3.5-35b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--type", default="q4_0", choices=("q4_0", "q8_0", "q4_k_m"))
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--gguf", type=Path, help="a file written before (same preset/type/layers)")
    ap.add_argument("--keep-gguf", action="store_true")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="hipc's tokens per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-hybrid-bench"))
    ap.add_argument("--llamacpp-bin", type=Path, default=None, help="folder with llama-bench")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel times of the last 512-token step of the 4,096-token prefill")  # fmt: skip
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    cfg = dict(PRESETS[args.preset])
    if args.layers:
        cfg["layers"] = args.layers
    if args.gguf is not None and not args.gguf.is_file():
        sys.exit(f"bench_gpu_hybrid: --gguf {args.gguf}: no such file")
    ceil = ceilings()
    copy = ceil["copy_bytes_per_s"]
    log(f"ceilings: copy {copy / 1e12:.2f} TB/s")
    total, _ = parameters(cfg)
    src = args.gguf
    if src is None:
        src = args.work / f"{args.preset}-{cfg['layers']}-{args.type}.gguf"
        t = time.perf_counter()
        write_gguf(src, cfg, args.type)
        log(
            f"wrote {src} ({src.stat().st_size / 2**30:.1f} GiB) in {time.perf_counter() - t:.0f} s"
        )
    active = gguf_active_bytes(src, cfg)
    artifact = args.work / "hybrid.hipc"
    compile_s = compile_hipc(src, artifact, args.target, args.prefill_chunk)
    log(f"hipc compile {compile_s:.0f} s")
    label = f"{args.preset} ({cfg['layers']} layers, {args.type.upper()})"
    r = bench_hipc(artifact, args.repeats)
    rows = [(label, "hipc", r["prefill512"], r["prefill4096"], r["decode"])]
    log(rows[-1])
    profiles = []
    if args.profile:
        start = PROMPTS[-1] - args.prefill_chunk
        cmd = [sys.executable, str(HERE / "profile_gpu_decode.py"), str(artifact)]
        cmd += ["--prefill", str(args.prefill_chunk), "--start", str(start)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        profiles.append(f"prefill step at {start}:\n{proc.stdout}{proc.stderr[-1500:]}")
        log(profiles[-1])
    shutil.rmtree(artifact, ignore_errors=True)
    if args.llamacpp_bin:
        lc = llama_bench(args.llamacpp_bin, src, args.repeats)
        if lc:
            rows.append((label, f"llama.cpp {args.type.upper()}", lc.get("prefill512", 0.0),
                         lc.get("prefill4096", 0.0), lc.get("decode", 0.0)))  # fmt: skip
            log(rows[-1])
    if args.gguf is None and not args.keep_gguf:
        src.unlink()
    lines = [
        f"ceilings: device copy {copy / 1e12:.2f} TB/s (read+write), "
        f"bf16 matmul {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s",
        "",
        "| model | engine | prefill 512 tok/s | prefill 4096 tok/s | decode tok/s | "
        "active GB/s | % of copy bw |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for lab, eng, p512, p4096, dc in rows:
        bw = dc * active
        lines.append(
            f"| {lab} | {eng} | {p512:,.0f} | {p4096:,.0f} | {dc:,.1f} | {bw / 1e9:,.0f} | "
            f"{100 * bw / copy:.0f}% |"
        )
    if len(rows) == 2:
        (_, _, a512, a4096, adc), (_, _, b512, b4096, bdc) = rows
        ratio = [
            a / b if b else float("nan") for a, b in ((adc, bdc), (a512, b512), (a4096, b4096))
        ]
        lines += [
            "",
            "hipc / llama.cpp: decode {:.2f}x, prefill 512 {:.2f}x, 4096 {:.2f}x".format(*ratio),
        ]
    lines += [
        "",
        f"- {total / 1e9:.1f}B parameters, {active / 1e9:.3f} GB read per decode token "
        f"({cfg.get('active', '-')} of {cfg.get('experts', '-')} experts); hipc compile "
        f"{compile_s:.0f} s, load {r['load_s']:.1f} s, {r['kernels']} kernels per decode step, "
        f"prefill in steps of {args.prefill_chunk} tokens",
    ]
    text = "\n".join([*lines, "", *profiles])
    print(text)
    if args.out:
        cmd = "python docs/benchmarks/bench_gpu_hybrid.py " + " ".join(sys.argv[1:])
        args.out.write_text(f"# GPU hybrid benchmark\n\n```\n{cmd}\n```\n\n{text}\n")
    os.sync()


if __name__ == "__main__":
    main()
