"""Pydantic v2 models of what the server takes and answers: the OpenAPI document
(openapi.py) is generated from them, and validation.py checks every request's top-level
fields (unknown names, types and bounds of the scalars) with them.

The bounds are OpenAI's where it has them (stop sequences, logprobs) and this server's
otherwise; validation.py's NUMBERS and INTEGERS are the one table both the models and the
error messages read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from hipc.runtime.server.validation import (
    INTEGERS,
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    NUMBERS,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------ requests

TokenIds = list[Annotated[int, Field(ge=0)]]
Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class JsonSchemaSpec(_Strict):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    strict: bool | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = {}


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat,
    Field(description="Output constrained by the grammar library (llguidance) when not text."),
]


def _integral(v: Any) -> Any:
    # NOTE: JSON has one number type, so 2.0 is the integer 2 (and 2.5 stays a type error)
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _number(name: str, description: str | None = None) -> Any:
    lo, hi, lo_open = NUMBERS[name]
    bound = {"gt": lo} if lo_open else {"ge": lo}
    inner = Annotated[float, Field(strict=True, le=hi, **bound)]
    return Annotated[inner | None, Field(description=description)]


def _integer(name: str, description: str | None = None) -> Any:
    lo, hi = INTEGERS[name]
    inner = Annotated[int, Field(strict=True, ge=lo, le=hi), BeforeValidator(_integral)]
    return Annotated[inner | None, Field(description=description)]


# Every scalar is nullable: null means "the default", as with OpenAI.
Bool = Annotated[bool, Field(strict=True)] | None
Str = Annotated[str, Field(strict=True)] | None


class _Sampling(_Strict):
    model: Annotated[str, Field(strict=True, min_length=1, description="The served model name.")]
    n: _integer("n", "Choices per prompt; at most --max-n.") = None
    max_tokens: _integer("max_tokens") = None
    stream: Bool = None
    stream_options: Annotated[
        StreamOptions | None, Field(description="Only with stream: true.")
    ] = None
    temperature: _number("temperature", "Defaults to the model's, else 1.0.") = None
    top_p: _number("top_p") = None
    top_k: _integer("top_k", "0 or -1: off.") = None
    min_p: _number("min_p") = None
    presence_penalty: _number("presence_penalty") = None
    frequency_penalty: _number("frequency_penalty") = None
    repetition_penalty: _number("repetition_penalty") = None
    seed: _integer("seed") = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[TokenIds, Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: Bool = None
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]
            ],
            Field(max_length=MAX_LOGIT_BIAS, description="Token id (a string) to a bias."),
        ]
        | None
    ) = None
    # bookkeeping fields OpenAI defines that change nothing here
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[TokenIds, Field(min_length=1)]
        | Annotated[list[Annotated[TokenIds, Field(min_length=1)]], Field(min_length=1)]
    )
    echo: Annotated[Bool, Field(description="Not with logprobs.")] = None
    logprobs: _integer("logprobs") = None
    suffix: Annotated[
        Literal[""] | None, Field(description="Fill-in-the-middle is not implemented.")
    ] = None
    best_of: _integer("best_of", "Only equal to n.") = None


class TextPart(_Strict):
    type: Literal["text", "input_text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: Annotated[str | dict[str, Any], Field(description="A JSON object, or its text.")] = (
        "{}"
    )


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(_Strict):
    name: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None


class InstructionMessage(_Message):
    role: Annotated[Literal["system", "developer", "user"], Field(description="developer: system.")]
    content: Annotated[str | list[TextPart], Field(description="Text only.")]


class AssistantTurn(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None


class ToolResult(_Message):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


ChatMessage = Annotated[
    InstructionMessage | AssistantTurn | ToolResult, Field(discriminator="role")
]


class FunctionDef(_Open):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: Annotated[
        dict[str, Any] | None, Field(description="A JSON schema the grammar library accepts.")
    ] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: _integer("max_completion_tokens") = None
    logprobs: Bool = None
    top_logprobs: _integer("top_logprobs", "Needs logprobs: true.") = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = None
    reasoning_effort: Str = None
    verbosity: Str = None
    modalities: list[Literal["text"]] | None = None
    chat_template_kwargs: Annotated[
        dict[str, Any] | None, Field(description="Extra variables for the chat template.")
    ] = None
    # OpenAI fields refused unless empty or null, by name
    functions: Annotated[list[Any] | None, Field(max_length=0, description="Use tools.")] = None
    function_call: Annotated[
        Literal["none", "auto"] | None, Field(description="Use tool_choice.")
    ] = None
    audio: Annotated[None, Field(description="Text only.")] = None
    prediction: Annotated[None, Field(description="Not implemented.")] = None
    web_search_options: Annotated[None, Field(description="No web search.")] = None


# ------------------------------------------------------------------ responses


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseToolCall(_Open):
    id: str
    type: Literal["function"]
    function: dict[str, str]


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    refusal: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"] | None


class Completion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(_Strict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Strict):
    error: ErrorDetail


class HealthStatus(_Strict):
    status: Literal["ok", "warming_up", "shutting_down"]


MODELS = (
    CompletionRequest, ChatCompletionRequest, Completion, ChatCompletion, ModelList, ModelCard,
    ErrorBody, HealthStatus,
)  # fmt: skip
