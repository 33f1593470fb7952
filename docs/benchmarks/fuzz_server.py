"""Long fuzz run against a live `hipc serve`: N hostile requests from C clients, on loopback.

Run:
    python docs/benchmarks/fuzz_server.py [--artifact PATH | --model smollm2-135m]
        [--requests 10000] [--clients 8] [--seed 0] [--max-context-tokens 512]
        [--max-rss-growth-mib 32] [--expect TEXT] [--out docs/benchmarks/server-fuzz.md]

The requests come from the strategies of tests/server/fuzzing.py (the suite's own fuzzer,
which runs a few hundred of them): valid bodies for every route mutated with huge,
denormal and non-finite numbers, wrong types, deep nesting, unpaired surrogates,
out-of-vocabulary token ids, unknown and missing fields, cut and corrupted bytes, other
methods, a missing API key. They are drawn up front with a fixed --seed, so a run can be
repeated exactly.

Every answer must pass fuzzing.check_answer: no 5xx, every refusal in OpenAI's JSON error
shape, every 200 well-formed (a stream ends in [DONE] and carries no error event).
The server's resident set (VmRSS) is read every 500 requests; growth is measured from the
reading at 1000 requests (warm) to the last. Before and after the run the same greedy
completion is asked for: the answers must be equal (and contain --expect if given), and
/health, /metrics and the log (no traceback) are checked. The server is stopped with
SIGTERM and must exit 0.

Exit status 0 when all of that holds; 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import http.client
import json
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))

from fuzzing import MODEL, check_answer, requests  # noqa: E402

HOST = "127.0.0.1"
KEY = "sk-fuzz"
PROBE = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def draw_requests(n: int, seed: int, vocab: int) -> list[tuple]:
    """n requests from the suite's strategies, reproducible from seed."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    out: list[tuple] = []

    @hseed(seed)
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(request=requests(vocab))
    def collect(request):
        out.append(request)

    while len(out) < n:  # hypothesis may stop early once it has seen enough alike
        collect()
        seed += 1
        collect = hseed(seed)(collect)
    return out[:n]


