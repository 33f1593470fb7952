"""Tool calling: OpenAI `tools` in, the model's own call markup out, OpenAI `tool_calls` back.

Which markup a model writes is whatever its chat template teaches it: a template that
mentions `<tool_call>` (Qwen, Hermes) gets `<tool_call>{"name": .., "arguments": ..}
</tool_call>` blocks; one in the Llama-3.1 style (`"parameters"`, `<|python_tag|>`,
`ipython`) gets one bare `{"name": .., "parameters": ..}` object. A template that renders
no tools at all (SmolLM2's plain ChatML) gets the Hermes convention spelled out in a system
message, with earlier calls and results written the same way, so any chat model can be
offered tools. `required` and a named `tool_choice` constrain decoding with a grammar
(runtime/constraint.py) so the call is valid JSON for its tool's parameters; `auto`
leaves the model free and parses what it wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from hipc.runtime.server.errors import APIError, bad_request

HERMES, LLAMA_JSON = "hermes", "llama3_json"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[dict[str, Any], ...]  # OpenAI tool objects, checked
    choice: str  # "auto", "required", or the name of the one function to call
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def schema(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def _type_error(name: str, expected: str, value: Any) -> APIError:
    shown = json.dumps(value)[:100] if not isinstance(value, str) else repr(value)[:100]
    return bad_request(
        f"Invalid type for '{name}': expected {expected}, but got {shown} instead.",
        param=name,
        code="invalid_type",
    )


def parse_tools(tools: Any, choice: Any, parallel: bool) -> ToolSpec | None:
    """The checked `tools`/`tool_choice`, or None when no tool may be called."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request(
                "'tool_choice' needs 'tools': there is no tool to call.", param="tool_choice"
            )
        return None
    if not isinstance(tools, list):
        raise _type_error("tools", "an array of tools", tools)
    checked, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _type_error(where, "an object", tool)
        if tool.get("type") != "function":
            raise bad_request(
                f"'{where}.type' must be 'function' (the only tool type this server runs).",
                param=f"{where}.type",
                code="unsupported_parameter",
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _type_error(f"{where}.function", "an object", fn)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"Invalid '{where}.function.name': a function name is 1-64 letters, digits, "
                "'_' or '-'.",
                param=f"{where}.function.name",
                code="invalid_value",
            )
        if name in seen:
            raise bad_request(
                f"'{where}.function.name': {name!r} is defined twice.",
                param=f"{where}.function.name",
            )
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _type_error(f"{where}.function.parameters", "a JSON schema object", params)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _type_error(f"{where}.function.description", "a string", desc)
        if params is not None:
            _check_schema(params, f"{where}.function.parameters")
        checked.append({"type": "function", "function": dict(fn)})
    if choice is None or choice == "auto":
        name = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        name = "required"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in seen:
            raise bad_request(
                f"Invalid 'tool_choice.function.name': {name!r} is not one of the tools "
                f"({', '.join(sorted(seen))}).",
                param="tool_choice.function.name",
                code="invalid_value",
            )
    else:
        raise _type_error(
            "tool_choice", "'none', 'auto', 'required' or a {type: function} object", choice
        )
    return ToolSpec(tuple(checked), name, parallel)


def _check_schema(schema: dict[str, Any], param: str) -> None:
    from hipc.base.errors import HipcError
    from hipc.runtime.constraint import available, json_schema_grammar

    if not available():
        return  # `auto` needs no grammar; a forced choice is refused with MISSING later
    try:
        json_schema_grammar(schema)
    except HipcError as e:
        raise bad_request(
            f"Invalid schema in '{param}': {e}.", param=param, code="invalid_schema"
        ) from None


