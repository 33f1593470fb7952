"""hipc on the GPU beside its peers, in one run: ceilings, correctness, speed.

Run on the GPU machine (docs/benchmarks/README.md says how the device tool carries it):

    python docs/benchmarks/bench_gpu.py --models smol,l8 --target sm_90 --out $OUT/gpu.md \
        [--peers DIR] [--llamacpp DIR | --llamacpp-src DIR] [--overlap-ab]

For each model shape (random bf16 weights, written here as a Hugging Face folder):
  1. `hipc compile --target sm_90` (timed), then the compiled artifact on the GPU:
     512-token prefill and 128-token greedy decode tokens/s (median of --repeats);
     decode bandwidth = bytes of weights read per token x tokens/s, against the
     measured device-to-device copy bandwidth.
  2. Correctness at that shape (smol only, cheap): logits of 32 tokens vs transformers
     on the GPU with the same weights (float32), relative error and top-1 agreement.
  3. Peers, same machine, same run: torch.compile decode (gpt-fast style, --peers DIR
     with torch_compile_decode.py) and llama.cpp (`llama-bench -p 512 -n 128` on an F16
     GGUF of the same shape; --llamacpp DIR holding the build, or --llamacpp-src DIR holding
     llamacpp.tgz, built with build_llamacpp_cuda.sh in the background and timed last).
Prints a table last and writes it, with the command, to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {
    # name: vocab, hidden, ffn, layers, heads, kv heads, rope theta, tied
    "smol": (49152, 576, 1536, 30, 9, 3, 1e5, True),
    "l8": (128256, 4096, 14336, 32, 32, 8, 5e5, False),
}
GGUF_NAME = {"smol": "smollm2-135m", "l8": "llama3-8b"}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def ceilings() -> dict:
    import torch

    a = torch.empty(1 << 30, dtype=torch.float32, device="cuda")  # 4 GiB
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    copy_bw = 2 * a.numel() * 4 * 5 / (s.elapsed_time(e) / 1e3)
    del a, b
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    y = torch.randn_like(x)
    x @ y
    torch.cuda.synchronize()
    s.record()
    for _ in range(20):
        x @ y
    e.record()
    torch.cuda.synchronize()
    mm = 2 * 8192**3 * 20 / (s.elapsed_time(e) / 1e3)
    return {"copy_bytes_per_s": copy_bw, "bf16_flops": mm}


def write_model(name: str, folder: Path) -> int:
    """A random bf16 Llama of the named shape; returns the bytes a decode token reads."""
    from hipc.runtime.safetensors_file import LazyTensor, write_safetensors

    vocab, d, ff, L, h, kv, theta, tied = SHAPES[name]
    hd = d // h
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": ff,
        "num_hidden_layers": L,
        "num_attention_heads": h,
        "num_key_value_heads": kv,
        "rope_theta": theta,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    base = ((rng.standard_normal(1 << 24) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(
        np.uint16
    )

    def rnd(shape):
        def load():
            n = int(np.prod(shape))
            off = int(rng.integers(0, 1 << 20))
            reps = -(-(n + off) // base.size)
            return np.tile(base, reps)[off : off + n].reshape(shape)

        return load

    def ones(n):
        return lambda: np.full(n, 0x3F80, np.uint16)  # bf16 1.0

    tensors = [
        ("model.embed_tokens.weight", (vocab, d), rnd((vocab, d))),
        ("model.norm.weight", (d,), ones(d)),
    ]
    if not tied:
        tensors.append(("lm_head.weight", (vocab, d), rnd((vocab, d))))
    for i in range(L):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", (d,), ones(d)),
            (p + "post_attention_layernorm.weight", (d,), ones(d)),
            (p + "self_attn.q_proj.weight", (h * hd, d), rnd((h * hd, d))),
            (p + "self_attn.k_proj.weight", (kv * hd, d), rnd((kv * hd, d))),
            (p + "self_attn.v_proj.weight", (kv * hd, d), rnd((kv * hd, d))),
            (p + "self_attn.o_proj.weight", (d, h * hd), rnd((d, h * hd))),
            (p + "mlp.gate_proj.weight", (ff, d), rnd((ff, d))),
            (p + "mlp.up_proj.weight", (ff, d), rnd((ff, d))),
            (p + "mlp.down_proj.weight", (d, ff), rnd((d, ff))),
        ]
    lazy = [LazyTensor(n, np.dtype(np.uint16), s, f, code="BF16") for n, s, f in tensors]
    write_safetensors(folder / "model.safetensors", lazy)
    total = sum(2 * int(np.prod(s)) for _, s, _ in tensors)
    return total - 2 * vocab * d + 2 * d  # one embedding row, not the table


def bench_hipc(
    artifact: Path, repeats: int, prompt: int, decode: int, overlap: bool = True
) -> dict:
    from hipc.runtime.engine import load_engine

    # read by the cuda driver at load: "0" launches each kernel after the previous one ends
    os.environ["HIPC_OVERLAP_LAUNCHES"] = "1" if overlap else "0"
    t = time.perf_counter()
    eng = load_engine(artifact, target="cuda")
    kernels = len(eng.backend.gpu.decode)
    load_s = time.perf_counter() - t
    ids = np.random.default_rng(1).integers(0, eng.vocab_size, prompt).tolist()
    eng.forward(ids, 0)
    eng.forward([1], prompt)
    pf, dc = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        logits = eng.forward(ids, 0)
        pf.append(prompt / (time.perf_counter() - t))
        tok = int(logits.argmax())
        t = time.perf_counter()
        for i in range(decode):
            tok = int(eng.forward([tok], prompt + i).argmax())
        dc.append(decode / (time.perf_counter() - t))
    eng.close()
    return {
        "load_s": load_s,
        "prefill": statistics.median(pf),
        "decode": statistics.median(dc),
        "kernels": kernels,
    }


def check_vs_transformers(folder: Path, artifact: Path) -> dict:
    import torch
    import transformers

    from hipc.runtime.engine import load_engine

    model = (
        transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        .cuda()
        .eval()
    )
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, 32).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    del model
    torch.cuda.empty_cache()
    eng = load_engine(artifact, target="cuda")
    got = eng.logits(ids)
    eng.close()
    return {
        "max_rel": float(np.max(np.abs(got - want)) / np.max(np.abs(want))),
        "top1": float(np.mean(got.argmax(-1) == want.argmax(-1))),
    }


def torch_compile_peer(peers: Path, name: str) -> dict | None:
    script = peers / "torch_compile_decode.py"
    if not script.exists():
        return None
    proc = subprocess.run(
        [sys.executable, str(script), name], capture_output=True, text=True, timeout=900
    )
    line = next((ln for ln in proc.stdout.splitlines() if "torch.compile decode" in ln), "")
    if not line:
        log("torch.compile peer failed:", proc.stderr[-500:])
        return None
    pf = float(line.split("eager prefill")[1].split()[1].replace(",", ""))
    dc = float(line.split("torch.compile decode")[1].split()[0].replace(",", ""))
    return {"prefill": pf, "decode": dc, "line": line}


def llamacpp_peer(llamacpp: Path, peers: Path, name: str, work: Path) -> dict | None:
    bench = llamacpp / "llama-bench"
    if not bench.exists():
        log(f"llama.cpp: {bench} not built")
        return None
    gguf_path = work / f"{name}-f16.gguf"
    if not gguf_path.exists():
        subprocess.run(
            [sys.executable, str(peers / "mkgguf.py"), GGUF_NAME[name], str(gguf_path)],
            check=True,
            capture_output=True,
        )
    proc = subprocess.run(
        [
            str(bench),
            "-m",
            str(gguf_path),
            "-ngl",
            "99",
            "-fa",
            "1",
            "-p",
            "512",
            "-n",
            "128",
            "-r",
            "3",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    try:
        rows = json.loads(proc.stdout)
    except json.JSONDecodeError:
        log("llama-bench failed:", proc.stderr[-500:])
        return None
    out = {}
    for r in rows:
        out["prefill" if r["n_prompt"] else "decode"] = r["avg_ts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smol,l8")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default="/tmp/hipc-bench")
    ap.add_argument(
        "--peers", type=Path, default=None, help="folder with mkgguf.py and torch_compile_decode.py"
    )
    ap.add_argument("--llamacpp", type=Path, default=None, help="folder with llama-bench")
    ap.add_argument(
        "--llamacpp-src",
        type=Path,
        default=None,
        help="folder with llamacpp.tgz (peers/build_llamacpp_source.sh): build llama-bench "
        "with peers/build_llamacpp_cuda.sh in the background while hipc runs",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--overlap-ab",
        action="store_true",
        help="also time hipc with every kernel launched after the previous one ends",
    )
    ap.add_argument("--compile-args", default="", help="extra `hipc compile` flags")
    ap.add_argument(
        "--deadline",
        type=float,
        default=3000,
        help="seconds from the start after which a llama.cpp build still running is skipped",
    )
    args = ap.parse_args()
    began = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    build, llamacpp = None, args.llamacpp
    if args.llamacpp_src and args.peers:
        build = subprocess.Popen(
            ["bash", str(args.peers / "build_llamacpp_cuda.sh"), str(args.llamacpp_src.resolve())],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        llamacpp = Path("/tmp/llama.cpp/build/bin")
    read_per_token = {}
    ceil = ceilings()
    log(
        f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s"
    )
    rows, notes = [], []
    for name in args.models.split(","):
        folder, artifact = work / name, work / f"{name}.hipc"
        t = time.perf_counter()
        bytes_per_token = read_per_token[name] = write_model(name, folder)
        log(f"{name}: wrote random bf16 weights in {time.perf_counter() - t:.0f} s")
        t = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "hipc.runtime.cli",
                "compile",
                str(folder),
                "--target",
                args.target,
                "-o",
                str(artifact),
                "-q",
                *args.compile_args.split(),
            ],
            check=True,
        )
        compile_s = time.perf_counter() - t
        r = bench_hipc(artifact, args.repeats, 512, 128)
        bw = r["decode"] * bytes_per_token
        rows.append((name, "hipc", r["prefill"], r["decode"], bw))
        notes.append(
            f"{name}: hipc compile {compile_s:.0f} s, load {r['load_s']:.1f} s, "
            f"{r['kernels']} kernels per decode step, "
            f"{bytes_per_token / 1e9:.3f} GB read per decode token"
        )
        if args.overlap_ab:
            r2 = bench_hipc(artifact, args.repeats, 512, 128, overlap=False)
            rows.append(
                (
                    name,
                    "hipc, no launch overlap",
                    r2["prefill"],
                    r2["decode"],
                    r2["decode"] * bytes_per_token,
                )
            )
        log(rows[-1], notes[-1])
        if name == "smol":
            c = check_vs_transformers(folder, artifact)
            notes.append(
                f"{name}: vs transformers (GPU, float32, 32 tokens): max rel {c['max_rel']:.2e}, "
                f"top-1 {c['top1']:.3f}"
            )
            log(notes[-1])
        if args.peers:
            tc = torch_compile_peer(args.peers, name)
            if tc:
                rows.append(
                    (
                        name,
                        "torch.compile",
                        tc["prefill"],
                        tc["decode"],
                        tc["decode"] * bytes_per_token,
                    )
                )
                notes.append(f"{name}: {tc['line']}")
        for f in folder.glob("*.safetensors"):
            f.unlink()  # keep the disk for the next shape
    if llamacpp and build is not None:
        # last, once its build (started at the top, on the CPUs) is done
        log("llama.cpp: waiting for the build")
        try:
            if build.wait(timeout=max(1.0, args.deadline - (time.time() - began))) != 0:
                log("llama.cpp build failed: see /tmp/llamacpp-build.log")
        except subprocess.TimeoutExpired:
            log(f"llama.cpp: build not done within --deadline {args.deadline:.0f} s; skipped")
            llamacpp = None
    if llamacpp:
        for name in args.models.split(","):
            lc = llamacpp_peer(llamacpp, args.peers, name, work)
            if lc:
                bytes_per_token = read_per_token[name]
                rows.append(
                    (
                        name,
                        "llama.cpp F16",
                        lc.get("prefill", 0),
                        lc.get("decode", 0),
                        lc.get("decode", 0) * bytes_per_token,
                    )
                )
    rows.sort(key=lambda r: list(SHAPES).index(r[0]))  # stable: hipc first per model
    copy = ceil["copy_bytes_per_s"]
    lines = [
        f"ceilings: device copy {copy / 1e12:.2f} TB/s (read+write), bf16 matmul {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s",
        "",
        "| model | engine | prefill 512 tok/s | decode tok/s | decode GB/s | % of copy bw |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, eng, pf, dc, bw in rows:
        lines.append(
            f"| {name} | {eng} | {pf:,.0f} | {dc:,.1f} | {bw / 1e9:,.0f} | {100 * bw / copy:.0f}% |"
        )
    lines += ["", *[f"- {n}" for n in notes]]
    text = "\n".join(lines)
    print(text)
    if args.out:
        cmd = "python docs/benchmarks/bench_gpu.py " + " ".join(sys.argv[1:])
        args.out.write_text(f"# GPU benchmark\n\n```\n{cmd}\n```\n\n{text}\n")
    os.sync()


if __name__ == "__main__":
    main()