def start_server(artifact: str, args) -> tuple[subprocess.Popen, int, Path]:
    log = Path(tempfile.mkstemp(prefix="hipc-fuzz-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "hipc.cli.main", "serve", artifact, "--host", HOST,
           "--port", "0", "--served-model-name", MODEL, "--api-key", KEY,
           "--max-context-tokens", str(args.max_context_tokens),
           "--max-queued-requests", str(args.clients)]  # fmt: skip
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        m = re.search(r"ready: http://[0-9.]+:([0-9]+)", log.read_text(errors="replace"))
        if m:
            return proc, int(m.group(1)), log
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    sys.exit(f"hipc serve did not start:\n{log.read_text(errors='replace')}")


def send(port: int, method: str, path: str, body: bytes | None, auth: bool):
    conn = http.client.HTTPConnection(HOST, port, timeout=300)
    try:
        headers = {"Content-Type": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {KEY}"
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.getheader("content-type", ""), r.read()
    finally:
        conn.close()


def probe(port: int) -> str:
    status, _, body = send(port, "POST", "/v1/completions", json.dumps(PROBE).encode(), True)
    assert status == 200, body[:300]
    return json.loads(body)["choices"][0]["text"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", help="a compiled artifact (default: compile --model)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="engine CPU threads")
    p.add_argument("--max-context-tokens", type=int, default=512)
    p.add_argument("--max-rss-growth-mib", type=float, default=32.0)
    p.add_argument("--expect", help="text the greedy probe answer must contain")
    p.add_argument("--out", help="write the Markdown report here")
    args = p.parse_args()

    tmp = None
    artifact = args.artifact
    if artifact is None:
        tmp = tempfile.TemporaryDirectory(prefix="hipc-fuzz-")
        artifact = str(Path(tmp.name) / "model.hipc")
        subprocess.run(
            [sys.executable, "-m", "hipc.cli.main", "compile", args.model, "-o", artifact, "-q"],
            check=True,
        )
    plan = json.loads((Path(artifact) / "plan.json").read_text())
    vocab = int(plan.get("vocab_size") or plan.get("config", {}).get("vocab_size") or 32000)
    t0 = time.perf_counter()
    work = draw_requests(args.requests, args.seed, vocab)
    draw_s = time.perf_counter() - t0

    proc, port, log = start_server(artifact, args)
    statuses: collections.Counter = collections.Counter()
    failures: list[str] = []
    rss: list[tuple[int, float]] = [(0, rss_mib(proc.pid))]
    lock = threading.Lock()
    next_index = [0]
    try:
        before = probe(port)
        t0 = time.perf_counter()

        def client() -> None:
            while True:
                with lock:
                    i = next_index[0]
                    if i >= len(work):
                        return
                    next_index[0] += 1
                method, path, body, auth = work[i]
                try:
                    status, ctype, data = send(port, method, path, body, auth)
                    check_answer(method, path, status, ctype, data)
                except Exception as e:
                    with lock:
                        failures.append(f"#{i} {method} {path}: {type(e).__name__}: {e}"[:400])
                    status = "failed"
                with lock:
                    statuses[status] += 1
                    done = sum(statuses.values())
                    if done % 500 == 0:
                        rss.append((done, rss_mib(proc.pid)))

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        after = probe(port)
        health = send(port, "GET", "/health", None, False)[0]
        metrics = send(port, "GET", "/metrics", None, True)[2].decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    server_log = log.read_text(errors="replace")
    five_xx = sum(n for s, n in statuses.items() if isinstance(s, int) and s >= 500)
    warm = next((mib for n, mib in rss if n >= 1000), rss[-1][1])
    growth = rss[-1][1] - warm
    running = re.search(r"^hipc_requests_running (\S+)", metrics, re.M)
    checks = {
        "no 5xx": five_xx == 0,
        "every answer well-formed": not failures,
        "same greedy answer before and after": before == after,
        "expected text": args.expect is None or args.expect in after,
        "/health 200 at the end": health == 200,
        "nothing running at the end": running is not None and float(running.group(1)) == 0,
        "no traceback in the log": "Traceback" not in server_log,
        f"RSS growth <= {args.max_rss_growth_mib:g} MiB": growth <= args.max_rss_growth_mib,
        "exit 0 on SIGTERM": code == 0,
    }
    command = "python docs/benchmarks/fuzz_server.py " + shlex.join(sys.argv[1:])
    report = f"""# `hipc serve` under a long fuzz run

{datetime.date.today().isoformat()}, {platform.machine()} {platform.system()}, Python {platform.python_version()}.

```
{command}
```

Artifact: `{args.artifact or args.model}`; {len(work)} requests (drawn in {draw_s:.0f} s, seed
{args.seed}) from {args.clients} concurrent clients in {wall:.0f} s ({len(work) / wall:.0f} requests/s).

| status | requests |
|---|---|
""" + "".join(f"| {s} | {n} |\n" for s, n in sorted(statuses.items(), key=lambda x: str(x[0])))
    report += f"""
Resident memory (MiB) by requests done: {", ".join(f"{n}: {m:.1f}" for n, m in rss)}.
Growth from the reading at 1000 requests to the last: **{growth:+.1f} MiB**.

Greedy probe `{PROBE["prompt"]!r}` before: {before!r}; after: {after!r}.

| check | result |
|---|---|
""" + "".join(f"| {name} | {'yes' if ok else '**NO**'} |\n" for name, ok in checks.items())
    if failures:
        report += "\nFirst failures:\n\n" + "".join(f"- `{f}`\n" for f in failures[:20])
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    log.unlink()
    if tmp is not None:
        tmp.cleanup()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
