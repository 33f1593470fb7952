"""Regressions for issue 16's server findings: each request below was a 500 (or a lock-out,
or a plain-text answer) before; now each is a 4xx in OpenAI's JSON shape or a normal reply."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path

import falcon.testing
import numpy as np
import pytest

from hipc.runtime.sampler import Sampler, SamplingParams
from hipc.runtime.server.app import create_app
from hipc.runtime.server.config import Config
from hipc.runtime.server.service import Service, longest_token_bytes

from serving import NoisyEngine, ScriptedEngine, running, script, sse_events, tiny_tokenizer

KEY = "sk-unit"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "Hello"}]
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def make(engine, **config) -> tuple[falcon.testing.TestClient, Service]:
    cfg = Config(served_model_name="fake", api_key=KEY, **config)
    service = Service(engine, cfg)
    return falcon.testing.TestClient(create_app(engine, cfg, service), headers=AUTH), service


def post_raw(client, path: str, body: str):
    headers = {**AUTH, "Content-Type": "application/json"}
    return client.simulate_post(path, body=body, headers=headers)


def assert_json_error(r, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    error = r.json["error"]
    assert error["message"] and error["type"] in ("invalid_request_error", "server_error")
    if param is not None:
        assert error["param"] == param, error
    return error


# ------------------------------------------------------------------ 1. huge integers


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_huge_integer_in_a_float_field_is_a_400(tok, name, path):
    client, _ = make(ScriptedEngine(tok, script(tok, "hi")))
    head = '{"model": "fake", "max_tokens": 2, '
    head += (
        '"prompt": "Hi", '
        if path == "/v1/completions"
        else '"messages": [{"role": "user", "content": "Hi"}], '
    )
    for number in ("1" + "0" * 309, "-" + "9" * 4000):
        error = assert_json_error(post_raw(client, path, head + f'"{name}": {number}}}'), 400, name)
        assert error["code"] == "invalid_value"
        assert len(error["message"]) < 300  # the number is not echoed whole


# ------------------------------------------------------------------ 2. denormal penalties


@pytest.mark.parametrize("penalty", [5e-324, 1e-310, 1e-300])
def test_denormal_repetition_penalty_samples_the_limit(penalty):
    logits = np.array([1.5, -0.5, 2.0, 0.25, -3.0], np.float32)
    prompt = [0, 1, 2]
    sampler = Sampler(SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=7))
    probs = sampler.probabilities(sampler.penalize(logits, prompt, []))
    assert np.isfinite(probs).all() and probs.sum() == pytest.approx(1.0)
    # as the penalty goes to 0 the seen positive logits go to +inf and take all the mass:
    # the closest float64 can come is an even split between tokens 0 and 2 (both inf)
    scaled = np.array([1.5 / penalty, 2.0 / penalty])
    expected = np.zeros(5)
    expected[[0, 2]] = (scaled == scaled.max()) / (scaled == scaled.max()).sum()
    np.testing.assert_allclose(probs, expected)
    assert {sampler(logits, prompt) for _ in range(20)} <= {0, 2}


def test_denormal_repetition_penalty_over_http_stream_and_not(tok):
    client, _ = make(NoisyEngine(tok))
    body = {"model": "fake", "messages": HELLO, "max_tokens": 6, "temperature": 1.0}
    body["repetition_penalty"] = 5e-324
    r = client.simulate_post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json["usage"]["completion_tokens"] == 6
    r = client.simulate_post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.content)
    assert events[-1] == "DONE"
    assert not any("error" in e for e in events[:-1]), events


# ------------------------------------------------------------------ 3. template kwargs


@pytest.mark.parametrize("name", ["template", "messages", "raise_exception", "tools", "eos_token"])
def test_chat_template_kwargs_never_collide(tok, name):
    client, _ = make(ScriptedEngine(tok, script(tok, "ok")))
    body = {"model": "fake", "messages": HELLO, "max_tokens": 2}
    r = client.simulate_post(
        "/v1/chat/completions", json={**body, "chat_template_kwargs": {name: "x"}}
    )
    if name == "template":  # not a name render_chat uses: an ordinary template variable
        assert r.status_code == 200, r.text
    else:
        assert_json_error(r, 400, "chat_template_kwargs")


def test_template_sees_template_kwarg(tok):
    from hipc.base.chat_template import render_chat

    out = render_chat("{{ template }}|{{ messages | length }}", HELLO, template="t", messages=[])
    assert out == "t|1"  # extra cannot replace the messages it is given


# ------------------------------------------------------------------ 5. huge prompts


def test_prompt_past_the_byte_bound_is_refused_without_tokenizing(tok, monkeypatch):
    client, service = make(ScriptedEngine(tok, script(tok, "ok"), max_context=64))
    bound = service.max_prompt_bytes
    assert bound == 64 * longest_token_bytes(tok)
    # the bound is a true lower bound: the longest tokens, repeated, fit it exactly
    vocab = tok.backend.get_vocab()
    assert max(len(t.encode()) for t in vocab) * 64 <= bound
    calls = []
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(a) or [])
    text = "x" * (bound + 1)
    r = client.simulate_post(
        "/v1/completions", json={"model": "fake", "prompt": text, "max_tokens": 1}
    )
    error = assert_json_error(r, 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    r = client.simulate_post(
        "/v1/chat/completions",
        json={"model": "fake", "messages": [{"role": "user", "content": text}]},
    )
    assert assert_json_error(r, 400, "messages")["code"] == "context_length_exceeded"
    assert calls == []


def test_prompt_under_the_bound_is_still_counted_in_tokens(tok):
    client, service = make(ScriptedEngine(tok, script(tok, "ok"), max_context=64))
    text = "ab " * 40  # 120 bytes, under the bound, but more than 64 tokens
    assert len(text) < service.max_prompt_bytes and len(tok.encode(text)) >= 64
    r = client.simulate_post(
        "/v1/completions", json={"model": "fake", "prompt": text, "max_tokens": 1}
    )
    assert assert_json_error(r, 400, "prompt")["code"] == "context_length_exceeded"
    assert "tokens" in r.json["error"]["message"]


# ------------------------------------------------------------------ live: 4 and 6


def _recv_all(sock: socket.socket, limit: float) -> bytes:
    sock.settimeout(limit)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def _json_error_response(raw: bytes, status: int) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == str(status).encode(), raw[:200]
    assert b"content-type: application/json" in head.lower(), head
    return json.loads(body)["error"]


@pytest.fixture(scope="module")
def strict_server(tiny_artifact, server_logs):
    with running(
        tiny_artifact,
        "--served-model-name", "tiny", "--threads", "1", "--max-body-bytes", "4096",
        "--read-timeout", "2", "--max-connections", "24", "--max-queued-requests", "2",
        log_dir=server_logs,
    ) as server:  # fmt: skip
        yield server


def test_waitress_own_refusals_are_json(strict_server):
    host, port = strict_server.host, strict_server.port
    cases = [
        (b"GARBAGE\r\n\r\n", 400),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
            400,  # waitress says 501; an unknown coding is the client's fault
        ),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 20000\r\n\r\n"
            + b"x" * 20000,
            413,
        ),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 300_000 + b"\r\n\r\n", 431),
    ]
    for payload, status in cases:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(payload)
            error = _json_error_response(_recv_all(s, 5), status)
            assert error["message"]
    assert strict_server.request("GET", "/health", auth=False)[0] == 200


def test_trickling_clients_cannot_hold_every_connection(strict_server):
    """24 connections allowed; 30 clients trickle header bytes. Before the read deadline
    they held the server forever (no /health); now each gets a 408 after --read-timeout
    and /health answers within that time plus the 1 s maintenance tick."""
    host, port = strict_server.host, strict_server.port
    tricklers = []
    for _ in range(30):
        try:
            s = socket.create_connection((host, port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            tricklers.append(s)
        except OSError:
            break
    t0 = time.monotonic()
    answered = None
    while time.monotonic() - t0 < 15:
        for s in tricklers:
            with contextlib.suppress(OSError):
                s.sendall(b"X-Slow: 1\r\n")
        try:
            status = strict_server.request("GET", "/health", auth=False, timeout=0.5)[0]
        except OSError:
            continue
        if status == 200:
            answered = time.monotonic() - t0
            break
    assert answered is not None and answered < 2 + 1 + 1.5, answered
    timed_out = 0
    for s in tricklers:
        raw = _recv_all(s, 5)
        if raw:
            assert _json_error_response(raw, 408)["message"].startswith("Request Timeout")
            timed_out += 1
        s.close()
    assert timed_out >= 20  # the ones that were accepted before the limit


def test_idle_connection_is_closed_after_the_read_timeout(strict_server):
    with socket.create_connection((strict_server.host, strict_server.port), timeout=10) as s:
        t0 = time.monotonic()
        assert _recv_all(s, 10) == b""  # closed without a word: nothing was asked
        assert 1.5 < time.monotonic() - t0 < 5


def test_a_slow_but_steady_request_within_the_deadline_is_served(strict_server):
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {strict_server.api_key}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((strict_server.host, strict_server.port), timeout=10) as s:
        for i in range(0, len(head), 16):
            s.sendall(head[i : i + 16])
            time.sleep(0.02)
        s.sendall(body)
        raw = _recv_all(s, 10)
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:200]
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 2


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def test_multi_mib_prompts_are_refused_at_once_and_leave_no_memory(tiny_artifact, server_logs):
    """Before: each 6 MiB prompt took seconds of the tokenizer thread and kept ~370 MiB."""
    with running(
        tiny_artifact, "--served-model-name", "tiny", "--threads", "1",
        "--max-body-bytes", str(8 << 20), log_dir=server_logs,
    ) as server:  # fmt: skip
        base = _rss_mib(server.proc.pid)
        for i in range(3):
            body = {
                "model": "tiny",
                "prompt": f"{i} " + "word " * ((6 << 20) // 5),
                "max_tokens": 1,
            }
            t0 = time.monotonic()
            status, _, raw = server.request("POST", "/v1/completions", body)
            took = time.monotonic() - t0
            assert status == 400, raw[:300]
            assert json.loads(raw)["error"]["code"] == "context_length_exceeded"
            assert took < 2.0, took
        assert _rss_mib(server.proc.pid) - base < 64


def test_no_byte_bound_where_one_token_can_swallow_any_run():
    """A fused unknown token (or WordPiece's [UNK] for a long word) covers any number of
    bytes: there the prompt is tokenized and counted, never refused by its size."""
    from types import SimpleNamespace

    import tokenizers
    from tokenizers import models

    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    cases = {
        "wordpiece": models.WordPiece(vocab, unk_token="[UNK]"),
        "fused bpe": models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=True),
        "bpe": models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=False),
    }
    bounds = {
        name: longest_token_bytes(SimpleNamespace(backend=tokenizers.Tokenizer(model)))
        for name, model in cases.items()
    }
    assert bounds == {"wordpiece": None, "fused bpe": None, "bpe": 5}
    fused = tokenizers.Tokenizer(cases["fused bpe"])
    assert len(fused.encode("é" * 10_000).ids) == 1  # why: 20,000 bytes in one token
