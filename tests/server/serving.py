"""Helpers for the server tests: a real `hipc serve` process, raw HTTP, SSE parsing, and
scripted fake engines for falcon.testing unit tests."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hipc.base.tokenizer import byte_level_alphabet

from support import CHATML_TEMPLATE, tiny_tokenizer_json

READY = re.compile(r"ready: http://([0-9.]+):([0-9]+)")
API_KEY = "sk-test-key"


class ServerProcess:
    """`hipc serve ARTIFACT --port 0 ...` on loopback, its log in a file, ready when it says so."""

    def __init__(
        self,
        artifact: Path | str,
        *args: str,
        log_dir: Path,
        api_key: str | None = API_KEY,
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> None:
        self.api_key = api_key
        self.log_path = log_dir / f"serve-{os.getpid()}-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "hipc.cli.main", "serve", str(artifact)]
        cmd += ["--host", "127.0.0.1", "--port", "0", *args]
        if api_key and not (env and "HIPC_API_KEY" in env):
            cmd += ["--api-key", api_key]
        full_env = {**os.environ, **(env or {})}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        deadline = time.monotonic() + timeout
        while True:
            m = READY.search(self.log())
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"hipc serve did not start:\n{self.log()}")
            time.sleep(0.05)
        self.base_url = f"http://{self.host}:{self.port}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kw):
        import openai

        kw.setdefault("api_key", self.api_key or "unused")
        return openai.OpenAI(base_url=self.base_url, max_retries=0, timeout=120, **kw)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def request(
        self,
        method: str,
        path: str,
        body: bytes | str | dict | None = None,
        headers: dict[str, str] | None = None,
        auth: bool = True,
        timeout: float = 60,
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            if isinstance(body, dict):
                body = json.dumps(body)
            if isinstance(body, str):
                body = body.encode("utf-8")
            all_headers = {**(self.headers() if auth else {}), **(headers or {})}
            if body is not None:
                all_headers.setdefault("Content-Type", "application/json")
            conn.request(method, path, body=body, headers=all_headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        status, _, body = self.request("GET", "/metrics")
        assert status == 200
        return parse_metrics(body.decode())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@contextlib.contextmanager
def running(*args, **kw):
    """A ServerProcess for the block; it must exit 0 on SIGTERM afterwards."""
    server = ServerProcess(*args, **kw)
    try:
        yield server
    finally:
        code = server.stop()
        assert code == 0, f"hipc serve exited {code}:\n{server.log()}"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; also checks every sample line parses."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def sse_events(body: bytes) -> list:
    """The JSON payloads of an SSE body, with the literal 'DONE' for [DONE]."""
    events = []
    for block in body.decode("utf-8").split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append("DONE" if data == "[DONE]" else json.loads(data))
    return events


# ---------------------------------------------------------------- fake engines


def tiny_tokenizer(chat_template: str = CHATML_TEMPLATE):
    from hipc.base.tokenizer import Tokenizer

    return Tokenizer.from_json(
        tiny_tokenizer_json(),
        bos_token_id=None,
        eos_token_ids=[2],
        add_bos=False,
        add_eos=False,
        bos_token=None,
        eos_token="<|im_end|>",
        chat_template=chat_template,
    )


def script(tokenizer, *pieces: str | int) -> list[int]:
    """Token ids spelling `pieces`: text one byte per token (so multi-byte characters are
    split across tokens), ints as they are."""
    symbols = byte_level_alphabet()
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            ids.append(piece)
        else:
            ids += [tokenizer.token_to_id(symbols[b]) for b in piece.encode("utf-8")]
    return ids


class ScriptedEngine:
    """Greedy decoding from it yields `tokens` then EOS (or loops forever with `loop`).

    Logits put `peak` on the scripted token and 0 elsewhere; `gate` (an Event) makes every
    forward wait, `delay` sleeps in it, `fail_at` raises a bug at that step.
    """

    prefix_reuse = True

    def __init__(
        self,
        tokenizer,
        tokens: Sequence[int],
        *,
        max_context: int = 128,
        loop: bool = False,
        peak: float = 30.0,
        delay: float = 0.0,
        gate: threading.Event | None = None,
        fail_at: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.max_context = max_context
        self.tokens, self.loop, self.peak = list(tokens), loop, peak
        self.delay, self.gate, self.fail_at = delay, gate, fail_at
        self.prompt_len = 0
        self.forwards = 0

    def reset(self) -> None:
        pass

    def next_token(self, k: int) -> int:
        if self.loop:
            return self.tokens[k % len(self.tokens)]
        return self.tokens[k] if k < len(self.tokens) else self.tokenizer.eos_token_ids[0]

    def forward(self, tokens: Sequence[int], start: int) -> np.ndarray:
        self.forwards += 1
        if self.gate is not None:
            self.gate.wait(30)
        if self.delay:
            time.sleep(self.delay)
        if start == 0:
            self.prompt_len = len(tokens)
        k = start + len(tokens) - self.prompt_len
        if self.fail_at is not None and k == self.fail_at:
            raise RuntimeError("a bug in the engine")
        logits = np.zeros(self.vocab_size, np.float32)
        logits[self.next_token(k)] = self.peak
        return logits


class NoisyEngine(ScriptedEngine):
    """Logits drawn from a generator seeded by (position, last token): sampling has
    something to choose from, and equal inputs give equal logits."""

    def __init__(self, tokenizer, **kw) -> None:
        super().__init__(tokenizer, [0], loop=True, **kw)

    def forward(self, tokens: Sequence[int], start: int) -> np.ndarray:
        pos = start + len(tokens) - 1
        rng = np.random.default_rng([pos, int(tokens[-1])])
        logits = rng.standard_normal(self.vocab_size).astype(np.float32)
        logits[self.tokenizer.eos_token_ids[0]] = -30.0
        return logits


def signal_name(sig: int) -> str:
    return signal.Signals(sig).name
