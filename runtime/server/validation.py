"""Every check on what a client sends, in one place.

The body is read under a size limit, parsed, walked once for nesting depth and unencodable
strings; then the request's pydantic model (models.py, the same one /openapi.json is
generated from) checks which fields exist and the type and bounds of every scalar, and the
code below checks the rest: the nested fields (messages, tools, prompts, response_format)
and every rule that needs the loaded model (vocabulary, --max-n, the grammar library's
JSON-schema keywords). Fields OpenAI defines but this server cannot honour (images, audio,
JSON-schema keywords the grammar library lacks ...) are refused by name; fields nobody
defines get OpenAI's own answer, "Unrecognized request argument supplied". Every failure is
an APIError with the field named in `param`, never an exception deeper in.

NOTE: pydantic's errors are mapped back to the wording below (`_from_pydantic`), which
clients and tests already know. The nested fields stay hand-checked because their messages
name the exact element (`messages[2].content[0].type`) and refuse unsupported OpenAI
features with a reason, where pydantic would report every member of a union.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from hipc.base.chat_template import RESERVED_NAMES
from hipc.runtime.sampler import SamplingParams
from hipc.runtime.server.errors import APIError, bad_request
from hipc.runtime.server.tools import ToolSpec, parse_tool_calls, parse_tools

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_TOP_LOGPROBS = 20  # and for chat
SEED_RANGE = (-(2**63), 2**64 - 1)
INT32 = 2**31 - 1

# The scalar fields the request models (models.py) check, with their bounds: (lo, hi, lo_open)
# for numbers, (lo, hi) for integers, hi None where a server flag sets it (--max-n).
NUMBERS = {
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, 10.0, True),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
}
INTEGERS = {
    "n": (1, None),
    "best_of": (1, None),
    "max_tokens": (1, INT32),
    "max_completion_tokens": (1, INT32),
    "top_k": (-1, INT32),
    "seed": SEED_RANGE,
    "logprobs": (0, MAX_COMPLETION_LOGPROBS),  # /v1/completions; chat's is a boolean
    "top_logprobs": (0, MAX_TOP_LOGPROBS),
}
BOOLEANS = {"stream", "ignore_eos", "echo", "logprobs", "parallel_tool_calls"}
STRINGS = {"model", "reasoning_effort", "verbosity"}
SCALARS = set(NUMBERS) | set(INTEGERS) | BOOLEANS | STRINGS


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int
    max_json_depth: int
    max_n: int
    vocab_size: int
    defaults: dict[str, Any] = field(default_factory=dict)  # the model's generation defaults


@dataclass(frozen=True)
class Common:
    """What completions and chat requests share."""

    model: str
    n: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None  # None: off; k: the chosen token and the k most likely
    grammar: str | None = None  # from response_format: what the output must match


@dataclass(frozen=True)
class CompletionParams:
    common: Common
    prompts: tuple[str | tuple[int, ...], ...]
    echo: bool


@dataclass(frozen=True)
class ChatParams:
    common: Common
    messages: tuple[dict[str, Any], ...]
    template_kwargs: dict[str, Any]
    tools: ToolSpec | None = None  # None: no tools, or tool_choice "none"


# ------------------------------------------------------------------ the body


# NOTE: the body-size limit and the depth walk stay hand-written: they must hold before any
# parser or model sees the bytes (pydantic validates an already-built Python object, and
# json.loads of a 100k-deep array is a RecursionError, not a clean error), and the walk is
# iterative, so no input can exhaust the stack.
def read_json(stream, content_length: int | None, limits: Limits) -> dict[str, Any]:
    """The request body as a JSON object, or an APIError (400, 413)."""
    limit = limits.max_body_bytes
    if content_length is not None and content_length > limit:
        raise _too_large(content_length, limit)
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise _too_large(None, limit)
    if not data.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        body = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep(limits.max_json_depth) from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise bad_request(
            f"We could not parse the JSON body of your request ({_first_line(e)}). "
            "The body must be a JSON object, UTF-8 encoded."
        ) from None
    _check_tree(body, limits.max_json_depth)
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, not {_json_type(body)}.")
    return body


def _too_large(size: int | None, limit: int) -> APIError:
    got = f" ({size} bytes)" if size is not None else ""
    return APIError(
        413,
        f"The request body{got} is larger than this server accepts ({limit} bytes; "
        "--max-body-bytes).",
        code="request_too_large",
    )


def _too_deep(depth: int) -> APIError:
    return bad_request(
        f"The JSON body is nested more than {depth} levels deep (--max-json-depth).",
        code="json_too_deep",
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _check_tree(body: Any, max_depth: int) -> None:
    """Depth and strings of the whole document, without recursion."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > max_depth:
                raise _too_deep(max_depth)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            _check_text(value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            "The JSON body holds a string that is not valid Unicode (an unpaired surrogate "
            "escape such as \\ud800)."
        ) from None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# ------------------------------------------------------------------ fields


