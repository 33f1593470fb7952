"""Load test for `hipc serve`: N requests from C concurrent clients, on loopback only.

Run:
    python docs/benchmarks/bench_server.py [--artifact PATH | --model smollm2-135m]
        [--requests 200] [--clients 16] [--max-tokens 32] [--threads N]
        [--max-batch N] [--max-context-tokens N] [--ignore-eos]
        [--time-limit 600] [--max-rss-growth-mib 16] [--out docs/benchmarks/server-load.md]
        [--json]

--max-batch and --max-context-tokens are passed to `hipc serve` (the batch the engine steps
and the context each request may use; the KV pool is their product). --ignore-eos makes
every request generate --max-tokens tokens, so runs at different client counts decode the
same number of tokens. Streams also give the inter-token latency (the gaps between a
stream's text chunks after its first).

Starts `hipc serve` on 127.0.0.1 with a free port (the server process is this script's
child and is stopped with SIGTERM at the end; its exit status is checked). Without
--artifact it compiles --model into a temporary folder first.

Each client thread holds one keep-alive HTTP connection and sends requests from a shared
counter until --requests are done or --time-limit passes. Request i is, by i % 4: chat,
chat streamed (with usage), completion, completion streamed; every prompt names i, so no
two prompts are equal and no prefill is reused; temperature 0.7 with seed i. A request
counts as an error unless it is a 200 whose body (or stream, ending in [DONE]) has the
right shape, a finish_reason and usage.

Memory: the server's resident set (VmRSS) is read after every --clients completed
requests. The first two readings are the warm-up (first pages of weights, allocator
pools); growth is measured from the second reading to the last. At the end the server's
/metrics are checked against what the clients saw (requests by status, generated tokens).

Exit status 0 when there were no errors, the metrics agree and the growth stays under
--max-rss-growth-mib; 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"  # loopback only, by design
NOTES = "<!-- notes: kept when the script rewrites this file -->"
TOPICS = [
    "the history of computing",
    "how a compiler works",
    "why the sky is blue",
    "the water cycle",
    "a short poem about autumn",
    "three facts about the moon",
    "how to make tea",
    "what a KV cache is",
]


@dataclass
class Outcome:
    index: int
    kind: str
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)  # between a stream's text chunks
    error: str = ""


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    rss_mib: list[tuple[int, float]] = field(default_factory=list)  # (requests done, MiB)
    lock: threading.Lock = field(default_factory=threading.Lock)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start_server(artifact: str, args) -> tuple[subprocess.Popen, int, Path]:
    log = Path(tempfile.mkstemp(prefix="hipc-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "hipc.cli.main", "serve", artifact, "--host", HOST,
           "--port", "0", "--served-model-name", "bench",
           "--max-queued-requests", str(max(args.clients, 1))]  # fmt: skip
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.max_batch:
        cmd += ["--max-batch", str(args.max_batch)]
    if args.max_context_tokens:
        cmd += ["--max-context-tokens", str(args.max_context_tokens)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"ready: http://[0-9.]+:([0-9]+)", log.read_text(errors="replace"))
        if m:
            return proc, int(m.group(1)), log
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    sys.exit(f"hipc serve did not start:\n{log.read_text(errors='replace')}")


def request_for(i: int, max_tokens: int, ignore_eos: bool = False) -> tuple[str, str, dict]:
    kind = ("chat", "chat-stream", "completion", "completion-stream")[i % 4]
    topic = TOPICS[i % len(TOPICS)]
    body: dict = {"model": "bench", "max_tokens": max_tokens, "temperature": 0.7, "seed": i}
    if ignore_eos:
        body["ignore_eos"] = True
    if kind.startswith("chat"):
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"Request {i}: tell me about {topic}."}]
    else:
        path = "/v1/completions"
        body["prompt"] = f"Request {i}. Here is a paragraph about {topic}:"
    if kind.endswith("stream"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return kind, path, body


def send(
    conn: http.client.HTTPConnection, i: int, max_tokens: int, ignore_eos: bool = False
) -> Outcome:
    kind, path, body = request_for(i, max_tokens, ignore_eos)
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Outcome(
                i,
                kind,
                False,
                time.perf_counter() - t0,
                error=f"HTTP {resp.status}: {resp.read()[:200]!r}",
            )
        if not body.get("stream"):
            data = json.loads(resp.read())
            choice = data["choices"][0]
            assert choice["finish_reason"] in ("stop", "length"), choice
            tokens = data["usage"]["completion_tokens"]
            return Outcome(i, kind, True, time.perf_counter() - t0, completion_tokens=tokens)
        ttft, usage, finish, done = None, None, None, False
        gaps: list[float] = []
        last = None
        buf = b""
        while not done:
            line = resp.readline()
            if not line:
                break
            buf += line
            if line != b"\n":
                continue
            event, buf = buf.strip(), b""
            if not event:
                continue
            payload = event[len(b"data: ") :]
            if payload == b"[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                text = c.get("text") or (c.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
                finish = c.get("finish_reason") or finish
        resp.read()
        assert done and usage and finish in ("stop", "length"), (done, usage, finish)
        return Outcome(
            i, kind, True, time.perf_counter() - t0, ttft, usage["completion_tokens"], gaps
        )
    except Exception as e:
        conn.close()
        return Outcome(i, kind, False, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")


def run_load(port: int, pid: int, args) -> tuple[Run, float]:
    run = Run()
    counter = iter(range(args.requests))
    counter_lock = threading.Lock()
    deadline = time.monotonic() + args.time_limit

    def client() -> None:
        conn = http.client.HTTPConnection(HOST, port, timeout=args.time_limit)
        while time.monotonic() < deadline:
            with counter_lock:
                i = next(counter, None)
            if i is None:
                break
            out = send(conn, i, args.max_tokens, args.ignore_eos)
            with run.lock:
                run.outcomes.append(out)
                done = len(run.outcomes)
                if done % args.clients == 0 or done == args.requests:
                    run.rss_mib.append((done, rss_mib(pid)))
        conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return run, time.perf_counter() - t0


def metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def summarize(run: Run, wall: float, m: dict[str, float], args, artifact: str) -> dict:
    ok = [o for o in run.outcomes if o.ok]
    lat = [o.latency_s for o in ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    gaps = [g for o in ok for g in o.gaps_s]
    tokens = sum(o.completion_tokens for o in ok)
    served = sum(
        v
        for k, v in m.items()
        if k.startswith("hipc_requests_total{") and "/completions" in k and 'status="200"' in k
    )
    warm = run.rss_mib[1][1] if len(run.rss_mib) > 1 else float("nan")
    last = run.rss_mib[-1][1] if run.rss_mib else float("nan")
    return {
        "artifact": artifact,
        "requests": args.requests,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "completed": len(run.outcomes),
        "errors": len(run.outcomes) - len(ok) + (args.requests - len(run.outcomes)),
        "error_samples": [o.error for o in run.outcomes if not o.ok][:5],
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "completion_tokens": tokens,
        "completion_tokens_per_s": tokens / wall,
        "latency_s": {
            "p50": pct(lat, 50),
            "p95": pct(lat, 95),
            "p99": pct(lat, 99),
            "max": max(lat, default=float("nan")),
        },
        "ttft_s": {"p50": pct(ttft, 50), "p95": pct(ttft, 95)},
        "inter_token_s": {"p50": pct(gaps, 50), "p95": pct(gaps, 95)},
        "max_batch": args.max_batch or 1,
        "server_mean_batch": m.get("hipc_batch_size_sum", 0) / m["hipc_batch_size_count"]
        if m.get("hipc_batch_size_count")
        else None,
        "rss_mib": run.rss_mib,
        "rss_growth_mib": last - warm,
        "metrics_agree": served == len(ok) + args.warm_requests
        and m.get("hipc_generation_tokens_total", -1) >= tokens,
        "server_generated_tokens": m.get("hipc_generation_tokens_total"),
        "server_ttft_p50_bucket_count": m.get("hipc_time_to_first_token_seconds_count"),
    }


def markdown(s: dict, command: str, log_tail: str) -> str:
    lat, ttft = s["latency_s"], s["ttft_s"]
    rss = ", ".join(f"{n}: {mib:.1f}" for n, mib in s["rss_mib"])
    return f"""# Server load test: `hipc serve` under {s["clients"]} concurrent clients

