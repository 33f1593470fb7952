"""The server's OpenAPI 3.1 document, generated from pydantic v2 models of its requests and
responses and served at GET /openapi.json.

NOTE: the models describe; they do not validate. Requests are still checked by the
hand-written runtime/server/validation.py, because its errors are OpenAI's exact wording
with the failing field in `param`, checked in a fixed order (unknown fields first, then
each field once), and some rules depend on the loaded model (vocabulary size, --max-n, the
grammar library's JSON-schema keywords). A pydantic rewrite that maps every error back to
that wording did not fit the time it was given; tests/server/test_server_openapi.py keeps
the two honest instead: schemathesis sends requests generated from this document to the app
and every answer must be a 2xx that matches the documented response, or a JSON 4xx.
The numeric bounds below come from validation.py's own constants so they cannot drift.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from hipc.base.version import HIPC_VERSION
from hipc.runtime.server.validation import (
    MAX_COMPLETION_LOGPROBS,
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    SEED_RANGE,
    Limits,
)

INT32 = 2**31 - 1


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


class _Sampling(_Strict):
    model: Annotated[str, Field(min_length=1, description="The served model name.")]
    n: Annotated[int, Field(ge=1, description="Choices per prompt; at most --max-n.")] = 1
    max_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
    stream: bool = False
    stream_options: Annotated[
        StreamOptions | None, Field(description="Only with stream: true.")
    ] = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32, description="0 or -1: off.")] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[TokenIds, Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]
            ],
            Field(max_length=MAX_LOGIT_BIAS, description="Token id (a string) to a bias."),
        ]
        | None
    ) = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[TokenIds, Field(min_length=1)]
        | Annotated[list[Annotated[TokenIds, Field(min_length=1)]], Field(min_length=1)]
    )
    echo: Annotated[bool, Field(description="Not with logprobs.")] = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    suffix: Annotated[
        Literal[""] | None, Field(description="Fill-in-the-middle is not implemented.")
    ] = None
    best_of: Annotated[int, Field(ge=1, description="Only equal to n.")] | None = None


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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        default=None, description="Text only; null only for an assistant message."
    )
    name: str | None = None
    tool_call_id: Annotated[str | None, Field(description="Required on a tool message.")] = None
    tool_calls: Annotated[
        list[ToolCall] | None, Field(description="Only on an assistant message.")
    ] = None
    refusal: str | None = None
    reasoning_content: str | None = None


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
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
    logprobs: bool = False
    top_logprobs: (
        Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS, description="Needs logprobs: true.")] | None
    ) = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[Literal["text"]] | None = None
    chat_template_kwargs: Annotated[
        dict[str, Any] | None, Field(description="Extra variables for the chat template.")
    ] = None


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
    status: Literal["ok", "shutting_down"]


MODELS = (
    CompletionRequest, ChatCompletionRequest, Completion, ChatCompletion, ModelList, ModelCard,
    ErrorBody, HealthStatus,
)  # fmt: skip


# ------------------------------------------------------------------ the document

_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "string",
            "description": "With stream: true, `data: <chunk JSON>` events, then `data: [DONE]`.",
        }
    }
}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}


def _errors(*statuses: int) -> dict[str, Any]:
    why = {
        400: "The request is invalid; `param` names the field.",
        401: "Missing or wrong API key.",
        404: "No such model or route.",
        413: "The body is larger than --max-body-bytes.",
        429: "The queue is full.",
        503: "The server is shutting down.",
    }
    return {str(s): {"description": why[s], "content": _json("ErrorBody")} for s in statuses}


def _generation(request: str, response: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "operationId": request[0].lower() + request[1:],
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {"description": "The result.", "content": {**_json(response), **_SSE}},
                **_errors(400, 401, 404, 413, 429, 503),
            },
        }
    }


def _get(response: str, summary: str, op: str, errors=(401,), **extra) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "operationId": op,
            "responses": {
                "200": {"description": "OK", "content": _json(response)},
                **_errors(*errors),
            },
            **extra,
        }
    }


def _bound_token_ids(schema: Any, top: int) -> None:
    """Every token-id integer in a (small, generated) schema gets the vocabulary's bound."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer" and schema.get("minimum") == 0:
            schema["maximum"] = top
        for value in schema.values():
            _bound_token_ids(value, top)
    elif isinstance(schema, list):
        for value in schema:
            _bound_token_ids(value, top)


def openapi_document(
    limits: Limits | None = None, model: str | None = None, api_key: bool = False
) -> dict[str, Any]:
    """The OpenAPI 3.1 document for this server: with its limits and model name, if given,
    the bounds that depend on them (--max-n, the vocabulary, the one served model)."""
    _, defs = models_json_schema(
        [(m, "validation" if m in MODELS[:2] else "serialization") for m in MODELS],
        ref_template="#/components/schemas/{model}",
    )
    schemas = defs["$defs"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = schemas[name]["properties"]
        if model is not None:
            fields["model"]["enum"] = [model]
        if limits is not None:
            fields["n"]["maximum"] = limits.max_n
            for key in ("prompt", "stop_token_ids"):
                _bound_token_ids(fields.get(key, {}), limits.vocab_size - 1)
    health = _get("HealthStatus", "Liveness", "health", errors=())
    health["get"]["responses"]["503"] = {
        "description": "Shutting down.",
        "content": _json("HealthStatus"),
    }
    health["get"]["security"] = []
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "hipc server",
            "version": HIPC_VERSION,
            "description": "OpenAI-compatible completions and chat completions.",
        },
        "paths": {
            "/health": health,
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "operationId": "metrics",
                    "responses": {
                        "200": {
                            "description": "Prometheus text format.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        **_errors(401),
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "operationId": "openapi",
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        **_errors(401),
                    },
                }
            },
            "/v1/models": _get("ModelList", "The served model", "listModels"),
            "/v1/models/{model_id}": _get(
                "ModelCard",
                "One model",
                "getModel",
                errors=(401, 404),
                parameters=[
                    {
                        "name": "model_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                    }
                ],
            ),
            "/v1/completions": _generation("CompletionRequest", "Completion", "Complete a prompt"),
            "/v1/chat/completions": _generation(
                "ChatCompletionRequest", "ChatCompletion", "Answer a conversation"
            ),
        },
        "components": {"schemas": schemas},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
