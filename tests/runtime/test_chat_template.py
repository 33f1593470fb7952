"""hipc.base.chat_template against transformers' apply_chat_template."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime

import pytest

from hipc.base.chat_template import CHATML_TEMPLATE, check_template, render_chat
from hipc.base.errors import HipcError

from support import require, smollm2_path


@pytest.fixture(scope="module")
def smollm2() -> tuple[str, object]:
    """(the GGUF's own chat template, transformers' tokenizer loaded from the same file)."""
    path = smollm2_path()
    gguf = require("gguf")
    transformers = require("transformers")
    field = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return field.contents(), theirs


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in haiku."},
        {"role": "user", "content": "Describe the sea."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write 'ünïcödé' and 日本語 😀\n  with spaces  "},
    ],
]


@pytest.mark.oracle
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("n", range(len(CONVERSATIONS)))
def test_smollm2_template_matches_transformers(smollm2, n: int, generation_prompt: bool) -> None:
    template, theirs = smollm2
    messages = CONVERSATIONS[n]
    expected = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    ours = render_chat(
        template,
        messages,
        add_generation_prompt=generation_prompt,
        bos_token=theirs.bos_token,
        eos_token=theirs.eos_token,
    )
    assert ours == expected
    assert ours.startswith("<|im_start|>system\n")


# Features templates lean on: whitespace control, loop controls, namespaces, tojson's
# options, the generation tag, tools, extra variables.
FEATURE_TEMPLATE = """\
{%- set ns = namespace(count=0) -%}
{% for message in messages %}
    {% if message['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
<{{ message['role'] }}>{{ message['content'] | trim }}</{{ message['role'] }}>
    {% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}
Tools:
{{ tools | tojson(indent=2) }}
{{ tools | tojson(sort_keys=true, separators=(',', ':')) }}
{{ tools | tojson(ensure_ascii=true) }}
{% endif %}
{% generation %}count={{ ns.count }} mode={{ mode | default('none') }}{% endgeneration %}
{{ dict(a=1) | tojson }}
{% if add_generation_prompt %}<assistant>{% endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Wetter für <Ort> & "Zeit"',
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.mark.oracle
def test_template_features_match_transformers(smollm2) -> None:
    _, theirs = smollm2
    messages = [
        {"role": "system", "content": "  sys  "},
        {"role": "skip", "content": "x"},
        {"role": "user", "content": "Hi ☃"},
    ]
    for tools, extra in [(TOOLS, {"mode": "fast"}), (None, {})]:
        expected = theirs.apply_chat_template(
            messages,
            chat_template=FEATURE_TEMPLATE,
            tools=tools,
            tokenize=False,
            add_generation_prompt=True,
            **extra,
        )
        assert render_chat(FEATURE_TEMPLATE, messages, tools=tools, **extra) == expected


def test_raise_exception_becomes_hipc_error() -> None:
    template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported!') }}"
        "{% endif %}{% endfor %}"
    )
    with pytest.raises(HipcError, match="Only user and assistant roles are supported!"):
        render_chat(template, [{"role": "tool", "content": "x"}])


def test_tojson_indent_and_unicode() -> None:
    out = render_chat("{{ messages[0] | tojson(indent=4) }}", [{"role": "user", "content": "é<"}])
    assert out == '{\n    "role": "user",\n    "content": "é<"\n}'


def test_strftime_now() -> None:
    assert render_chat("{{ strftime_now('%Y') }}", []) == str(datetime.now().year)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__ }}",
        "{{ messages.append({'role': 'user'}) }}",
        "{{ messages[0].update(role='system') }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{{ strftime_now.__code__.co_consts | list }}",
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",
        "{{ namespace(__class__=1) }}",
    ],
)
def test_sandbox_blocks_unsafe_access(template: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(HipcError, match="chat template"):
        render_chat(template, messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_syntax_error_names_the_line() -> None:
    template = "{% for m in messages %}\n{{ m['content'] }}\n{% endfor\n"
    with pytest.raises(HipcError, match=r"chat template line \d+:"):
        render_chat(template, [])
    with pytest.raises(HipcError, match="chat template line 2: "):
        check_template("ok\n{{ a + }}\n")


def test_runtime_error_names_the_line() -> None:
    template = "line one\n{{ messages[0]['content'] + 1 }}\n"
    with pytest.raises(HipcError, match="chat template line 2: "):
        render_chat(template, [{"role": "user", "content": "x"}])


def test_chatml_fallback() -> None:
    out = render_chat(CHATML_TEMPLATE, [{"role": "user", "content": "Hi"}])
    assert out == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    out = render_chat(
        CHATML_TEMPLATE, [{"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert out == "<|im_start|>user\nHi<|im_end|>\n"


def test_runtime_imports_without_jinja2() -> None:
    code = (
        "import sys, hipc.base.tokenizer, hipc.base.chat_template; "
        "sys.exit(1 if 'jinja2' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