def _type_error(name: str, expected: str, value: Any) -> APIError:
    return bad_request(
        f"Invalid type for '{name}': expected {expected}, but got {_json_type(value)} instead.",
        param=name,
        code="invalid_type",
    )


def _range_error(name: str, rule: str, value: Any) -> APIError:
    shown = repr(value)
    if len(shown) > 80:  # a 4000-digit number is not worth echoing whole
        shown = shown[:60] + f"... ({len(shown)} characters)"
    return bad_request(
        f"Invalid value for '{name}': expected {rule}, but got {shown} instead.",
        param=name,
        code="invalid_value",
    )


_EXPECTED = {
    "float_type": "a number",
    "int_type": "an integer",
    "bool_type": "a boolean",
    "string_type": "a string",
}


def _check_fields(body: dict[str, Any], route: str, limits: Limits) -> dict[str, APIError]:
    """Unknown fields (raised at once), then each scalar's type and bounds, by the request's
    pydantic model. The scalars' errors are handed to _Fields, which raises each when the
    checks below reach its field, so a request with several faults is told of the same one
    first as before. Errors in nested fields are left to the hand-written checks."""
    # NOTE: imported here, so `hipc chat` (which shares service.py) needs no pydantic
    from pydantic import ValidationError

    from hipc.runtime.server import models

    model = models.CompletionRequest if route == "completion" else models.ChatCompletionRequest
    try:
        model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False)
        for x in errors:
            if x["type"] == "extra_forbidden" and len(x["loc"]) == 1:
                raise _from_pydantic(x, limits) from None
        scalar = {}
        for x in errors:
            name = x["loc"][0]
            if len(x["loc"]) == 1 and name in SCALARS and name not in scalar:
                scalar[name] = _from_pydantic(x, limits)
        return scalar
    return {}


def _from_pydantic(error: dict[str, Any], limits: Limits) -> APIError:
    """One pydantic error in this server's (OpenAI's) wording."""
    name, kind, v = str(error["loc"][0]), error["type"], error.get("input")
    if kind == "extra_forbidden":
        return bad_request(
            f"Unrecognized request argument supplied: {name}",
            param=name,
            code="unrecognized_argument",
        )
    if kind == "missing" or (v is None and name == "model"):
        return bad_request(
            f"Missing required parameter: '{name}'.",
            param=name,
            code="missing_required_parameter",
        )
    if kind == "string_too_short":
        return bad_request(f"'{name}' must not be empty.", param=name)
    if kind == "float_type" and isinstance(v, int) and not isinstance(v, bool):
        kind = "out_of_range"  # an integer too large for a float is out of range, not mistyped
    if kind in _EXPECTED:
        return _type_error(name, _EXPECTED[kind], v)
    if isinstance(v, float) and v.is_integer() and name in INTEGERS:
        v = int(v)
    return _range_error(name, _rule(name, limits), v)


def _rule(name: str, limits: Limits) -> str:
    if name in NUMBERS:
        lo, hi, lo_open = NUMBERS[name]
        return f"a number {'>' if lo_open else '>='} {lo} and <= {hi}"
    lo, hi = INTEGERS[name]
    return f"an integer from {lo} to {limits.max_n if hi is None else hi}"


class _Fields:
    """A body's values, or their defaults, read in the order the checks below need them;
    reading a scalar whose check failed raises that failure."""

    def __init__(self, body: dict[str, Any], errors: dict[str, APIError], limits: Limits) -> None:
        self.body, self.errors, self.limits = body, errors, limits

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def _checked(self, name: str) -> Any:
        if name in self.errors:
            raise self.errors[name]
        return self.body.get(name)

    def number(self, name: str, default: float) -> float:
        v = self._checked(name)
        return default if v is None else float(v)

    def integer(self, name: str, default: int | None) -> int | None:
        v = self._checked(name)
        if v is None:
            return default
        v = int(v)
        if INTEGERS[name][1] is None and v > self.limits.max_n:  # a bound set by --max-n
            raise _range_error(name, _rule(name, self.limits), v)
        return v

    def boolean(self, name: str, default: bool) -> bool:
        v = self._checked(name)
        return default if v is None else v

    def string(self, name: str) -> str | None:
        return self._checked(name)

    def null_only(self, name: str, why: str, allowed: tuple[Any, ...] = ()) -> None:
        v = self.body.get(name)
        if v is None or v in allowed:
            return
        raise bad_request(
            f"'{name}' is not supported by this server: {why}.",
            param=name,
            code="unsupported_parameter",
        )


