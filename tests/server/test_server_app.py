"""The Falcon app in-process (falcon.testing) over scripted fake engines: every expected
output below follows from the script the fake engine was given, not from a model."""

from __future__ import annotations

import math
import threading
import time

import falcon.testing
import pytest

from hipc.runtime.server.app import create_app
from hipc.runtime.server.config import Config
from hipc.runtime.server.service import Service

from serving import NoisyEngine, ScriptedEngine, parse_metrics, script, sse_events, tiny_tokenizer
from support import THINK_TEMPLATE

KEY = "sk-unit"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def make(engine, **config) -> tuple[falcon.testing.TestClient, Service]:
    cfg = Config(served_model_name="fake", api_key=KEY, **config)
    service = Service(engine, cfg)
    return falcon.testing.TestClient(create_app(engine, cfg, service), headers=AUTH), service


def chat(client, stream=False, **body):
    body = {"model": "fake", "messages": HELLO, "temperature": 0, "stream": stream, **body}
    return client.simulate_post("/v1/chat/completions", json=body)


def complete(client, stream=False, **body):
    body = {"model": "fake", "prompt": "Hello", "temperature": 0, "stream": stream, **body}
    return client.simulate_post("/v1/completions", json=body)


def stream_text(events, key="content", index=0):
    out = []
    for e in events[:-1]:
        for c in e["choices"]:
            if c["index"] == index and "delta" in c and c["delta"].get(key):
                out.append(c["delta"][key])
            elif c["index"] == index and "text" in c:
                out.append(c["text"])
    return "".join(out)


def prompt_len(tok, messages=HELLO) -> int:
    return len(tok.encode(tok.render_chat(messages), add_special_tokens=False))


# ------------------------------------------------------------------ routes and auth


def test_health_needs_no_key_everything_else_does(tok):
    client, _ = make(ScriptedEngine(tok, script(tok, "hi")))
    assert client.simulate_get("/health", headers={"Authorization": ""}).json == {"status": "ok"}
    for path in ("/v1/models", "/metrics"):
        r = client.simulate_get(path, headers={"Authorization": ""})
        assert r.status_code == 401
        assert r.json["error"]["code"] == "missing_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    r = client.simulate_get("/v1/models", headers={"Authorization": "Bearer sk-unix"})
    assert r.status_code == 401 and r.json["error"]["code"] == "invalid_api_key"
    r = client.simulate_get("/v1/models", headers={"Authorization": f"Basic {KEY}"})
    assert r.status_code == 401
    assert client.simulate_get("/v1/models").status_code == 200


def test_models(tok):
    client, _service = make(ScriptedEngine(tok, [], max_context=100), max_context_tokens=80)
    data = client.simulate_get("/v1/models").json
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["fake"]
    assert data["data"][0]["max_model_len"] == 80
    assert client.simulate_get("/v1/models/fake").json["id"] == "fake"
    r = client.simulate_get("/v1/models/other")
    assert r.status_code == 404 and r.json["error"]["code"] == "model_not_found"
    r = chat(client, model="other")
    assert r.status_code == 404 and "does not exist" in r.json["error"]["message"]


def test_unknown_route_and_method_are_openai_errors(tok):
    client, _ = make(ScriptedEngine(tok, []))
    r = client.simulate_get("/v1/nothing")
    assert r.status_code == 404 and r.json["error"]["type"] == "invalid_request_error"
    r = client.simulate_get("/v1/chat/completions")
    assert r.status_code == 405 and "not allowed" in r.json["error"]["message"]
    assert "POST" in r.headers["allow"]


# ------------------------------------------------------------------ generation