```
{command}
```

- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
- machine: {cpu_name()} ({os.cpu_count()} logical cores), {platform.system()}
- artifact: {s["artifact"]}
- load: {s["requests"]} requests from {s["clients"]} clients over loopback, max_tokens {s["max_tokens"]},
  temperature 0.7 with per-request seeds; a quarter each of chat, chat streamed, completion,
  completion streamed; every prompt distinct

| requests | errors | wall s | req/s | completion tok/s | latency p50 / p95 / p99 / max s | TTFT p50 / p95 s (streams) |
|---:|---:|---:|---:|---:|---|---|
| {s["completed"]} | {s["errors"]} | {s["wall_s"]:.1f} | {s["requests_per_s"]:.2f} | {s["completion_tokens_per_s"]:.1f} | {lat["p50"]:.2f} / {lat["p95"]:.2f} / {lat["p99"]:.2f} / {lat["max"]:.2f} | {ttft["p50"]:.2f} / {ttft["p95"]:.2f} |

Server resident memory (MiB) after every {s["clients"]} completed requests:
{rss}

Growth from the second reading (warm) to the last: **{s["rss_growth_mib"]:+.1f} MiB**.

Server /metrics agree with the clients (200s counted, tokens generated): {s["metrics_agree"]}
({s["completion_tokens"]} completion tokens seen by clients, {s["server_generated_tokens"]:.0f} generated by the server).
Latency includes queueing: the engine steps up to {s["max_batch"]} sequences together
(`--max-batch`); beyond that a request waits for others to finish. Inter-token latency
(streams) p50 / p95: {s["inter_token_s"]["p50"] * 1e3:.1f} / {s["inter_token_s"]["p95"] * 1e3:.1f} ms.