def _stop(f: _Fields) -> tuple[str, ...]:
    v = f.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _type_error("stop", "a string or an array of strings", v)
    if len(items) > MAX_STOP:
        raise _range_error("stop", f"at most {MAX_STOP} sequences", f"{len(items)} sequences")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise _range_error(
            "stop", f"sequences of at most {MAX_STOP_CHARS} characters", "a longer one"
        )
    return tuple(s for s in items if s)


def _token_id_list(f: _Fields, name: str, vocab: int, most: int) -> tuple[int, ...]:
    v = f.get(name)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in v
    ):
        raise _type_error(name, "an array of integers", v)
    if len(v) > most:
        raise _range_error(name, f"at most {most} ids", f"{len(v)} ids")
    for t in v:
        if not 0 <= t < vocab:
            raise _range_error(name, f"token ids from 0 to {vocab - 1}", t)
    return tuple(v)


def _logit_bias(f: _Fields, vocab: int) -> tuple[tuple[int, float], ...]:
    v = f.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise _type_error("logit_bias", "an object mapping token ids to numbers", v)
    if len(v) > MAX_LOGIT_BIAS:
        raise _range_error("logit_bias", f"at most {MAX_LOGIT_BIAS} entries", f"{len(v)} entries")
    out = []
    for key, bias in v.items():
        try:
            token = int(key)
        except ValueError:
            raise _range_error("logit_bias", "token ids as keys", key) from None
        if not 0 <= token < vocab:
            raise _range_error("logit_bias", f"token ids from 0 to {vocab - 1}", token)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise _range_error("logit_bias", "biases from -100 to 100", bias)
        out.append((token, float(bias)))
    return tuple(out)


def _stream_options(f: _Fields, stream: bool) -> bool:
    v = f.get("stream_options")
    if v is None:
        return False
    if not stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    if not isinstance(v, dict):
        raise _type_error("stream_options", "an object", v)
    for key in v:
        if key not in ("include_usage", "include_obfuscation"):
            raise bad_request(
                f"Unrecognized request argument supplied: stream_options.{key}",
                param=f"stream_options.{key}",
                code="unrecognized_argument",
            )
    usage = v.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise _type_error("stream_options.include_usage", "a boolean", usage)
    return bool(usage)


def _common(f: _Fields, limits: Limits, max_tokens_field: str, logprobs: int | None) -> Common:
    d = limits.defaults
    model = f.string("model")
    stream = f.boolean("stream", False)
    top_k = f.integer("top_k", int(d.get("top_k", 0)))
    seed = f.integer("seed", None)
    sampling = SamplingParams(
        temperature=f.number("temperature", float(d.get("temperature", 1.0))),
        top_p=f.number("top_p", float(d.get("top_p", 1.0))),
        top_k=max(top_k, 0),  # -1 (vLLM's "off") is 0 here
        min_p=f.number("min_p", float(d.get("min_p", 0.0))),
        repetition_penalty=f.number("repetition_penalty", float(d.get("repetition_penalty", 1.0))),
        presence_penalty=f.number("presence_penalty", 0.0),
        frequency_penalty=f.number("frequency_penalty", 0.0),
        logit_bias=_logit_bias(f, limits.vocab_size),
    )
    return Common(
        model=model,
        n=f.integer("n", 1),
        max_tokens=f.integer(max_tokens_field, None),
        stream=stream,
        include_usage=_stream_options(f, stream),
        sampling=sampling,
        seed=None if seed is None else seed % 2**64,
        stop=_stop(f),
        stop_token_ids=_token_id_list(f, "stop_token_ids", limits.vocab_size, MAX_STOP_TOKEN_IDS),
        ignore_eos=f.boolean("ignore_eos", False),
        logprobs=logprobs,
    )


# ------------------------------------------------------------------ /v1/completions


