"""Concurrent clients through `hipc serve` on a GPU, beside llama.cpp's llama-batched-bench.

Run on the GPU machine (issue 13's speed goal):

    python docs/benchmarks/bench_gpu_batching.py --shape l8 --clients 1 8 32 64 \
        [--prompt 128] [--gen 256] [--layers N] [--llamacpp-bin DIR --peers DIR] \
        [--work /tmp/hipc-bench] [--out $OUT/gpu-batching.md]

1. bench_gpu.py's random bf16 model of --shape (l8: Llama-3-8B) with a word-level tokenizer
   of its vocabulary, compiled for --target with --max-context prompt + gen (rounded up, to
   keep the KV pool small) and --prefill-chunk (default 2048: the GPU step of any model
   compiled with a context of 2048 or more; without it this short context would cap each
   step, and so the prompts prefilled beside the decode rows, at prompt + gen rows).
2. The one-sequence decode loop in this process (`forward()` per token, as bench_gpu.py
   times it: the batch-1 path, the same graph as before batching) for reference.
3. `hipc serve` with --max-batch the most clients, a KV pool of that many contexts.
4. For each client count C: C clients at once, each one streamed /v1/completions request
   of --prompt random token ids (distinct prompts: no prefix-cache hits) and --gen tokens
   (ignore_eos, temperature 0). Per stream the time to the first token and the gaps
   between tokens; aggregate decode tok/s = tokens after each stream's first / the span
   from the first stream's first token to the last token of all (the span where decoding
   runs), and end-to-end tok/s = all tokens / wall. The ratio column is the aggregate
   decode rate over C = 1's. "All decoding" is the rate in the window where every one of
   the C streams decodes (from the last stream's first token to the first stream's last):
   llama-batched-bench's setting, C sequences generating together with no prompt being
   processed beside them; the aggregate's span adds the staggered start (the other
   clients' prompts prefilled between decode steps) and the tail (a shrinking batch).
   Step wait / host gap, per engine step, from the server's /metrics: how long the engine
   thread waited for each step in flight, and its host time from collecting a step to
   submitting the next (the device idles that long between steps).
5. With --llamacpp-bin DIR (llama-batched-bench there) and --peers DIR (mkgguf.py): an F16 GGUF
   of the same shape and `llama-batched-bench -npp PROMPT -ntg GEN -npl C1,C2,...` (its
   speed_tg: generated tokens / generation time over all C sequences).
Prints a table last and writes it, with the command, to --out.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HOST = "127.0.0.1"
GGUF_NAME = {"smol": "smollm2-135m", "l8": "llama3-8b"}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer.json with exactly `vocab` ids (w3, w4, ...; EOS <|im_end|>):
    prompts are sent as token ids, so only detokenizing the replies needs it. The three
    added tokens are not marked special: random weights do generate them (ignore_eos), and a
    skipped special token has no text, so no event of its own to time."""

    def added(text: str, i: int) -> dict:
        flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
        return {"id": i, "content": text, **dict.fromkeys(flags, False)}

    words = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added(t, i) for t, i in list(words.items())[:3]],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "<|endoftext|>"},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None})
    )


