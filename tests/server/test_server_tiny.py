"""The real `hipc serve` on loopback with a tiny compiled artifact, driven by the official
openai client. Expected outputs come from running the same engine in this process."""

from __future__ import annotations

import threading

import numpy as np
import openai
import pytest

from hipc.runtime.engine import load_engine
from hipc.runtime.generate import Generation, GenerationRequest
from hipc.runtime.sampler import SamplingParams, log_softmax

from serving import sse_events

PROMPTS = ["Hello", "The quick brown fox", "café 日本 😀", "one two three four five"]


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    eng = load_engine(tiny_artifact, threads=1)
    yield eng
    eng.close()


def direct(engine, prompt_ids, max_tokens, **sampling):
    gen = Generation(
        engine,
        engine.tokenizer,
        GenerationRequest(tuple(prompt_ids), max_tokens, SamplingParams(**sampling)),
    )
    for _ in gen.steps():
        pass
    return gen.result


def chat_ids(engine, messages):
    tok = engine.tokenizer
    return tok.encode(tok.render_chat(messages), add_special_tokens=False)


def collect_chat(stream):
    content, reasoning, finish, usage, roles = [], [], None, None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += c.delta.role == "assistant"
            content.append(c.delta.content or "")
            reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
            finish = c.finish_reason or finish
    return "".join(content), "".join(reasoning), finish, usage, roles


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_match_the_engine_streamed_or_not(tiny_server, engine, prompt):
    client = tiny_server.client()
    res = direct(engine, engine.tokenizer.encode(prompt), 40)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
    assert r.choices[0].text == res.text
    assert r.choices[0].finish_reason == res.finish_reason
    assert r.usage.prompt_tokens == len(res.prompt_token_ids)
    assert r.usage.completion_tokens == len(res.token_ids)
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == res.text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_chat_streaming_equals_non_streaming_equals_engine(tiny_server, engine, prompt):
    client = tiny_server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    res = direct(engine, chat_ids(engine, messages), 48)
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=48, temperature=0
    )
    msg = r.choices[0].message
    # the tokenizer knows <think>, so a reply that happens to open with it would be split
    assert (
        msg.reasoning_content is None and msg.content == res.text
    ) or res.text.lstrip().startswith("<think>")
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, reasoning, finish, usage, roles = collect_chat(stream)
    assert (content, reasoning or None) == (msg.content, msg.reasoning_content)
    assert finish == r.choices[0].finish_reason == res.finish_reason
    assert usage.model_dump() == r.usage.model_dump()
    assert usage.completion_tokens == len(res.token_ids) and roles == 1


def test_logprobs_are_the_engines(tiny_server, engine):
    client = tiny_server.client()
    ids = engine.tokenizer.encode("The quick brown fox")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, logprobs=3)
    res = direct(engine, ids, 8)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(res.token_ids)
    rows = engine.logits(ids + res.token_ids[:-1], 0)[len(ids) - 1 :]
    for got, token, row, top in zip(
        lp.token_logprobs, res.token_ids, rows, lp.top_logprobs, strict=True
    ):
        ref = log_softmax(row)
        assert got == pytest.approx(ref[token], abs=2e-3)
        best3 = np.sort(ref)[-3:]
        # (several byte tokens print as the same U+FFFD, so the dict may hold fewer than 3)
        assert all(np.abs(best3 - v).min() < 2e-3 for v in top.values())
        assert int(np.argmax(ref)) == token  # greedy picked the top token


def test_seeded_sampling_repeats_and_n_choices_follow_seed_plus_i(tiny_server, engine):
    client = tiny_server.client()
    kw = dict(model="tiny", prompt="Hello", max_tokens=24, temperature=0.9, top_p=0.95)
    a = client.completions.create(seed=5, **kw).choices[0].text
    assert a == client.completions.create(seed=5, **kw).choices[0].text
    many = client.completions.create(seed=5, n=3, **kw).choices
    assert [c.text for c in many] == [
        a,
        client.completions.create(seed=6, **kw).choices[0].text,
        client.completions.create(seed=7, **kw).choices[0].text,
    ]
    assert len({c.text for c in many}) == 3
    res = direct(engine, engine.tokenizer.encode("Hello"), 24, temperature=0.9, top_p=0.95, seed=5)
    assert res.text == a