def test_chat_reply_usage_and_stream_agree(tok):
    text = "Hello there, general Kenobi."
    client, _ = make(ScriptedEngine(tok, script(tok, text)))
    r = chat(client)
    assert r.status_code == 200, r.text
    choice = r.json["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": text,
        "reasoning_content": None,
        "refusal": None,
    }
    assert choice["finish_reason"] == "stop"
    n_prompt = prompt_len(tok)
    assert r.json["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": len(text),
        "total_tokens": n_prompt + len(text),
    }
    events = sse_events(chat(client, stream=True, stream_options={"include_usage": True}).content)
    assert events[-1] == "DONE"
    first = events[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""} and first["index"] == 0
    assert stream_text(events) == text
    finals = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"] == [] and events[-2]["usage"] == r.json["usage"]
    assert all(e["usage"] is None for e in events[:-2])
    assert len({e["id"] for e in events[:-1]}) == 1


def test_stream_without_include_usage_has_no_usage_field(tok):
    client, _ = make(ScriptedEngine(tok, script(tok, "ok")))
    events = sse_events(chat(client, stream=True).content)
    assert all("usage" not in e for e in events[:-1])


def test_multibyte_characters_split_across_tokens_stream_whole(tok):
    text = "héllo 日本語 😀 ok"
    tokens = script(tok, text)
    assert len(tokens) == len(text.encode())  # one byte per token: characters are split
    client, _ = make(ScriptedEngine(tok, tokens))
    events = sse_events(chat(client, stream=True).content)
    pieces = [e["choices"][0]["delta"].get("content") for e in events[1:-1]]
    pieces = [p for p in pieces if p]
    assert "".join(pieces) == text == chat(client).json["choices"][0]["message"]["content"]
    assert all("\ufffd" not in p for p in pieces)
    assert len(pieces) > 5  # streamed, not one lump


def test_max_tokens_omitted_means_the_rest_of_the_admitted_context(tok):
    engine = ScriptedEngine(tok, script(tok, "ab"), loop=True, max_context=64)
    client, _ = make(engine)
    r = chat(client)
    n_prompt = prompt_len(tok)
    assert r.json["usage"]["completion_tokens"] == 64 - n_prompt
    assert r.json["choices"][0]["finish_reason"] == "length"
    client, _ = make(engine, max_context_tokens=40)
    r = complete(client)
    assert r.json["usage"]["completion_tokens"] == 40 - r.json["usage"]["prompt_tokens"]
    r = complete(client, max_tokens=3)
    assert r.json["choices"][0]["text"] == "aba"
    assert r.json["choices"][0]["finish_reason"] == "length"


def test_context_limits_are_400s_that_say_so(tok):
    client, _ = make(ScriptedEngine(tok, [], max_context=64), max_context_tokens=32)
    r = complete(client, prompt="word " * 40)
    assert r.status_code == 400
    err = r.json["error"]
    assert err["code"] == "context_length_exceeded"
    assert "maximum context length is 32 tokens" in err["message"]
    assert "admits 32 of the 64 positions" in err["message"]
    r = complete(client, prompt="Hi", max_tokens=31)
    assert r.status_code == 400 and "in the completion" in r.json["error"]["message"]
    assert complete(client, prompt="Hi", max_tokens=30).status_code == 200


def test_stop_strings(tok):
    client, _ = make(ScriptedEngine(tok, script(tok, "one two STOP three")))
    for stop in ("STOP", ["zzz", "STOP"], [" two"]):
        r = chat(client, stop=stop)
        want = "one two " if stop != [" two"] else "one"
        assert r.json["choices"][0]["message"]["content"] == want
        assert r.json["choices"][0]["finish_reason"] == "stop"
        assert stream_text(sse_events(chat(client, stream=True, stop=stop).content)) == want
    r = complete(client, stop="three")
    assert r.json["choices"][0]["text"] == "one two STOP "


def test_stop_token_ids_and_ignore_eos(tok):
    ids = script(tok, "abc")
    client, _ = make(ScriptedEngine(tok, ids, max_context=40))
    r = chat(client, stop_token_ids=[ids[2]])
    assert r.json["choices"][0]["message"]["content"] == "ab"
    r = complete(client, ignore_eos=True, max_tokens=6)
    # past the script the engine keeps offering EOS; ignored, it is decoded (as nothing)
    assert r.json["usage"]["completion_tokens"] == 6
    assert r.json["choices"][0]["text"] == "abc"