def prepare(args) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_gpu

    shape = list(bench_gpu.SHAPES[args.shape])
    if args.layers:
        shape[3] = args.layers
        bench_gpu.SHAPES[args.shape] = tuple(shape)
    name = f"{args.shape}-{args.layers or 'all'}-p{args.prefill_chunk}"
    folder, artifact = args.work / name, args.work / f"{name}-{args.target}-batch.hipc"
    if artifact.exists():
        return artifact
    t = time.perf_counter()
    bench_gpu.write_model(args.shape, folder)
    write_tokenizer(folder, shape[0])
    log(f"{name}: random bf16 weights in {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "hipc.cli.main", "compile", str(folder), "--target", args.target]
    cmd += ["-o", str(artifact), "-q", "--max-context", str(args.context)]
    cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    subprocess.run(cmd, check=True)
    log(f"{name}: compiled in {time.perf_counter() - t:.0f} s")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    return artifact


def solo_decode(artifact: Path, args) -> float:
    """tok/s of one sequence decoding --gen tokens after a --prompt prompt, forward() per token."""
    from hipc.runtime.engine import load_engine

    eng = load_engine(artifact, target="auto", max_context=args.context)
    ids = np.random.default_rng(0).integers(3, args.vocab, args.prompt).tolist()
    tok = int(eng.forward(ids, 0).argmax())
    t = time.perf_counter()
    for i in range(args.gen):
        tok = int(eng.forward([tok], args.prompt + i).argmax())
    rate = args.gen / (time.perf_counter() - t)
    eng.close()
    return rate


def start_server(artifact: Path, args) -> tuple[subprocess.Popen, int, Path]:
    most = max(args.clients)
    logfile = Path(tempfile.mkstemp(prefix="hipc-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "hipc.cli.main", "serve", str(artifact), "--host", HOST,
           "--port", "0", "--served-model-name", "bench", "--max-batch", str(most),
           "--max-context-tokens", str(args.context),
           "--kv-pool-tokens", str(most * args.context),
           "--max-queued-requests", str(2 * most)]  # fmt: skip
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        m = re.search(r"ready: http://[0-9.]+:([0-9]+)", logfile.read_text(errors="replace"))
        if m:
            return proc, int(m.group(1)), logfile
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"hipc serve did not start:\n{logfile.read_text(errors='replace')[-3000:]}")


def stream(port: int, prompt: list[int], gen: int, out: dict) -> None:
    """One streamed completion; out gets t0, the arrival time of each text event and the
    usage. Events are told apart by bytes (no JSON parse per token: 64 client threads in
    one process must not be what the inter-token gaps measure)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": gen, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    conn = http.client.HTTPConnection(HOST, port, timeout=600)
    out["t0"] = time.perf_counter()
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        times, usage, done = [], None, False
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                done = True
                break
            if b'"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
            elif b'"error"' in line[:16]:
                out["error"] = line[6:300].decode(errors="replace")
                return
            elif b'"text":"' in line and b'"text":""' not in line:
                times.append(time.perf_counter())
    except (OSError, http.client.HTTPException) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return
    finally:
        conn.close()
    if not done:
        out["error"] = "the stream ended without [DONE]"
    elif usage is None or usage.get("completion_tokens") != gen:
        out["error"] = f"usage {usage}: expected {gen} completion tokens (ignore_eos)"
    elif len(times) != gen:
        # word-level tokens: every token is one text event
        out["error"] = f"{len(times)} text events for {gen} tokens"
    out["times"], out["usage"] = times, usage


SCRAPED = ("hipc_batch_size", "hipc_step_wait_seconds", "hipc_step_gap_seconds")


def scrape(port: int) -> dict[str, float]:
    """The server's step histograms' sums and counts: sequences per engine step, the engine
    thread's wait for each step in flight, and its host time from collecting a step to
    submitting the next (the device idle between steps)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for name in SCRAPED:
        for part in ("sum", "count"):
            m = re.search(rf"^{name}_{part} ([0-9.e+-]+)", text, re.M)
            if not m:
                sys.exit(f"/metrics has no {name} histogram: is the server batching?")
            out[f"{name}_{part}"] = float(m.group(1))
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))] if values else 0.0


def run_clients(port: int, clients: int, args, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, args.vocab, args.prompt).tolist() for _ in range(clients)]
    outs = [{} for _ in range(clients)]
    threads = [
        threading.Thread(target=stream, args=(port, p, args.gen, o))
        for p, o in zip(prompts, outs, strict=True)
    ]
    m0 = scrape(port)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    m1 = scrape(port)
    errors = [o.get("error", "no tokens") for o in outs if "error" in o or not o.get("times")]
    if errors:
        return {"clients": clients, "errors": errors}
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    first = min(o["times"][0] for o in outs)
    last = max(o["times"][-1] for o in outs)
    decode_tokens = sum(len(o["times"]) - 1 for o in outs)
    gaps = [b - a for o in outs for a, b in zip(o["times"], o["times"][1:], strict=False)]
    d = {k: m1[k] - m0[k] for k in m0}
    n_steps = d["hipc_batch_size_count"]

    def per_step(name: str) -> float:
        count = d[f"{name}_count"]
        return 1e3 * d[f"{name}_sum"] / count if count else 0.0

    # the window where all `clients` streams decode: llama-batched-bench's steady state
    a = max(o["times"][0] for o in outs)
    b = min(o["times"][-1] for o in outs)
    in_window = sum(1 for o in outs for t in o["times"] if a < t <= b)
    return {
        "clients": clients,
        "tokens": tokens,
        "wall_s": wall,
        "e2e_tok_s": tokens / wall,
        "decode_tok_s": decode_tokens / (last - first),
        "all_decoding_tok_s": in_window / (b - a) if b > a else 0.0,
        "ttft_p50_s": statistics.median(o["times"][0] - o["t0"] for o in outs),
        "itl_p50_ms": 1e3 * pct(gaps, 50),
        "itl_p95_ms": 1e3 * pct(gaps, 95),
        # prefill chunks count as steps too: a little under `clients` when all batch
        "rows_per_step": d["hipc_batch_size_sum"] / n_steps if n_steps else 0.0,
        "wait_ms": per_step("hipc_step_wait_seconds"),
        "gap_ms": per_step("hipc_step_gap_seconds"),
    }