def parse_completion(body: dict[str, Any], limits: Limits) -> CompletionParams:
    f = _Fields(body, _check_fields(body, "completion", limits), limits)
    f.null_only("suffix", "insertion (fill in the middle) is not implemented", ("",))
    logprobs = f.integer("logprobs", None)
    echo = f.boolean("echo", False)
    if echo and logprobs is not None:
        raise bad_request(
            "'echo' together with 'logprobs' (prompt log-probabilities) is not supported.",
            param="echo",
            code="unsupported_parameter",
        )
    common = _common(f, limits, "max_tokens", logprobs)
    common = replace(common, grammar=response_format(f.get("response_format")))
    best_of = f.integer("best_of", None)
    if best_of is not None and best_of != common.n:
        raise bad_request(
            "'best_of' other than n is not supported (every generated choice is returned).",
            param="best_of",
            code="unsupported_parameter",
        )
    prompts = _prompts(body.get("prompt"), limits.vocab_size)
    if len(prompts) * common.n > limits.max_n:
        raise bad_request(
            f"This request asks for {len(prompts) * common.n} choices ({len(prompts)} prompts x "
            f"n={common.n}); the server allows at most {limits.max_n} per request (--max-n).",
            param="n",
        )
    return CompletionParams(common=common, prompts=prompts, echo=echo)


def _prompts(v: Any, vocab: int) -> tuple[str | tuple[int, ...], ...]:
    if v is None:
        raise bad_request(
            "Missing required parameter: 'prompt'.",
            param="prompt",
            code="missing_required_parameter",
        )
    if isinstance(v, str):
        return (v,)
    expected = "a string, an array of strings, an array of token ids, or an array of such arrays"
    if not isinstance(v, list):
        raise _type_error("prompt", expected, v)
    if not v:
        raise bad_request("'prompt' must not be an empty array.", param="prompt")
    if all(isinstance(x, str) for x in v):
        return tuple(v)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return (_token_ids(v, vocab),)
    if all(isinstance(x, list) for x in v):
        out = []
        for ids in v:
            if not ids or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise _type_error("prompt", expected, ids)
            out.append(_token_ids(ids, vocab))
        return tuple(out)
    raise _type_error("prompt", expected, v)


def _token_ids(ids: list[int], vocab: int) -> tuple[int, ...]:
    for t in ids:
        if not 0 <= t < vocab:
            raise _range_error("prompt", f"token ids from 0 to {vocab - 1}", t)
    return tuple(ids)


# ------------------------------------------------------------------ /v1/chat/completions

_ROLES = {"system", "developer", "user", "assistant", "tool"}
_MESSAGE_FIELDS = {
    "role", "content", "name", "tool_call_id", "tool_calls", "refusal", "reasoning_content",
    "function_call", "audio",
}  # fmt: skip


def parse_chat(body: dict[str, Any], limits: Limits) -> ChatParams:
    f = _Fields(body, _check_fields(body, "chat", limits), limits)
    f.null_only("functions", "use 'tools' (function calling is its older form)", ([],))
    f.null_only("function_call", "use 'tool_choice'", ("none", "auto"))
    f.null_only("audio", "the model produces text only")
    f.null_only("prediction", "predicted outputs are not implemented")
    f.null_only("web_search_options", "there is no web search")
    parallel = f.boolean("parallel_tool_calls", True)
    f.string("reasoning_effort")
    f.string("verbosity")
    modalities = f.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request(
            "'modalities' other than [\"text\"] is not supported: the model produces text only.",
            param="modalities",
            code="unsupported_parameter",
        )
    grammar = response_format(f.get("response_format"))
    tools = parse_tools(f.get("tools"), f.get("tool_choice"), parallel)
    if tools is not None and tools.forced and grammar is not None:
        raise bad_request(
            "'response_format' cannot be combined with a 'tool_choice' that forces a call.",
            param="response_format",
        )
    want_logprobs = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", None)
    if top is not None and not want_logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    body_max = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    if body_max == "max_completion_tokens":
        f.integer("max_tokens", None)  # still checked, then superseded
    common = _common(f, limits, body_max, (top or 0) if want_logprobs else None)
    return ChatParams(
        common=replace(common, grammar=grammar),
        messages=_messages(body.get("messages")),
        template_kwargs=_template_kwargs(f.get("chat_template_kwargs")),
        tools=tools,
    )