Server log tail:

```
{log_tail}
```
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", help="a compiled artifact (default: compile --model)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="engine CPU threads")
    p.add_argument("--max-batch", type=int, default=None, help="hipc serve --max-batch")
    p.add_argument("--max-context-tokens", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="every request: --max-tokens")
    p.add_argument("--time-limit", type=float, default=600, help="stop sending after this")
    p.add_argument("--max-rss-growth-mib", type=float, default=16.0)
    p.add_argument("--out", help="write the Markdown report here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args()
    if not 1 <= args.clients <= 256 or not 1 <= args.requests <= 100_000:
        p.error("--clients 1..256, --requests 1..100000")
    args.warm_requests = 0

    tmp = None
    artifact = args.artifact
    if artifact is None:
        tmp = tempfile.TemporaryDirectory(prefix="hipc-bench-")
        artifact = str(Path(tmp.name) / "model.hipc")
        subprocess.run(
            [sys.executable, "-m", "hipc.cli.main", "compile", args.model, "-o", artifact, "-q"],
            check=True,
        )
    proc, port, log = start_server(artifact, args)
    try:
        run, wall = run_load(port, proc.pid, args)
        m = metrics(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    log_lines = log.read_text(errors="replace").splitlines()
    summary = summarize(run, wall, m, args, args.artifact or args.model)
    summary["server_exit_code"] = code
    log_tail = "\n".join([*log_lines[:3], "...", *log_lines[-3:]])
    command = "python docs/benchmarks/bench_server.py " + shlex.join(sys.argv[1:])
    if args.out:
        # hand-written notes below the marker survive a re-run
        out = Path(args.out)
        old = out.read_text() if out.exists() else ""
        notes = old[old.index(NOTES) :] if NOTES in old else ""
        out.write_text(markdown(summary, command, log_tail) + ("\n" + notes if notes else ""))
    if args.json:
        print(json.dumps(summary))
    else:
        print(markdown(summary, command, log_tail))
    log.unlink()
    if tmp is not None:
        tmp.cleanup()
    ok = summary["errors"] == 0 and summary["metrics_agree"] and code == 0
    return 0 if ok and summary["rss_growth_mib"] <= args.max_rss_growth_mib else 1


if __name__ == "__main__":
    sys.exit(main())
