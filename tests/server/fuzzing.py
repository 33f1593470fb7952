"""Hypothesis strategies for hostile requests to `hipc serve`, and the check every answer
must pass. Used by tests/server/test_server_fuzz.py (a few hundred requests, in-process
and over a socket) and by docs/benchmarks/fuzz_server.py (tens of thousands, live).

A request is a valid body for its route with some fields replaced by hostile values
(huge, denormal and non-finite numbers, wrong types, deep nesting, unpaired surrogates,
out-of-vocabulary token ids), unknown fields added, required ones dropped, and at times
its bytes cut or corrupted after encoding.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
ROUTES = ("/health", "/ready", "/metrics", "/v1/models", f"/v1/models/{MODEL}", COMP, CHAT)
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")

SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "n", "max_tokens", "stop", "stop_token_ids", "ignore_eos",
    "logit_bias", "logprobs", "stream", "stream_options", "user", "best_of",
)  # fmt: skip
CHAT_FIELDS = (
    *SAMPLING_FIELDS, "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
    "tool_choice", "chat_template_kwargs", "modalities", "model",
)  # fmt: skip
COMP_FIELDS = (*SAMPLING_FIELDS, "prompt", "echo", "suffix", "model")

EXTREME_NUMBERS = (
    0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**309, -(10**309), 10**4000,
    5e-324, -5e-324, 1e-310, 1e308, -1e308, 1e-7, 0.5, 2.0000001, -0.0,
    float("nan"), float("inf"), float("-inf"),
)  # fmt: skip
ODD_TEXT = ("", " ", "\ud800", "\udfff", "\x00", "é" * 3, "<think>", "<|im_end|>", "{{ 1 }}")


def json_values(vocab: int, max_leaves: int = 6) -> st.SearchStrategy[Any]:
    """Any JSON value a hostile client might put in a field."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(-3, vocab + 3),  # token ids around the vocabulary's edges
        st.sampled_from(EXTREME_NUMBERS),
        st.floats(),
        st.text(max_size=24),
        st.sampled_from(ODD_TEXT),
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )


def deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def hostile(vocab: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        json_values(vocab),
        st.integers(28, 40).map(deep),  # around --max-json-depth 32
        st.lists(st.integers(-2, vocab + 2), min_size=1, max_size=12),
        st.dictionaries(
            st.sampled_from(["messages", "template", "raise_exception", "x", "_y", "1"]),
            json_values(vocab, 3),
            max_size=3,
        ),
    )


def _message(vocab: int) -> st.SearchStrategy[dict]:
    role = st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot", ""])
    content = st.one_of(
        st.text(max_size=40),
        st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})),
        json_values(vocab, 3),
    )
    base = st.fixed_dictionaries({"role": role, "content": content})
    return st.one_of(base, base.flatmap(lambda m: _mutated(m, ("role", "content"), vocab)))


@st.composite
def _mutated(draw, body: dict, fields: tuple[str, ...], vocab: int) -> dict:
    body = dict(body)
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["set", "set", "set", "drop", "unknown"]))
        if action == "set":
            body[draw(st.sampled_from(fields))] = draw(hostile(vocab))
        elif action == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        else:
            body[draw(st.text(min_size=1, max_size=12))] = draw(json_values(vocab, 2))
    return body


@st.composite
def bodies(draw, path: str, vocab: int) -> dict:
    """A valid body for `path`, then mutated."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": draw(st.integers(1, 4))}
    if path == CHAT:
        body["messages"] = draw(st.lists(_message(vocab), min_size=1, max_size=3))
        fields = CHAT_FIELDS
    else:
        body["prompt"] = draw(
            st.one_of(
                st.text(min_size=1, max_size=40),
                st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8),
                st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2),
            )
        )
        fields = COMP_FIELDS
    for name, value in draw(
        st.dictionaries(
            st.sampled_from(["temperature", "top_p", "seed", "stream", "n", "logprobs"]),
            st.one_of(st.floats(0, 1), st.booleans(), st.integers(0, 2)),
            max_size=3,
        )
    ).items():
        body[name] = value
    return draw(_mutated(body, fields, vocab))


def encode(body: Any) -> bytes:
    # allow_nan: NaN and Infinity literals are not JSON, and the server must say so
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


@st.composite
def raw_bodies(draw, path: str, vocab: int) -> bytes:
    """The encoded body, at times cut short, corrupted or replaced with noise."""
    data = encode(draw(bodies(path, vocab)))
    how = draw(st.sampled_from(["whole"] * 6 + ["cut", "flip", "noise", "empty"]))
    if how == "cut":
        return data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    if how == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    if how == "noise":
        return draw(st.binary(max_size=64))
    if how == "empty":
        return b""
    return data


@st.composite
def requests(draw, vocab: int) -> tuple[str, str, bytes | None, bool]:
    """(method, path, body, with the API key): mostly generation routes, every route."""
    path = draw(st.sampled_from((COMP, CHAT) * 4 + ROUTES + ("/v1/nope", "/v1/models/x")))
    method = "POST" if path in (COMP, CHAT) else "GET"
    # NOTE: sampled_from, not integers(0, 9) == 0: hypothesis draws small integers often
    if draw(st.sampled_from([False] * 9 + [True])):
        method = draw(st.sampled_from(METHODS))
    body = draw(raw_bodies(path, vocab)) if method == "POST" else None
    return method, path, body, draw(st.sampled_from([True] * 19 + [False]))


def check_answer(method: str, path: str, status: int, content_type: str, body: bytes) -> None:
    """No 5xx; every error in OpenAI's JSON shape; every success well-formed."""
    if path == "/ready" and method == "GET":
        # 503 is /ready's "not now" (a harness may serve without warming): still its shape, never a crash
        state = json.loads(body)["status"]
        assert (status, state) in ((200, "ok"), (503, "warming_up"), (503, "shutting_down")), body
        return
    assert status < 500, (method, path, status, body[:500])
    if path in ("/health", "/ready"):
        return
    if status >= 400:
        assert content_type.startswith("application/json"), (status, content_type, body[:200])
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"], error
        assert error["type"] in ("invalid_request_error", "server_error", "server_overloaded")
        assert set(error) == {"message", "type", "param", "code"}, error
        return
    if method == "POST" and path in (COMP, CHAT) and status == 200:
        if content_type.startswith("text/event-stream"):
            blocks = [b for b in body.decode("utf-8").split("\n\n") if b.strip()]
            assert blocks[-1] == "data: [DONE]", blocks[-3:]
            for block in blocks[:-1]:
                event = json.loads(block.removeprefix("data: "))
                assert "error" not in event, event
        else:
            answer = json.loads(body)
            assert answer["choices"] and answer["usage"]["total_tokens"] >= 1, answer