def response_format(v: Any) -> str | None:
    """The grammar `response_format` asks for (None for plain text)."""
    from hipc.runtime import constraint

    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise _type_error("response_format", "an object with a 'type'", v)
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _grammar(constraint.json_schema_grammar, {"type": "object"}, "response_format")
    if kind != "json_schema":
        raise _range_error("response_format.type", "'text', 'json_object' or 'json_schema'", kind)
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise _type_error("response_format.json_schema", "an object", spec)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(
            "Missing required parameter: 'response_format.json_schema.name'.",
            param="response_format.json_schema.name",
            code="missing_required_parameter",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _type_error("response_format.json_schema.strict", "a boolean", strict)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _type_error("response_format.json_schema.schema", "an object", schema)
    return _grammar(constraint.json_schema_grammar, schema, "response_format.json_schema.schema")


def _grammar(build, schema: dict[str, Any], param: str) -> str:
    from hipc.base.errors import HipcError
    from hipc.runtime import constraint

    if not constraint.available():
        raise bad_request(constraint.MISSING + ".", param=param, code="unsupported_parameter")
    try:
        return build(schema)
    except HipcError as e:
        raise bad_request(
            f"Invalid schema in '{param}': {e}.", param=param, code="invalid_schema"
        ) from None


def _messages(v: Any) -> tuple[dict[str, Any], ...]:
    if v is None:
        raise bad_request(
            "Missing required parameter: 'messages'.",
            param="messages",
            code="missing_required_parameter",
        )
    if not isinstance(v, list):
        raise _type_error("messages", "an array of messages", v)
    if not v:
        raise bad_request("'messages' must hold at least one message.", param="messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object", m)
        for key in m:
            if key not in _MESSAGE_FIELDS:
                raise bad_request(
                    f"Unrecognized request argument supplied: {where}.{key}",
                    param=f"{where}.{key}",
                    code="unrecognized_argument",
                )
        role = m.get("role")
        if not isinstance(role, str):
            raise _type_error(f"{where}.role", "a string", role)
        if role not in _ROLES:
            raise _range_error(f"{where}.role", "one of " + ", ".join(sorted(_ROLES)), role)
        if m.get("function_call") is not None:
            raise bad_request(
                f"{where}: 'function_call' is not supported; send 'tool_calls'.",
                param=f"{where}.function_call",
                code="unsupported_parameter",
            )
        if m.get("audio") is not None:
            raise bad_request(f"{where}: audio is not supported.", param=f"{where}.audio")
        message = {
            "role": "system" if role == "developer" else role,
            "content": _content(m.get("content"), role, where),
        }
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise _type_error(f"{where}.{key}", "a string", m[key])
                message[key] = m[key]
        if m.get("tool_calls") not in (None, []):
            if role != "assistant":
                raise bad_request(
                    f"{where}: only assistant messages carry 'tool_calls'.",
                    param=f"{where}.tool_calls",
                )
            message["tool_calls"] = parse_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool" and "tool_call_id" not in message:
            raise bad_request(
                f"Missing required parameter: '{where}.tool_call_id'.",
                param=f"{where}.tool_call_id",
                code="missing_required_parameter",
            )
        out.append(message)
    return tuple(out)


def _content(v: Any, role: str, where: str) -> str:
    if isinstance(v, str):
        return v
    if v is None:
        if role == "assistant":
            return ""
        raise bad_request(
            f"Missing required parameter: '{where}.content'.", param=f"{where}.content"
        )
    if not isinstance(v, list):
        raise _type_error(f"{where}.content", "a string or an array of content parts", v)
    texts = []
    for j, part in enumerate(v):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise _type_error(at, "an object", part)
        kind = part.get("type")
        if kind in ("text", "input_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise _type_error(f"{at}.text", "a string", text)
            texts.append(text)
        elif kind in ("image_url", "input_image", "input_audio", "file", "refusal"):
            raise bad_request(
                f"{at}: content of type {kind!r} is not supported; this model takes text only.",
                param=f"{at}.type",
                code="unsupported_content",
            )
        else:
            raise _range_error(f"{at}.type", "'text'", kind)
    return "\n".join(texts)


def _template_kwargs(v: Any) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _type_error("chat_template_kwargs", "an object", v)
    for key in v:
        if not key.isidentifier() or key.startswith("_") or key in RESERVED_NAMES:
            raise _range_error(
                "chat_template_kwargs", "template variable names (not messages, tools ...)", key
            )
    return dict(v)