class PeerFailed(Exception):
    pass


def llama_batched(args) -> dict[int, float]:
    """llama-batched-bench's aggregate generation tok/s by parallel count; asked for with
    --llamacpp-bin, so anything missing or failing is PeerFailed (the run's exit status 1,
    after the hipc table is written)."""
    binary = args.llamacpp_bin / "llama-batched-bench"
    if not binary.exists():
        raise PeerFailed(f"llama.cpp: {binary} not found")
    gguf_path = args.work / f"{args.shape}-f16.gguf"
    if not gguf_path.exists():
        if args.peers is None or args.layers:
            raise PeerFailed("llama.cpp: the GGUF needs --peers DIR (mkgguf.py) and every layer")
        subprocess.run(
            [sys.executable, str(args.peers / "mkgguf.py"), GGUF_NAME[args.shape], str(gguf_path)],
            check=True,
        )
    most = max(args.clients)
    cmd = [str(binary), "-m", str(gguf_path), "-ngl", "99", "-fa", "on",
           "-c", str(most * (args.prompt + args.gen)), "-b", "2048", "-ub", "512",
           "-npp", str(args.prompt), "-ntg", str(args.gen),
           "-npl", ",".join(map(str, args.clients)), "--output-format", "jsonl"]  # fmt: skip
    log("llama.cpp:", shlex.join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{") and "speed_tg" in line:
            r = json.loads(line)
            out[int(r["pl"])] = float(r["speed_tg"])
    if proc.returncode != 0 or set(out) != set(args.clients):
        raise PeerFailed(
            f"llama-batched-bench exited {proc.returncode} with results for {sorted(out)} of "
            f"{args.clients}:\n{proc.stderr[-1500:]}"
        )
    return out


def table(rows: list[dict], peer: dict[int, float]) -> str:
    base = next((r["decode_tok_s"] for r in rows if r["clients"] == 1 and "errors" not in r), None)
    lines = [
        "| clients | decode tok/s (aggregate) | x batch-1 | all decoding tok/s "
        "| end-to-end tok/s | TTFT p50 s | inter-token p50 / p95 ms | rows per step "
        "| step wait / host gap ms | llama-batched-bench tok/s "
        "| hipc / llama.cpp (aggregate / all decoding) |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in rows:
        p = peer.get(r["clients"])
        if "errors" in r:
            lines.append(
                f"| {r['clients']} | errors: {r['errors'][:2]} | | | | | | | | "
                f"{f'{p:,.1f}' if p else ''} | |"
            )
            continue
        ratio = f"{r['decode_tok_s'] / base:.2f}" if base else ""
        vs = (
            (f"{p:,.1f}", f"{r['decode_tok_s'] / p:.2f} / {r['all_decoding_tok_s'] / p:.2f}")
            if p
            else ("", "")
        )
        lines.append(
            f"| {r['clients']} | {r['decode_tok_s']:,.1f} | {ratio} "
            f"| {r['all_decoding_tok_s']:,.1f} | {r['e2e_tok_s']:,.1f} "
            f"| {r['ttft_p50_s']:.3f} | {r['itl_p50_ms']:.2f} / {r['itl_p95_ms']:.2f} "
            f"| {r['rows_per_step']:.1f} | {r['wait_ms']:.2f} / {r['gap_ms']:.2f} "
            f"| {vs[0]} | {vs[1]} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="l8", choices=["smol", "l8"])
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check)")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument(
        "--prefill-chunk", type=int, default=2048, help="rows a step holds (hipc compile's)"
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-bench"))
    ap.add_argument(
        "--llamacpp-bin", type=Path, default=None, help="folder with llama-batched-bench"
    )
    ap.add_argument("--peers", type=Path, default=None, help="folder with mkgguf.py")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--peer-timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--no-solo",
        action="store_true",
        help="skip the in-process forward() loop (a second run over the same artifact)",
    )
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.context = -(-(args.prompt + args.gen) // 16) * 16
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_gpu

    args.vocab = bench_gpu.SHAPES[args.shape][0]
    artifact = prepare(args)
    solo = None if args.no_solo else solo_decode(artifact, args)
    if solo is not None:
        log(f"one sequence, forward() per token: {solo:.1f} tok/s")
    proc, port, logfile = start_server(artifact, args)
    rows = []
    try:
        for i, c in enumerate(args.clients):
            # warm up at this count first: the first step of each batch bucket captures its
            # graph, which is not what a steady server's inter-token latency is
            warm = run_clients(port, c, argparse.Namespace(**{**vars(args), "gen": 8}), 100 + i)
            if "errors" in warm:
                log(f"warm-up at {c} clients failed: {warm['errors'][:3]}")
            rows.append(run_clients(port, c, args, 1 + i))
            log(json.dumps(rows[-1]))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    server_log = logfile.read_text(errors="replace").splitlines()
    peer, peer_error = {}, None
    if args.llamacpp_bin:
        try:
            peer = llama_batched(args)
        except (PeerFailed, subprocess.SubprocessError, OSError) as e:
            peer_error = f"llama-batched-bench FAILED: {e}"
            log(peer_error)
    command = "python docs/benchmarks/bench_gpu_batching.py " + shlex.join(sys.argv[1:])
    text = (
        f"```\n{command}\n```\n\n{args.shape} shape (bf16, {bench_gpu.SHAPES[args.shape][3]} "
        f"layers), {args.prompt}-token prompts, {args.gen} generated tokens per client, "
        f"through `hipc serve` (exit {code})."
        + (
            f" One sequence decoding in-process (`forward()` per token, the batch-1 path): "
            f"{solo:.1f} tok/s."
            if solo is not None
            else ""
        )
        + f"\n\n{table(rows, peer)}\n\nServer log:\n```\n"
        + "\n".join([*server_log[:6], "...", *server_log[-3:]])
        + "\n```\n"
    )
    text += goals(rows, peer)
    if peer_error:
        text += f"\n{peer_error}\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    ok = code == 0 and peer_error is None and all("errors" not in r for r in rows)
    return 0 if ok else 1


def goals(rows: list[dict], peer: dict[int, float]) -> str:
    """Issue 13's bars, each met or not: >= 6x batch-1 at 8 clients, >= 15x at 32, >= 1.2x
    llama-batched-bench's aggregate at the same count."""
    ok = {r["clients"]: r for r in rows if "errors" not in r}
    base = ok.get(1, {}).get("decode_tok_s")
    lines = []
    for c, bar in ((8, 6.0), (32, 15.0)):
        if base and c in ok:
            x = ok[c]["decode_tok_s"] / base
            lines.append(
                f"- {c} clients: {x:.2f}x batch-1 (goal {bar}x): {'met' if x >= bar else 'NOT met'}"
            )
    for c, p in sorted(peer.items()):
        if c in ok:
            for key, what in (
                ("decode_tok_s", "aggregate"),
                ("all_decoding_tok_s", "all decoding"),
            ):
                x = ok[c][key] / p
                lines.append(
                    f"- {c} clients, {what}: {x:.2f}x llama.cpp (goal 1.2x): "
                    f"{'met' if x >= 1.2 else 'NOT met'}"
                )
    return "\nGoals:\n" + "\n".join(lines) + "\n" if lines else ""


if __name__ == "__main__":
    sys.exit(main())
