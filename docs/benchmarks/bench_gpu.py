"""hipc on the GPU beside its peers, in one run: ceilings, correctness, speed.

Run on the GPU machine (docs/benchmarks/README.md says how the device tool carries it):

    python docs/benchmarks/bench_gpu.py --models smol,l8 --target sm_90 --out $OUT/gpu.md \
        [--peers DIR] [--llamacpp DIR | --llamacpp-src DIR] [--overlap-ab]

For each model shape (random bf16 weights, written here as a Hugging Face folder):
  1. `hipc compile --target sm_90` (timed).
  2. torch.compile decode (gpt-fast style, --peers DIR with torch_compile_decode.py).
  3. The compiled artifact on the GPU: 512-token prefill and 128-token greedy decode
     tokens/s (median of --repeats); decode bandwidth = bytes of weights read per token x
     tokens/s, against the measured device-to-device copy bandwidth. Correctness at that
     shape (smol only, cheap): logits of 32 tokens vs transformers on the GPU with the
     same weights (float32), relative error and top-1 agreement.
  4. llama.cpp (`llama-bench -p 512 -n 128` on an F16 GGUF of the same shape; --llamacpp
     DIR holding the build, or --llamacpp-src DIR holding llamacpp.tgz, built with
     build_llamacpp_cuda.sh in the background from the start; hipc is timed once that
     build is done or abandoned at --deadline seconds, on quiet CPUs).
Prints a table last and writes it, with the command, to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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


def wait_for(path: Path, seconds: float = 480) -> bool:
    """Wait for a peer binary that gpu_session.sh builds in the background during the tests."""
    end = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < end:
        time.sleep(2)
    return path.exists()


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
    from hipc.base.safetensors_file import LazyTensor, write_safetensors

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


def pipelined(eng, token: int, n: int, inv_t: float = 0.0) -> float:
    """Seconds for n tokens from an empty cache as `hipc generate` runs them where the device
    picks (runtime/generate.py): each step's token picked on the device (greedy, or drawn at
    1 / temperature inv_t by a uniform number, Decoding.draw) and the next step queued before
    the host collects it, so the device goes from step to step without waiting for the host.
    The tokens are checked against forward()'s logits: greedy, their argmax; drawn, the host
    sampler's inverse_cdf for the same uniform number (a float32 boundary apart at most)."""
    from hipc.runtime.sampler import inverse_cdf

    us = np.random.default_rng(7).random(n)
    draw = (lambda i: (inv_t, float(us[i]))) if inv_t else (lambda i: None)
    t = time.perf_counter()
    eng.submit([token], 0, argmax=True, **({"draw": draw(0)} if inv_t else {}))
    picks = []
    for pos in range(1, n):
        eng.submit_next(pos, **({"draw": draw(pos)} if inv_t else {}))
        picks.append(eng.collect_argmax())
    picks.append(eng.collect_argmax())
    s = time.perf_counter() - t
    # the same tokens fed back one at a time, the pick made from their logits on the host
    tok, off = token, 0
    for pos in range(n):
        x = eng.forward([tok], pos, copy=False)
        if inv_t:
            w = np.exp((x.astype(np.float64) - x.max()) * np.float32(inv_t))
            want = inverse_cdf(w, float(np.float32(us[pos])))
            cdf = np.cumsum(w) / w.sum()
            near = abs(cdf[min(want, picks[pos])] - np.float32(us[pos])) < 1e-5
            off += picks[pos] != want and not near
        else:
            off += picks[pos] != int(x.argmax())
        tok = picks[pos]
    if off:
        raise SystemExit(f"pipelined picks: {off} of {n} tokens not the host's pick")
    return s


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
    pf, dc, ev, ev0, gr0, dr0 = [], [], [], [], [], []
    # The decode loops read each step's logits where they were copied back to (copy=False:
    # the pinned buffer, valid until the next step), as llama.cpp's llama_get_logits hands
    # out its output buffer; a copy of the row on top costs ~50 us a token
    # (bench_decode_host.py), which no sampler needs.
    for _ in range(repeats):
        t = time.perf_counter()
        logits = eng.forward(ids, 0)
        pf.append(prompt / (time.perf_counter() - t))
        tok = int(logits.argmax())
        t = time.perf_counter()
        for i in range(decode):
            tok = int(eng.forward([tok], prompt + i, copy=False).argmax())
        dc.append(decode / (time.perf_counter() - t))
        # llama-bench's tg measure: each token evaluated and its logits copied back, no
        # sampling (it feeds tokens it does not pick), so the host argmax is left out here
        t = time.perf_counter()
        for i in range(decode):
            eng.forward([tok], prompt + i, copy=False)
        ev.append(decode / (time.perf_counter() - t))
        # ... and from an empty cache, as llama-bench's tg128 (depth 0) runs
        t = time.perf_counter()
        for i in range(decode):
            eng.forward([tok], i, copy=False)
        ev0.append(decode / (time.perf_counter() - t))
        if eng.can_submit_next:
            gr0.append(decode / pipelined(eng, tok, decode))
        if getattr(eng, "can_draw", False):
            dr0.append(decode / pipelined(eng, tok, decode, 1 / 0.8))
    eng.close()
    return {
        "load_s": load_s,
        "prefill": statistics.median(pf),
        "decode": statistics.median(dc),
        "decode_eval": statistics.median(ev),
        "decode_eval0": statistics.median(ev0),
        "greedy0": statistics.median(gr0) if gr0 else 0.0,
        "drawn0": statistics.median(dr0) if dr0 else 0.0,
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


def prepare(name: str, work: Path, args) -> dict:
    """Write the model's random weights and compile it for the target, timed."""
    folder, artifact = work / name, work / f"{name}.hipc"
    t = time.perf_counter()
    bytes_per_token = write_model(name, folder)
    log(f"{name}: wrote random bf16 weights in {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "hipc.cli.main", "compile", str(folder), "--target"]
    cmd += [args.target, "-o", str(artifact), "-q", *args.compile_args.split()]
    subprocess.run(cmd, check=True)
    compile_s = time.perf_counter() - t
    if name != "smol":  # only smol's folder is read again (by transformers)
        for f in folder.glob("*.safetensors"):
            f.unlink()
    return dict(
        folder=folder, artifact=artifact, bytes_per_token=bytes_per_token, compile_s=compile_s
    )


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
    ceil = ceilings()
    log(
        f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s"
    )
    models = args.models.split(",")
    rows, notes = [], []
    # 1. Models written and compiled while llama.cpp builds (CPU work either way).
    prepared = {name: prepare(name, work, args) for name in models}
    # 2. torch.compile, still during the build: its decode loop never waits on the host per
    #    token, so busy CPUs do not slow it (209.5 tok/s for the 8B shape beside the build).
    for name in models if args.peers else ():
        tc = torch_compile_peer(args.peers, name)
        if tc:
            per_token = prepared[name]["bytes_per_token"]
            rows.append(
                (name, "torch.compile", tc["prefill"], tc["decode"], tc["decode"] * per_token)
            )
            notes.append(tc["line"])  # it names the model itself
    # 3. The build done (or abandoned at --deadline): hipc's loop waits on the GPU every
    #    token, and a CPU saturated by the build slowed its 8B decode from 220 to 178 tok/s.
    if build is not None:
        log("llama.cpp: waiting for the build")
        try:
            if build.wait(timeout=max(1.0, args.deadline - (time.time() - began))) != 0:
                log("llama.cpp build failed: see /tmp/llamacpp-build.log")
        except subprocess.TimeoutExpired:
            log(f"llama.cpp: build not done within --deadline {args.deadline:.0f} s; skipped")
            os.killpg(build.pid, signal.SIGKILL)  # its own session: nvcc and ninja go too
            llamacpp = None
    for name in models:
        prep = prepared[name]
        per_token = prep["bytes_per_token"]
        runs = [("hipc", True)] + ([("hipc, no launch overlap", False)] if args.overlap_ab else [])
        for engine, overlap in runs:
            r = bench_hipc(prep["artifact"], args.repeats, 512, 128, overlap=overlap)
            rows.append((name, engine, r["prefill"], r["decode"], r["decode"] * per_token))
            log(rows[-1])
        notes.append(
            f"{name}: hipc compile {prep['compile_s']:.0f} s, load {r['load_s']:.1f} s, "
            f"{r['kernels']} kernels per decode step, {per_token / 1e9:.3f} GB read per decode token"
        )
        if name == "smol":
            c = check_vs_transformers(prep["folder"], prep["artifact"])
            notes.append(
                f"{name}: vs transformers (GPU, float32 weights and cache, 32 tokens): "
                f"max rel {c['max_rel']:.2e}, top-1 {c['top1']:.3f}"
            )
            log(notes[-1])
        for f in prep["folder"].glob("*.safetensors"):
            f.unlink()  # keep the disk for the GGUF files
    # 4. llama.cpp last
    for name in models if llamacpp else ():
        lc = llamacpp_peer(llamacpp, args.peers, name, work)
        if lc:
            per_token = prepared[name]["bytes_per_token"]
            rows.append(
                (name, "llama.cpp F16", lc.get("prefill", 0), lc.get("decode", 0),
                 lc.get("decode", 0) * per_token)
            )  # fmt: skip
    order = {"torch.compile": 1, "llama.cpp F16": 2}
    rows.sort(key=lambda r: (list(SHAPES).index(r[0]), order.get(r[1], 0)))
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