def test_stop_strings_cut_where_the_engine_output_has_them(tiny_server, engine):
    client = tiny_server.client()
    ids = engine.tokenizer.encode("one two three four five")
    full = direct(engine, ids, 60).text
    visible = [i for i in range(8, len(full) - 4) if "\ufffd" not in full[i : i + 3]]
    at = visible[len(visible) // 2]
    stop = full[at : at + 3]
    want = full[: full.find(stop)]
    for stream in (False, True):
        r = client.completions.create(
            model="tiny",
            prompt=ids,
            max_tokens=60,
            temperature=0,
            stop=[stop, "\x00never"],
            stream=stream,
        )
        if stream:
            chunks = [c.choices[0] for c in r if c.choices]
            text, finish = "".join(c.text for c in chunks), chunks[-1].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == (want, "stop")


def test_eight_concurrent_clients_each_get_their_own_output(tiny_server, engine):
    jobs = []
    for i in range(8):
        messages = [{"role": "user", "content": f"{PROMPTS[i % 4]} #{i}"}]
        seed = 100 + i
        want = direct(engine, chat_ids(engine, messages), 64, temperature=0.8, seed=seed).text
        jobs.append((messages, seed, want, i % 2 == 0))
    got: dict[int, tuple] = {}
    barrier = threading.Barrier(8)

    def run(i, messages, seed, want, stream):
        client = tiny_server.client()
        barrier.wait()
        kw = dict(model="tiny", messages=messages, max_tokens=64, temperature=0.8, seed=seed)
        if stream:
            content, reasoning, *_ = collect_chat(client.chat.completions.create(stream=True, **kw))
        else:
            msg = client.chat.completions.create(**kw).choices[0].message
            content, reasoning = msg.content, msg.reasoning_content or ""
        got[i] = (content, reasoning)

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == 8
    for i, (_, _, want, _) in enumerate(jobs):
        content, reasoning = got[i]
        assert content == want or (reasoning and want.lstrip().startswith("<think>")), i


def test_auth_with_the_openai_client(tiny_server):
    with pytest.raises(openai.AuthenticationError):
        tiny_server.client(api_key="sk-wrong").models.list()
    assert [m.id for m in tiny_server.client().models.list()] == ["tiny"]
    status, _headers, _body = tiny_server.request("GET", "/health", auth=False)
    assert status == 200


def test_unknown_model_and_bad_field_surface_as_client_errors(tiny_server):
    client = tiny_server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"foo": 1})
    assert "Unrecognized request argument supplied: foo" in str(e.value)


def test_raw_sse_framing(tiny_server):
    status, headers, body = tiny_server.request(
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "stream": True,
        },
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(body)
    assert events[-1] == "DONE"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"


def test_reasoning_when_the_template_opens_think(think_server, engine):
    """The chat template ends the prompt with '<think>\\n'; the random model writes on, and
    a logit bias on '</think>' makes it close the block after a few tokens. The split must
    agree with the raw completion of the same rendered prompt."""
    client = think_server.client()
    close = engine.tokenizer.token_to_id("</think>")
    kw = dict(model="thinker", max_tokens=40, temperature=1.0, seed=3, logit_bias={str(close): 4})
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    from hipc.base.chat_template import render_chat

    from support import THINK_TEMPLATE

    prompt = render_chat(THINK_TEMPLATE, messages, eos_token="<|im_end|>")
    assert prompt.endswith("<think>\n")
    raw = client.completions.create(prompt=engine.tokenizer.encode(prompt), **kw).choices[0].text
    assert "</think>" in raw, raw  # the bias did its job for this seed
    want_reasoning, want_content = raw.split("</think>", 1)
    msg = client.chat.completions.create(messages=messages, **kw).choices[0].message
    assert (msg.reasoning_content, msg.content) == (want_reasoning, want_content)
    content, reasoning, *_ = collect_chat(
        client.chat.completions.create(messages=messages, stream=True, **kw)
    )
    assert (reasoning, content) == (want_reasoning, want_content)
    assert [m.id for m in client.models.list()] == ["thinker"]  # HIPC_SERVED_MODEL_NAME
    status, _, _ = think_server.request("GET", "/v1/models", auth=False)
    assert status == 401  # HIPC_API_KEY


def test_startup_logs_the_kv_cache_and_warms_up_before_listening(tiny_server):
    """The default pool holds --max-batch (4 by default) admitted contexts of 256."""
    log = tiny_server.log()
    assert "cpu target, KV cache float32, 256 positions per sequence" in log
    assert "admitting 256 tokens per request" in log
    assert "KV pool: 64 blocks of 16 positions = 1024 positions" in log
    assert "up to 4 sequences per step" in log
    assert log.index("warmup: 4 tokens") < log.index("ready: http://127.0.0.1:")
    m = tiny_server.metrics()
    assert (
        m["hipc_kv_cache_bytes"] == 2 * 2 * 4 * 256 * 2 * 8 * 4
    )  # layers x K,V x 4 contexts x kv heads x dim x f32
    assert m["hipc_max_context_tokens"] == 256
