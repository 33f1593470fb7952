"""The real SmolLM2-135M artifact behind `hipc serve`: realistic text, multi-byte output,
agreement with `hipc generate`, cancellation, the queue limit, concurrency."""

from __future__ import annotations

import http.client
import json
import threading
import time

import openai
import pytest

from hipc.cli.main import main

from serving import running

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write the word 'hello' in Japanese, Chinese and Russian.",
    "List three colors.",
]


def chat_kw(question, **kw):
    return dict(model="smol", messages=[{"role": "user", "content": question}], temperature=0, **kw)


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("question", QUESTIONS)
def test_streaming_equals_non_streaming(smol_server, question):
    client = smol_server.client()
    r = client.chat.completions.create(**chat_kw(question, max_tokens=40))
    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(
        **chat_kw(question, max_tokens=40), stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == r.choices[0].message.content
    # whole characters only; a reply cut by max_tokens inside one ends in U+FFFD
    assert all("\ufffd" not in p for p in [p for p in pieces if p][:-1])
    assert finish == r.choices[0].finish_reason
    assert usage.model_dump() == r.usage.model_dump()


def test_multibyte_reply_streams_whole_characters(smol_server):
    client = smol_server.client()
    kw = chat_kw(QUESTIONS[1], max_tokens=60)
    text = client.chat.completions.create(**kw).choices[0].message.content
    assert any(ord(ch) > 0x7FF for ch in text), text  # 3-byte characters, split by the BPE
    stream = client.chat.completions.create(**kw, stream=True)
    pieces = [
        c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content
    ]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces[:-1])
    assert len(pieces) > 10


def test_server_agrees_with_hipc_generate(smol_server, smol_artifact, capsys):
    question = QUESTIONS[0]
    argv = [
        "generate",
        str(smol_artifact),
        "--chat",
        "--prompt",
        question,
        "--max-tokens",
        "24",
        "--json",
    ]
    assert main(argv) == 0
    cli = json.loads(capsys.readouterr().out.splitlines()[-1])
    r = smol_server.client().chat.completions.create(**chat_kw(question, max_tokens=24))
    assert r.choices[0].message.content == cli["text"]
    assert r.usage.prompt_tokens == len(cli["prompt_token_ids"])
    assert r.usage.completion_tokens == len(cli["token_ids"])
    assert r.choices[0].finish_reason == cli["finish_reason"]


def test_stop_string_from_the_reply(smol_server):
    client = smol_server.client()
    full = (
        client.chat.completions.create(**chat_kw(QUESTIONS[2], max_tokens=40))
        .choices[0]
        .message.content
    )
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    r = client.chat.completions.create(**chat_kw(QUESTIONS[2], max_tokens=40, stop=stop))
    assert r.choices[0].message.content == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def long_stream(client):
    return client.chat.completions.create(
        **chat_kw("Count from one to ten thousand.", max_tokens=3000),
        stream=True,
        extra_body={"ignore_eos": True},
    )


def test_disconnect_mid_stream_cancels_the_generation(smol_server):
    before = smol_server.metrics()
    stream = long_stream(smol_server.client())
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    key = 'hipc_requests_cancelled_total{reason="client_disconnected"}'
    assert wait_for(lambda: smol_server.metrics().get(key, 0) == before.get(key, 0) + 1)
    m = smol_server.metrics()
    assert m["hipc_requests_running"] == 0
    generated = m["hipc_generation_tokens_total"] - before["hipc_generation_tokens_total"]
    assert generated < 200  # stopped within a few tokens of the hang-up, not 3000
    time.sleep(0.3)
    assert (
        smol_server.metrics()["hipc_generation_tokens_total"] == m["hipc_generation_tokens_total"]
    )
    t0 = time.monotonic()
    smol_server.client().chat.completions.create(**chat_kw("Hi", max_tokens=4))
    assert time.monotonic() - t0 < 5  # the engine is free again


@pytest.fixture
def small_queue_server(smol_artifact, server_logs):
    with running(
        smol_artifact, "--served-model-name", "smol", "--max-queued-requests", "2",
        "--no-eager-load", "--max-batch", "1", log_dir=server_logs,
    ) as server:  # fmt: skip
        # (--max-batch 1: one at a time, so that requests queue)
        yield server


def test_disconnect_while_waiting_for_a_whole_answer_cancels_too(smol_server):
    """Non-streaming: nothing is written until the end, so the hang-up is noticed by
    polling waitress's client_disconnected while the HTTP thread waits."""
    before = smol_server.metrics()
    conn = http.client.HTTPConnection(smol_server.host, smol_server.port, timeout=30)
    body = json.dumps({**chat_kw("Count to a million.", max_tokens=3000), "ignore_eos": True})
    headers = {**smol_server.headers(), "Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", body, headers)
    assert wait_for(lambda: smol_server.metrics()["hipc_requests_running"] == 1)
    conn.close()
    key = 'hipc_requests_cancelled_total{reason="client_disconnected"}'
    assert wait_for(lambda: smol_server.metrics().get(key, 0) == before.get(key, 0) + 1)
    m = smol_server.metrics()
    assert m["hipc_requests_running"] == 0
    assert m["hipc_generation_tokens_total"] - before["hipc_generation_tokens_total"] < 300


def test_queue_limit_and_queued_client_hanging_up(small_queue_server):
    """--max-queued-requests 2: one running + two waiting; the next is a 429. A waiting
    client that hangs up leaves the queue."""
    smol_server = small_queue_server
    client = smol_server.client()
    before = smol_server.metrics()
    stream = long_stream(client)
    next(iter(stream))  # running now
    results = []

    def short():
        results.append(
            client.chat.completions.create(**chat_kw("Hi", max_tokens=3)).choices[0].finish_reason
        )

    waiting = threading.Thread(target=short)
    waiting.start()
    conn = http.client.HTTPConnection(smol_server.host, smol_server.port, timeout=30)
    body = json.dumps(chat_kw("Hello", max_tokens=3))
    conn.request(
        "POST",
        "/v1/chat/completions",
        body,
        {**smol_server.headers(), "Content-Type": "application/json"},
    )
    assert wait_for(lambda: smol_server.metrics()["hipc_queue_depth"] == 2)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(**chat_kw("Hi", max_tokens=3))
    assert "max-queued-requests" in str(e.value)
    conn.close()  # the raw client gives up while queued
    key = 'hipc_requests_cancelled_total{reason="client_disconnected"}'
    assert wait_for(lambda: smol_server.metrics()["hipc_queue_depth"] == 1)
    assert smol_server.metrics()[key] == before.get(key, 0) + 1
    stream.close()
    waiting.join(60)
    assert results == ["length"]
    m = smol_server.metrics()
    assert m['hipc_requests_rejected_total{reason="queue_full"}'] >= 1
    assert m[key] == before.get(key, 0) + 2


def test_eight_concurrent_clients(smol_server):
    client = smol_server.client()
    questions = [f"Say the number {i} in words." for i in range(8)]
    want = [
        client.chat.completions.create(**chat_kw(q, max_tokens=12)).choices[0].message.content
        for q in questions
    ]
    got = {}
    barrier = threading.Barrier(8)

    def run(i):
        c = smol_server.client()
        barrier.wait()
        if i % 2:
            chunks = c.chat.completions.create(**chat_kw(questions[i], max_tokens=12), stream=True)
            got[i] = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        else:
            got[i] = (
                c.chat.completions.create(**chat_kw(questions[i], max_tokens=12))
                .choices[0]
                .message.content
            )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(8)] == want