def parse_tool_calls(v: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, with `arguments` decoded to an object: chat
    templates (transformers' convention) write them with `tojson`."""
    if not isinstance(v, list):
        raise _type_error(where, "an array of tool calls", v)
    out = []
    for i, call in enumerate(v):
        at = f"{where}[{i}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise _type_error(at, "an object with a 'function'", call)
        fn = call["function"]
        if not isinstance(fn.get("name"), str):
            raise _type_error(f"{at}.function.name", "a string", fn.get("name"))
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise bad_request(
                    f"'{at}.function.arguments' is not valid JSON.",
                    param=f"{at}.function.arguments",
                ) from None
        if not isinstance(args, dict):
            raise _type_error(f"{at}.function.arguments", "a JSON object", args)
        item = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            item["id"] = call["id"]
        out.append(item)
    return out


# ------------------------------------------------------------------ prompts


def template_renders_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def syntax_of(template: str | None) -> str:
    t = template or ""
    if _OPEN in t:
        return HERMES
    if "<|python_tag|>" in t or "ipython" in t or '"parameters"' in t:
        return LLAMA_JSON
    return HERMES


def prepare_messages(
    messages: list[dict[str, Any]], spec: ToolSpec | None, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` to render. A template that knows tools gets them as they
    are; for one that does not, tools, calls and results are written into the messages."""
    has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if template_renders_tools(template):
        return messages, [dict(t) for t in spec.tools] if spec else None
    if spec is None and not has_calls:
        return messages, None
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = [
                f"{_OPEN}\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                )
                + f"\n{_CLOSE}"
                for c in m["tool_calls"]
            ]
            text = "\n".join(([m["content"]] if m["content"] else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append(
                {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
        else:
            out.append(m)
    if spec is not None:
        system = _hermes_system(spec)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def _hermes_system(spec: ToolSpec) -> str:
    listing = "\n".join(json.dumps(t) for t in spec.tools)
    return (
        "You may call one or more functions to assist with the user query. The functions "
        f"are listed within <tools></tools>:\n<tools>\n{listing}\n</tools>\n\nFor each "
        "function call, return a JSON object with the function name and arguments within "
        '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call>'
    )


# ------------------------------------------------------------------ grammar


def forced_call_grammar(spec: ToolSpec, syntax: str, tokenizer) -> str:
    """The grammar of a reply that is only tool calls (one, or several if parallel)."""
    from hipc.runtime.constraint import json_in_lark, lark_grammar

    names = [spec.choice] if spec.choice != "required" else spec.names
    key = "parameters" if syntax == LLAMA_JSON else "arguments"
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, key: spec.schema(n)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for n in names
    ]
    call_schema = options[0] if len(options) == 1 else {"anyOf": options}
    if syntax == LLAMA_JSON:
        return lark_grammar(f"start: call\ncall: {json_in_lark(call_schema)}\n")
    # a model whose vocabulary has the markers as special tokens must write those tokens
    open_, close = (_lark_token(tokenizer, m) for m in (_OPEN, _CLOSE))
    start = 'start: call ("\\n" call)*' if spec.parallel else "start: call"
    return lark_grammar(
        f'{start}\ncall: {open_} "\\n" body "\\n" {close}\nbody: {json_in_lark(call_schema)}\n'
    )


def _lark_token(tokenizer, marker: str) -> str:
    tid = tokenizer.token_to_id(marker)
    return f"<[{tid}]>" if tid is not None else json.dumps(marker)


# ------------------------------------------------------------------ parsing replies

_BLOCK = re.compile(re.escape(_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(_CLOSE) + r"|$)", re.S)


def parse_reply(text: str, spec: ToolSpec, syntax: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a reply; what is not a well-formed call of a known
    tool stays content."""
    names = set(spec.names)
    if syntax == LLAMA_JSON:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        call = _call(body, names, ("parameters", "arguments"))
        if call is None:
            return (text or None), []
        return None, [call]
    calls, content, last = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1), names, ("arguments", "parameters"))
        if call is None:
            continue
        content.append(text[last : m.start()])
        last = m.end()
        calls.append(call)
        if not spec.parallel:
            break
    if not calls:
        return (text or None), []
    rest = "".join(content) + (text[last:] if spec.parallel else "")
    return (rest if rest.strip() else None), calls


def _call(body: str, names: set[str], keys: tuple[str, ...]) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


class StreamFilter:
    """Streams content that cannot be part of a call; holds the rest for `finish`."""

    def __init__(self, spec: ToolSpec, syntax: str) -> None:
        self.spec, self.syntax = spec, syntax
        self.text, self.emitted = "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.spec.forced:
            return ""
        if self.syntax == LLAMA_JSON:
            head = self.text.lstrip()
            if not head or head[0] in "{<":
                return ""
            safe = len(self.text)
        else:
            at = self.text.find(_OPEN)
            safe = at if at >= 0 else len(self.text) - _partial(self.text, _OPEN)
        out = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content not yet streamed, tool calls)."""
        content, calls = parse_reply(self.text, self.spec, self.syntax)
        content = content or ""
        tail = content[self.emitted :] if content.startswith(self.text[: self.emitted]) else ""
        return tail, calls


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
