"""Rendering a model's own Jinja chat template, the way transformers does.

Chat templates ship with models and are untrusted code, so they run in Jinja's immutable
sandbox. The environment matches what transformers gives templates (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, its `tojson`, the
`{% generation %}` tag) because templates are written against that, and a prompt that
differs by one newline from the one the model was trained on degrades its answers.

jinja2 is imported only when a template is first rendered, so loading the runtime does not
pay for it.
"""

from __future__ import annotations

import functools
import json
import types
from datetime import datetime
from typing import Any

from hipc.base.errors import HipcError

# For models that ship no template. ChatML, as transformers' old default was.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Jinja names the source of templates built from strings like this in tracebacks.
_TEMPLATE_FILENAME = "<template>"


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    /,
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """The prompt text `template` makes of `messages`.

    `extra` reaches the template as further variables (documents, enable_thinking, ...);
    it cannot replace the variables named here (`template` and `messages` are
    positional-only, so even those names are free for `extra`). Any failure, the
    template's own `raise_exception` included, is a HipcError.
    """
    import jinja2

    compiled = _compile(template)
    context = {
        **extra,
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "tools": tools,
    }
    try:
        return compiled.render(context)
    except HipcError:
        raise
    except jinja2.TemplateError as exc:
        raise HipcError(f"chat template{_where(exc)}: {_message(exc)}") from None
    except Exception as exc:
        # A template can fail in plain Python too ('a' + 1, a missing key on a dict).
        raise HipcError(f"chat template{_where(exc)}: {type(exc).__name__}: {exc}") from None


def check_template(template: str) -> None:
    """Raise HipcError if `template` does not parse; useful at compile time."""
    _compile(template)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    import jinja2

    if not isinstance(template, str):
        raise HipcError(f"chat template: expected a string, got {type(template).__name__}")
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise HipcError(f"chat template line {exc.lineno}: {_message(exc)}") from None


@functools.cache
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # transformers uses {% generation %} to find assistant spans when training; for
        # rendering a prompt it only passes its body through.
        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class GuardedNamespace(jinja2.utils.Namespace):
        # A namespace is the one object a template can write to: keep it away from
        # underscore names, the way into Python internals.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_namespace_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_namespace_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = GuardedNamespace
    # The builtin dict type would hand out its classmethods; a plain function cannot.
    env.globals["dict"] = _make_dict
    return env


# What render_chat itself gives every template; callers that pass variables from
# untrusted input refuse these names rather than let them be shadowed.
RESERVED_NAMES = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"}
    | {"raise_exception", "strftime_now", "namespace", "dict"}
)


def _check_namespace_name(name: Any) -> None:
    import jinja2

    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"namespace attribute {name!r} is not allowed (underscore-prefixed)"
        )


def _make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise HipcError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt;
    # json.dumps with these options is what templates are written against.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=tuple(separators) if separators is not None else None,
        sort_keys=sort_keys,
    )


def _message(exc: Exception) -> str:
    text = (getattr(exc, "message", None) or str(exc) or type(exc).__name__).strip()
    return " ".join(text.split())


def _where(exc: BaseException) -> str:
    """' line N' for the deepest template frame of a render error, if there is one."""
    lineno = getattr(exc, "lineno", None)
    tb: types.TracebackType | None = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == _TEMPLATE_FILENAME:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return f" line {lineno}" if lineno else ""
