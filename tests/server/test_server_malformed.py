"""Hostile and malformed requests against the real server: each is a 4xx with an
OpenAI-style JSON error body, and the server stays up and correct afterwards."""

from __future__ import annotations

import contextlib
import json

import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 2, **fields})


def comp(**fields):
    return json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2, **fields})


def drop(body: str, key: str) -> str:
    data = json.loads(body)
    del data[key]
    return json.dumps(data)


NESTED = '{"model": "tiny", "messages": ' + "[" * 5000 + "]" * 5000 + "}"
DEEP_OK_JSON = '{"model": "tiny", "prompt": "x", "user": ' + "[" * 40 + "]" * 40 + "}"

# (name, method, path, body, expected status, expected param or None)
CASES = [
    ("not json", "POST", CHAT, "{not json", 400, None),
    ("truncated json", "POST", CHAT, chat()[:-3], 400, None),
    ("empty body", "POST", CHAT, "", 400, None),
    ("json array", "POST", CHAT, "[1, 2]", 400, None),
    ("json string", "POST", COMP, '"prompt"', 400, None),
    ("NaN literal", "POST", COMP, comp()[:-1] + ', "temperature": NaN}', 400, None),
    ("invalid utf-8", "POST", COMP, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    ("lone surrogate", "POST", COMP, comp(prompt="x")[:-1] + ', "user": "\\ud800"}', 400, None),
    ("5000-deep nesting", "POST", CHAT, NESTED, 400, None),
    ("40-deep nesting", "POST", COMP, DEEP_OK_JSON, 400, None),
    ("oversized body", "POST", COMP, comp(prompt="x" * 70_000), 413, None),
    ("4300-digit integer", "POST", COMP, comp()[:-1] + ', "seed": ' + "9" * 5000 + "}", 400, None),
    ("missing model", "POST", CHAT, drop(chat(), "model"), 400, "model"),
    ("model is a number", "POST", CHAT, chat(model=7), 400, "model"),
    ("unknown model", "POST", CHAT, chat(model="gpt-9"), 404, "model"),
    ("missing messages", "POST", CHAT, drop(chat(), "messages"), 400, "messages"),
    ("messages not a list", "POST", CHAT, chat(messages="Hi"), 400, "messages"),
    ("messages empty", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("message not an object", "POST", CHAT, chat(messages=["Hi"]), 400, "messages[0]"),
    (
        "message without role",
        "POST",
        CHAT,
        chat(messages=[{"content": "x"}]),
        400,
        "messages[0].role",
    ),
    (
        "unknown role",
        "POST",
        CHAT,
        chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages[0].role",
    ),
    (
        "content a number",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages[0].content",
    ),
    (
        "image content",
        "POST",
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        400,
        "messages[0].content[0].type",
    ),
    (
        "unknown message field",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "x", "mood": 1}]),
        400,
        "messages[0].mood",
    ),
    (
        "tool name with a space",
        "POST",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f g"}}]),
        400,
        "tools[0].function.name",
    ),
    (
        "tool schema keyword the grammar lacks",
        "POST",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]),
        400,
        "tools[0].function.parameters",
    ),
    (
        "tool_choice naming no tool",
        "POST",
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice.function.name",
    ),
    (
        "response_format unknown type",
        "POST",
        CHAT,
        chat(response_format={"type": "yaml"}),
        400,
        "response_format.type",
    ),
    (
        "json_schema keyword the grammar lacks",
        "POST",
        COMP,
        comp(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}},
            }
        ),
        400,
        "response_format.json_schema.schema",
    ),
    ("unknown field", "POST", CHAT, chat(frobnicate=True), 400, "frobnicate"),
    ("temperature a string", "POST", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature a boolean", "POST", CHAT, chat(temperature=True), 400, "temperature"),
    ("temperature too high", "POST", CHAT, chat(temperature=5), 400, "temperature"),
    ("top_p zero", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("presence_penalty 3", "POST", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("max_tokens zero", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", "POST", COMP, comp(max_tokens=-5), 400, "max_tokens"),
    ("max_tokens fractional", "POST", COMP, comp(max_tokens=2.5), 400, "max_tokens"),
    ("max_tokens 1e30", "POST", COMP, comp(max_tokens=1e30), 400, "max_tokens"),
    ("n zero", "POST", CHAT, chat(n=0), 400, "n"),
    ("n above the cap", "POST", CHAT, chat(n=1000), 400, "n"),
    ("seed fractional", "POST", COMP, comp(seed=1.5), 400, "seed"),
    ("five stop strings", "POST", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("stop not strings", "POST", CHAT, chat(stop=[1]), 400, "stop"),
    ("logit_bias bad key", "POST", COMP, comp(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias out of range", "POST", COMP, comp(logit_bias={"5": 500}), 400, "logit_bias"),
    ("logit_bias unknown token", "POST", COMP, comp(logit_bias={"99999": 1}), 400, "logit_bias"),
    ("stream a string", "POST", CHAT, chat(stream="yes"), 400, "stream"),
    (
        "stream_options without stream",
        "POST",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=3), 400, "top_logprobs"),
    ("completion logprobs above 5", "POST", COMP, comp(logprobs=10), 400, "logprobs"),
    ("prompt missing", "POST", COMP, drop(comp(), "prompt"), 400, "prompt"),
    ("prompt empty list", "POST", COMP, comp(prompt=[]), 400, "prompt"),
    ("prompt mixed list", "POST", COMP, comp(prompt=["a", 1]), 400, "prompt"),
    ("prompt token out of vocab", "POST", COMP, comp(prompt=[1, 2, 100000]), 400, "prompt"),
    ("prompt beyond the context", "POST", COMP, comp(prompt="lorem ipsum " * 300), 400, "prompt"),
    (
        "prompt + max_tokens beyond",
        "POST",
        COMP,
        comp(max_tokens=255, prompt="one two three four five six"),
        400,
        "max_tokens",
    ),
    ("empty prompt", "POST", COMP, comp(prompt=""), 400, "prompt"),
    ("suffix", "POST", COMP, comp(suffix="end"), 400, "suffix"),
    (
        "template kwargs clash",
        "POST",
        CHAT,
        chat(chat_template_kwargs={"messages": []}),
        400,
        "chat_template_kwargs",
    ),
    ("GET on a POST route", "GET", CHAT, None, 405, None),
    ("unknown route", "POST", "/v1/engines/davinci/completions", comp(), 404, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_is_a_json_4xx(tiny_server, case):
    name, method, path, body, status, param = case
    got, headers, raw = tiny_server.request(method, path, body)
    assert got == status, (name, raw[:300])
    assert headers["content-type"].startswith("application/json")
    error = json.loads(raw)["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] in ("invalid_request_error", "server_error")
    if param is not None:
        assert error["param"] == param, error


def test_table_is_big_enough():
    assert len(CASES) >= 30


def test_server_is_healthy_and_correct_after_the_table(tiny_server):
    for _name, method, path, body, *_ in CASES:
        tiny_server.request(method, path, body)
    assert tiny_server.alive()
    assert tiny_server.request("GET", "/health", auth=False)[0] == 200
    client = tiny_server.client()
    a = client.completions.create(model="tiny", prompt="Hello", max_tokens=16, temperature=0)
    b = client.completions.create(model="tiny", prompt="Hello", max_tokens=16, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens > 0
    m = tiny_server.metrics()
    assert m["hipc_requests_running"] == 0 and m["hipc_queue_depth"] == 0
    assert "Traceback" not in tiny_server.log()


def test_raw_protocol_abuse_does_not_wedge_the_server(tiny_server):
    import socket

    payloads = [
        b"GARBAGE\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",  # then hang up
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"\x00\x01\x02" * 100,
    ]
    for payload in payloads:
        with socket.create_connection((tiny_server.host, tiny_server.port), timeout=5) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            with contextlib.suppress(OSError):
                s.recv(65536)
    assert tiny_server.request("GET", "/health", auth=False)[0] == 200