def test_n_choices_share_one_prefill(tok):
    engine = ScriptedEngine(tok, script(tok, "same"))
    client, _ = make(engine)
    r = chat(client, n=3)
    assert [c["index"] for c in r.json["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in r.json["choices"]} == {"same"}
    assert r.json["usage"]["completion_tokens"] == 3 * 4
    assert r.json["usage"]["prompt_tokens"] == prompt_len(tok)
    # one prefill, then 4 decode steps per choice (the last one's logits say EOS)
    assert engine.forwards == 1 + 3 * 4
    events = sse_events(chat(client, stream=True, n=2).content)
    assert [stream_text(events, index=i) for i in (0, 1)] == ["same", "same"]
    roles = [e["choices"][0]["index"] for e in events[:-1] if "role" in e["choices"][0]["delta"]]
    assert roles == [0, 1]
    reused = parse_metrics(client.simulate_get("/metrics").text)["hipc_prompt_reuse_total"]
    assert reused >= 3


def test_batch_prompts_and_token_prompts(tok):
    client, _ = make(ScriptedEngine(tok, script(tok, "x")))
    r = complete(client, prompt=["a", "b", "c"], n=2)
    assert [c["index"] for c in r.json["choices"]] == list(range(6))
    ids = tok.encode("Hello")
    r2 = complete(client, prompt=ids)
    r3 = complete(client, prompt=[ids, ids])
    assert r2.json["usage"]["prompt_tokens"] == len(ids)
    assert r3.json["usage"]["prompt_tokens"] == 2 * len(ids)
    r = complete(client, prompt=["a"] * 3, n=3)
    assert r.status_code == 400 and "--max-n" in r.json["error"]["message"]


def test_echo(tok):
    client, _ = make(ScriptedEngine(tok, script(tok, " world")))
    r = complete(client, prompt="Hello", echo=True)
    assert r.json["choices"][0]["text"] == "Hello world"
    events = sse_events(complete(client, prompt="Hello", echo=True, stream=True).content)
    assert stream_text(events) == "Hello world"


def test_chat_logprobs_are_the_engines_and_bytes_rebuild_the_text(tok):
    text = "añb"
    client, _ = make(ScriptedEngine(tok, script(tok, text), peak=5.0))
    r = chat(client, logprobs=True, top_logprobs=2)
    lps = r.json["choices"][0]["logprobs"]["content"]
    assert len(lps) == len(text.encode())
    want = 5.0 - math.log(math.exp(5.0) + tok.vocab_size - 1)
    for entry in lps:
        assert entry["logprob"] == pytest.approx(want, abs=1e-5)
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]
        assert entry["top_logprobs"][1]["logprob"] == pytest.approx(
            -math.log(math.exp(5.0) + tok.vocab_size - 1), abs=1e-5
        )
    assert bytes(b for e in lps for b in e["bytes"]).decode() == text
    events = sse_events(chat(client, stream=True, logprobs=True).content)
    streamed = [
        x for e in events[:-1] for x in ((e["choices"][0]["logprobs"] or {}).get("content") or [])
    ]
    assert [x["bytes"] for x in streamed] == [x["bytes"] for x in lps]
    assert all(x["top_logprobs"] == [] for x in streamed)


def test_completion_logprobs_legacy_shape(tok):
    client, _ = make(ScriptedEngine(tok, script(tok, "abc")))
    r = complete(client, logprobs=2)
    lp = r.json["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"]
    assert lp["text_offset"] == [0, 1, 2]
    assert len(lp["token_logprobs"]) == 3 and all(len(t) == 2 for t in lp["top_logprobs"])
    events = sse_events(complete(client, stream=True, logprobs=2).content)
    chunks = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"][0]["logprobs"]]
    assert [t for c in chunks for t in c["tokens"]] == ["a", "b", "c"]
    assert [o for c in chunks for o in c["text_offset"]] == [0, 1, 2]


def test_seed_repeats_and_choice_i_uses_seed_plus_i(tok):
    client, _ = make(NoisyEngine(tok))
    body = dict(temperature=1.0, max_tokens=12, logit_bias={"0": -100, "1": -100, "2": -100})

    def texts(**kw):
        return [c["text"] for c in complete(client, **body, **kw).json["choices"]]

    a = texts(seed=11)
    assert a == texts(seed=11)
    assert a != texts(seed=12)
    assert texts(seed=11, n=3) == a + texts(seed=12) + texts(seed=13)


def test_logit_bias_steers_the_draw(tok):
    client, _ = make(NoisyEngine(tok))
    target = tok.token_to_id("x")
    r = complete(client, temperature=1.0, seed=0, max_tokens=5, logit_bias={str(target): 100})
    assert r.json["choices"][0]["text"] == "xxxxx"


# ------------------------------------------------------------------ reasoning


def test_model_emitted_think_is_split_off(tok):
    think, unthink = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    tokens = script(tok, "\n", think, "first, the plan é", unthink, "\n\nthe answer")
    client, _ = make(ScriptedEngine(tok, tokens))
    msg = chat(client).json["choices"][0]["message"]
    assert msg["reasoning_content"] == "first, the plan é"
    assert msg["content"] == "\n\nthe answer"
    events = sse_events(chat(client, stream=True).content)
    assert stream_text(events, "reasoning_content") == msg["reasoning_content"]
    assert stream_text(events) == msg["content"]
    # completions are raw text
    raw = complete(client).json["choices"][0]["text"]
    assert raw == "\n<think>first, the plan é</think>\n\nthe answer"


def test_think_tags_spelled_out_in_text_are_split_too(tok):
    client, _ = make(ScriptedEngine(tok, script(tok, "<think>hmm</think>yes")))
    msg = chat(client).json["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("hmm", "yes")


def test_template_opened_think(tok, tmp_path):
    template = tmp_path / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    unthink = tok.token_to_id("</think>")
    tokens = script(tok, "let me see", unthink, "42")
    client, _ = make(ScriptedEngine(tok, tokens), chat_template=str(template))
    msg = chat(client).json["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("let me see", "42")
    events = sse_events(chat(client, stream=True).content)
    assert stream_text(events, "reasoning_content") == "let me see"
    assert stream_text(events) == "42"
    # cut short inside the think block: all of it is reasoning
    msg = chat(client, max_tokens=4).json["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("let ", "")
    client, _ = make(ScriptedEngine(tok, tokens), chat_template=str(template), reasoning="off")
    msg = chat(client).json["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (None, "let me see</think>42")


# ------------------------------------------------------------------ queue, errors, metrics


def test_queue_full_is_429_and_health_still_answers(tok):
    gate = threading.Event()
    engine = ScriptedEngine(tok, script(tok, "slow"), gate=gate)
    client, service = make(engine, max_queued_requests=1)
    results = []

    def call():
        results.append(chat(client).status_code)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    assert service.scheduler.running == 1 and service.scheduler.depth == 1
    r = chat(client)
    assert r.status_code == 429 and r.json["error"]["code"] == "queue_full"
    assert client.simulate_get("/health").status_code == 200
    gate.set()
    for t in threads:
        t.join(10)
    assert results == [200, 200]
    m = parse_metrics(client.simulate_get("/metrics").text)
    assert m['hipc_requests_rejected_total{reason="queue_full"}'] == 1
    assert m['hipc_requests_total{endpoint="/v1/chat/completions",status="429"}'] == 1


def test_engine_bug_is_a_500_and_the_server_goes_on(tok):
    engine = ScriptedEngine(tok, script(tok, "abcdef"), fail_at=3)
    client, _ = make(engine)
    r = chat(client)
    assert r.status_code == 500 and r.json["error"]["type"] == "server_error"
    events = sse_events(chat(client, stream=True).content)
    assert "error" in events[-2] and events[-1] == "DONE"
    engine.fail_at = None
    assert chat(client).json["choices"][0]["message"]["content"] == "abcdef"


def test_shutdown_refuses_new_work_with_503(tok):
    client, service = make(ScriptedEngine(tok, script(tok, "x")))
    service.warmup("Hello", 2)
    service.close(grace=1)
    r = chat(client)
    assert r.status_code == 503
    assert client.simulate_get("/health").json == {"status": "shutting_down"}
    r = client.simulate_get("/ready")
    assert r.status_code == 503 and r.json == {"status": "shutting_down"}


def test_ready_only_once_warm_and_without_a_key(tok):
    engine = ScriptedEngine(tok, script(tok, "warm"))
    client, service = make(engine)
    none = {"Authorization": ""}
    r = client.simulate_get("/ready", headers=none)
    assert r.status_code == 503 and r.json == {"status": "warming_up"}
    assert r.headers["content-type"].startswith("application/json")
    assert client.simulate_get("/health", headers=none).status_code == 200  # alive meanwhile
    before = engine.forwards
    service.warmup("Hello", 2)
    assert engine.forwards > before  # the warmup ran on the engine
    r = client.simulate_get("/ready", headers=none)
    assert r.status_code == 200 and r.json == {"status": "ok"}
    cold, _ = make(ScriptedEngine(tok, script(tok, "x")), eager_load=False)
    assert cold.simulate_get("/ready").json == {"status": "ok"}  # no warmup was asked for


def test_metrics_count_requests_tokens_and_latencies(tok):
    client, _ = make(ScriptedEngine(tok, script(tok, "four")))
    for stream in (False, True):
        chat(client, stream=stream)
        complete(client, stream=stream)
    chat(client, temperature="hot")
    r = client.simulate_get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse_metrics(r.text)
    assert m['hipc_requests_total{endpoint="/v1/chat/completions",status="200"}'] == 2
    assert m['hipc_requests_total{endpoint="/v1/completions",status="200"}'] == 2
    assert m['hipc_requests_total{endpoint="/v1/chat/completions",status="400"}'] == 1
    assert m["hipc_generation_tokens_total"] == 16
    assert m["hipc_time_to_first_token_seconds_count"] == 4
    assert m["hipc_time_per_output_token_seconds_count"] == 12
    assert m['hipc_time_to_first_token_seconds_bucket{le="+Inf"}'] == 4
    assert m["hipc_queue_depth"] == 0 and m["hipc_requests_running"] == 0
    assert m["process_resident_memory_bytes"] > 0
    r = client.simulate_get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")
    assert parse_metrics(r.text)['hipc_requests_total{endpoint="/metrics",status="200"}'] == 1


def test_a_streams_log_line_times_the_whole_stream(tok, caplog):
    import logging
    import re

    delay, words = 0.05, "one two three four five six seven eight"
    client, _ = make(ScriptedEngine(tok, script(tok, words), delay=delay))
    caplog.set_level(logging.INFO, logger="hipc.server")
    r = chat(client, stream=True)
    steps = len(script(tok, words)) + 1  # every scripted token, then EOS
    assert len(sse_events(r.content)) > 2
    lines = [m.getMessage() for m in caplog.records if "/v1/chat/completions" in m.getMessage()]
    assert len(lines) == 1, lines  # once, at the end, not also at the headers
    ms = float(re.search(r" 200 ([0-9.]+) ms \(stream, \d+ chunks\)", lines[0]).group(1))
    assert ms >= 0.9 * steps * delay * 1e3, lines[0]
    caplog.clear()
    assert chat(client).status_code == 200
    (line,) = [m.getMessage() for m in caplog.records if "/v1/chat/completions" in m.getMessage()]
    assert "stream" not in line
