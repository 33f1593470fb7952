"""Structured outputs (response_format) and tool calling.

Outputs are checked with `jsonschema`, an implementation independent of the grammar library
that constrained them; tool calls round-trip through the official openai client against a
served artifact, streamed and not.
"""

from __future__ import annotations

import json

import falcon.testing
import jsonschema
import pytest

from hipc.cli.main import main
from hipc.runtime.server.app import create_app
from hipc.runtime.server.config import Config
from hipc.runtime.server.service import Service
from hipc.runtime.server.tools import ToolSpec, prepare_messages

from serving import NoisyEngine, ScriptedEngine, running, script, sse_events, tiny_tokenizer
from support import CHATML_TEMPLATE, write_tiny_chat_model

pytest.importorskip("llguidance")

KEY = "sk-unit"
AUTH = {"Authorization": f"Bearer {KEY}"}

# Schemas with every shape the task names: nested objects, arrays, enums, bounded numbers.
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "country": {"enum": ["France", "Japan", "Peru"]},
                },
                "required": ["name", "country"],
                "additionalProperties": False,
            },
            "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
        },
        "required": ["city", "population_millions"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue", "yellow"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["colors", "ok"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["score", "ratio", "level"],
        "additionalProperties": False,
    },
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def schema_format(name: str) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, server_logs):
    """The tiny model with room for a tool listing (spelled out byte by byte, ~750 tokens)."""
    root = tmp_path_factory.mktemp("tiny-tools")
    write_tiny_chat_model(root / "tiny", max_context=2048)
    assert main(["compile", str(root / "tiny"), "-o", str(root / "t.hipc"), "-q"]) == 0
    with running(
        root / "t.hipc", "--served-model-name", "tiny", "--threads", "1", log_dir=server_logs
    ) as server:
        yield server


class EndingEngine(NoisyEngine):
    """Random logits with end-of-sequence likely wherever the grammar allows it."""

    def forward(self, tokens, start):
        logits = super().forward(tokens, start)
        logits[self.tokenizer.eos_token_ids[0]] = 4.0
        return logits


def make(engine) -> falcon.testing.TestClient:
    cfg = Config(served_model_name="fake", api_key=KEY)
    return falcon.testing.TestClient(create_app(engine, cfg, Service(engine, cfg)), headers=AUTH)


def post(client, path, **body):
    return client.simulate_post(path, json={"model": "fake", **body})


def chat(client, **body):
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return post(client, "/v1/chat/completions", **body)


def assemble_tool_calls(deltas: list[dict]) -> list[dict]:
    """OpenAI's client-side rule: a delta with an index either starts a call or appends to
    its arguments."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"function": {"name": "", "arguments": ""}})
        if d.get("id"):
            c["id"], c["type"] = d["id"], d.get("type")
        fn = d.get("function") or {}
        c["function"]["name"] += fn.get("name") or ""
        c["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def check_calls(calls: list[dict], names=None) -> None:
    assert calls
    for c in calls:
        name = c["function"]["name"]
        assert name in (names or PARAMS)
        assert c["id"].startswith("call_") and c["type"] == "function"
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[name])


# ------------------------------------------------------------------ response_format, in-process


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_outputs_validate_under_random_logits(tok, name):
    """Random logits sampled at temperature 1: only the mask keeps the output valid."""
    client = make(NoisyEngine(tok, max_context=2048))
    r = chat(client, response_format=schema_format(name), temperature=1.0, seed=3, n=4)
    assert r.status_code == 200, r.text
    finished = [c for c in r.json["choices"] if c["finish_reason"] == "stop"]
    assert finished, r.json
    for c in finished:
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMAS[name])
    r = post(client, "/v1/completions", prompt="x", response_format=schema_format(name), seed=4)
    assert r.status_code == 200, r.text
    if r.json["choices"][0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(r.json["choices"][0]["text"]), SCHEMAS[name])


def test_streamed_equals_whole_and_validates(tok):
    client = make(NoisyEngine(tok, max_context=2048))
    body = dict(response_format=schema_format("nested"), temperature=1.0, seed=11)
    whole = chat(client, **body).json["choices"][0]
    events = sse_events(chat(client, stream=True, **body).content)
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
    )
    assert text == whole["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == whole["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])


def test_json_object_is_an_object(tok):
    client = make(NoisyEngine(tok, max_context=2048))
    r = chat(client, response_format={"type": "json_object"}, temperature=1.0, seed=5, n=4)
    stopped = [c for c in r.json["choices"] if c["finish_reason"] == "stop"]
    for c in stopped:
        assert isinstance(json.loads(c["message"]["content"]), dict)


def test_cut_by_max_tokens_is_length(tok):
    client = make(NoisyEngine(tok, max_context=2048))
    r = chat(client, response_format=schema_format("flat"), max_tokens=3)
    assert r.json["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "fmt,param",
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": {}}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"not": {}}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_response_format_is_a_400_naming_the_field(tok, fmt, param):
    r = chat(make(NoisyEngine(tok, max_context=2048)), response_format=fmt)
    assert r.status_code == 400 and r.json["error"]["param"] == param, r.json


def test_unsupported_keyword_is_named(tok):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": {"type": "object", "if": {"type": "object"}}},
    }
    r = chat(make(NoisyEngine(tok, max_context=2048)), response_format=fmt)
    assert r.status_code == 400 and '"if"' in r.json["error"]["message"], r.json


# ------------------------------------------------------------------ tools, in-process


HERMES_CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}\n</tool_call>'


def test_auto_parses_the_models_markup(tok):
    client = make(
        ScriptedEngine(tok, script(tok, "Let me check.\n" + HERMES_CALL), max_context=2048)
    )
    r = chat(client, tools=TOOLS)
    c = r.json["choices"][0]
    assert c["finish_reason"] == "tool_calls", r.json
    assert c["message"]["content"] == "Let me check.\n"
    check_calls(c["message"]["tool_calls"])
    args = json.loads(c["message"]["tool_calls"][0]["function"]["arguments"])
    assert args == {"city": "Paris", "unit": "celsius"}

    events = sse_events(chat(client, tools=TOOLS, stream=True).content)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == c["message"]["content"]
    assert "<tool_call>" not in content
    calls = assemble_tool_calls([t for d in deltas for t in d.get("tool_calls", [])])
    assert [x["function"] for x in calls] == [x["function"] for x in c["message"]["tool_calls"]]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_leaves_plain_text_and_broken_calls_as_content(tok):
    broken = "<tool_call>\n{not json}\n</tool_call>"
    for text in ("Just text.", broken):
        client = make(ScriptedEngine(tok, script(tok, text), max_context=2048))
        c = chat(client, tools=TOOLS).json["choices"][0]
        assert c["finish_reason"] == "stop" and c["message"]["content"] == text
        assert not c["message"].get("tool_calls")
        events = sse_events(chat(client, tools=TOOLS, stream=True).content)
        streamed = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
        )
        assert streamed == text


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_calls_are_valid_under_random_logits(tok, choice, parallel):
    client = make(EndingEngine(tok, max_context=2048))
    r = chat(
        client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
        temperature=1.0, seed=7, n=3, max_tokens=150,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    names = None if choice == "required" else ["get_time"]
    done = [c for c in r.json["choices"] if c["finish_reason"] == "tool_calls"]
    assert done, r.json
    for c in done:
        assert c["message"]["content"] is None
        check_calls(c["message"]["tool_calls"], names)
        if not parallel:
            assert len(c["message"]["tool_calls"]) == 1


# A Llama-3.1-style fragment: tools as JSON in the user turn, a call is a bare JSON object.
LLAMA_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}\n"
    "{% if tools and loop.last %}Respond with a JSON function call "
    '{"name": function name, "parameters": dictionary of argument name and its value}.\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '{{ {"name": c.function.name, "parameters": c.function.arguments} | tojson }}'
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def test_llama_json_style_template(tok, tmp_path):
    template = tmp_path / "llama.jinja"
    template.write_text(LLAMA_TEMPLATE)
    engine = EndingEngine(tok, max_context=2048)
    cfg = Config(served_model_name="fake", api_key=KEY, chat_template=str(template))
    client = falcon.testing.TestClient(create_app(engine, cfg, Service(engine, cfg)), headers=AUTH)
    r = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=1, n=3)
    assert r.status_code == 200, r.text
    done = [c for c in r.json["choices"] if c["finish_reason"] != "length"]
    assert done, r.json
    for c in done:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        check_calls(c["message"]["tool_calls"])
        assert len(c["message"]["tool_calls"]) == 1

    scripted = ScriptedEngine(
        tok, script(tok, '{"name": "get_time", "parameters": {"zone": "CET"}}'), max_context=2048
    )
    client = falcon.testing.TestClient(
        create_app(scripted, cfg, Service(scripted, cfg)), headers=AUTH
    )
    c = chat(client, tools=TOOLS).json["choices"][0]
    assert c["finish_reason"] == "tool_calls"
    assert json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) == {"zone": "CET"}


def test_tool_choice_none_offers_no_tools(tok):
    client = make(ScriptedEngine(tok, script(tok, HERMES_CALL), max_context=2048))
    c = chat(client, tools=TOOLS, tool_choice="none").json["choices"][0]
    assert c["finish_reason"] == "stop" and not c["message"].get("tool_calls")


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
]

# A Qwen2.5-style template fragment: tools in the system turn, calls and results in markup.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, TOOL_TEMPLATE])
def test_history_renders_calls_and_results(tok, template):
    from hipc.base.chat_template import render_chat
    from hipc.runtime.server.validation import Limits, parse_chat

    limits = Limits(max_body_bytes=1 << 20, max_json_depth=64, max_n=4, vocab_size=384)
    p = parse_chat({"model": "m", "messages": HISTORY, "tools": TOOLS}, limits)
    assert isinstance(p.tools, ToolSpec)
    messages, tools = prepare_messages([dict(m) for m in p.messages], p.tools, template)
    text = render_chat(template, messages, tools=tools)
    call = json.loads(text.split("<tool_call>\n")[-1].split("\n</tool_call>")[0])
    assert call == {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in text
    assert '"name": "get_time"' in text  # the tools are offered


def test_bad_tool_history_is_a_400(tok):
    client = make(NoisyEngine(tok, max_context=2048))
    bad = [dict(HISTORY[1], tool_calls=[{"function": {"name": "f", "arguments": "{oops"}}])]
    r = chat(client, messages=[HISTORY[0], *bad])
    assert r.status_code == 400
    assert r.json["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    r = chat(client, messages=[HISTORY[0], {"role": "tool", "content": "x"}])
    assert r.json["error"]["param"] == "messages[1].tool_call_id"


# ------------------------------------------------------------------ the openai client, served


def client_stream_calls(client, **kw):
    deltas, content, finish = [], [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content.append(c.delta.content or "")
            deltas += [t.model_dump() for t in c.delta.tool_calls or []]
            finish = c.finish_reason or finish
    return "".join(content), assemble_tool_calls(deltas), finish


def test_tool_round_trip_through_the_openai_client(tool_server):
    client = tool_server.client()
    kw = dict(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, temperature=0.8, seed=2,
        max_tokens=200,
    )  # fmt: skip
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", r
    calls = [c.model_dump() for c in msg.tool_calls]
    check_calls(calls)
    content, streamed, finish = client_stream_calls(client, **kw)
    assert finish == "tool_calls" and not content
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]

    # the call and its result go back as history; the answer is text again
    history = [
        *kw["messages"],
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "21 C"},
    ]
    r2 = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=5)
    assert r2.choices[0].finish_reason in ("stop", "length")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens

    named = {"type": "function", "function": {"name": "get_time"}}
    r3 = client.chat.completions.create(**{**kw, "tool_choice": named})
    check_calls([c.model_dump() for c in r3.choices[0].message.tool_calls], ["get_time"])


def test_schema_through_the_openai_client(tool_server):
    client = tool_server.client()
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], temperature=0.7, seed=1,
        response_format=schema_format("array"), max_tokens=100,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["array"])


def test_pydantic_parse_through_the_openai_client(tool_server):
    """client.chat.completions.parse sends the strict schema pydantic makes ($defs, $ref,
    titles, anyOf with null) and parses the reply back into the model."""
    from enum import Enum

    from pydantic import BaseModel, Field

    class Size(str, Enum):
        small = "small"
        large = "large"

    class Item(BaseModel):
        label: str = Field(max_length=6)
        qty: int = Field(ge=1, le=9)
        size: Size | None

    class Order(BaseModel):
        items: list[Item] = Field(max_length=2)
        rush: bool

    r = tool_server.client().chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "x"}], response_format=Order,
        temperature=0.7, seed=3, max_tokens=150,
    )  # fmt: skip
    order = r.choices[0].message.parsed
    assert isinstance(order, Order) and all(1 <= i.qty <= 9 for i in order.items)


# ------------------------------------------------------------------ the real SmolLM2


QUESTIONS = {
    "flat": "Give a made-up person's name and age as JSON.",
    "nested": "Describe the city of Paris as JSON: its name, country and population.",
    "array": "List two colors of a rainbow as JSON.",
    "numbers": "Rate this sentence as JSON: 'The cat sat on the mat.'",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_smollm2_schema_outputs_validate(smol_server, name):
    client = smol_server.client()
    kw = dict(
        model="smol", messages=[{"role": "user", "content": QUESTIONS[name]}],
        response_format=schema_format(name), max_tokens=120, temperature=0,
    )  # fmt: skip
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop", r
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
    parts = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    ]
    assert "".join(parts) == r.choices[0].message.content


@pytest.mark.slow
def test_smollm2_tool_calls(smol_server):
    client = smol_server.client()
    kw = dict(
        model="smol", messages=[{"role": "user", "content": "What is the weather in Lima?"}],
        tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0,
    )  # fmt: skip
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls", r
    calls = [c.model_dump() for c in r.choices[0].message.tool_calls]
    check_calls(calls)
    _, streamed, finish = client_stream_calls(client, **kw)
    assert finish == "tool_calls"
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]


def api_examples(section: str) -> list[str]:
    """The ```python blocks of one section of docs/API.md."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "API.md").read_text()
    body = doc.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [b.split("```", 1)[0] for b in body.split("```python\n")[1:]]


@pytest.mark.slow
@pytest.mark.parametrize("section", ["Structured outputs", "Tool calling"])
def test_api_md_examples_run_as_written(smol_server, section, capsys):
    blocks = api_examples(section)
    assert blocks
    for code in blocks:
        assert 'base_url="http://127.0.0.1:8000/v1", api_key="sk-local"' in code
        code = code.replace("http://127.0.0.1:8000/v1", smol_server.base_url)
        code = code.replace('"sk-local"', repr(smol_server.api_key))
        exec(compile(code, f"docs/API.md ({section})", "exec"), {})
    out = capsys.readouterr().out
    assert out.strip()
    if section == "Tool calling":
        assert "get_weather" in out


@pytest.mark.parametrize("syntax", ["hermes", "llama3_json"])
def test_stream_filter_equals_parse_reply_for_any_cut(syntax):
    """Streamed content + calls equal the non-streamed parse, however the text is cut."""
    import random

    from hipc.runtime.server.tools import StreamFilter, parse_reply, parse_tools

    spec = parse_tools(TOOLS, "auto", True)
    call = '{"name": "get_time", "%s": {"zone": "UTC"}}' % (
        "arguments" if syntax == "hermes" else "parameters"
    )
    if syntax == "hermes":
        replies = [
            f"Sure.\n<tool_call>\n{call}\n</tool_call>\n<tool_call>\n{call}\n</tool_call>",
            "No call <tool_ here.",
            f"<tool_call>\n{call}",
        ]
    else:
        replies = [call, f"  {call}\n", "Plain answer {not a call}."]
    rng = random.Random(0)
    for text in replies:
        want_content, want_calls = parse_reply(text, spec, syntax)
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            f = StreamFilter(spec, syntax)
            streamed = "".join(f.feed(p) for p in pieces)
            tail, calls = f.finish()
            assert streamed + tail == (want_content or "")
            assert [c["function"] for c in calls] == [c["function"] for c in want_calls]
        assert bool(want_calls) == (text != "No call <tool_ here." and "not a call" not in text)


def test_without_llguidance_a_clear_400(tok, monkeypatch):
    from hipc.runtime import constraint

    monkeypatch.setattr(constraint, "available", lambda: False)
    client = make(ScriptedEngine(tok, script(tok, HERMES_CALL), max_context=2048))
    r = chat(client, response_format={"type": "json_object"})
    assert r.status_code == 400 and "llguidance" in r.json["error"]["message"]
    assert r.json["error"]["param"] == "response_format"
    c = chat(client, tools=TOOLS).json["choices"][0]  # auto needs no grammar
    assert c["finish_reason"] == "tool_calls"
