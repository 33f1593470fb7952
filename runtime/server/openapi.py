"""The server's OpenAPI 3.1 document, generated from the pydantic models of its requests and
responses (models.py) and served at GET /openapi.json."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic.json_schema import models_json_schema

from hipc.base.version import HIPC_VERSION
from hipc.runtime.server.models import MODELS
from hipc.runtime.server.validation import Limits

# ------------------------------------------------------------------ the document

# NOTE: in OpenAPI 3.1 the schema of text/event-stream describes one event (3.2 adds
# itemSchema), as schemathesis reads it too
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "description": "With stream: true: events whose data is a chunk's JSON, the last "
            "`[DONE]`.",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
            "required": ["data"],
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


def _probe(summary: str, op: str, unready: str) -> dict[str, Any]:
    probe = _get("HealthStatus", summary, op, errors=())
    probe["get"]["responses"]["503"] = {"description": unready, "content": _json("HealthStatus")}
    probe["get"]["security"] = []  # probes carry no key
    return probe


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
    limits: Limits | None = None,
    model: str | None = None,
    api_key: bool = False,
    routed: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """The OpenAPI 3.1 document for this server: with its limits and model name, if given,
    the bounds that depend on them (--max-n, the vocabulary, the one served model); with
    `routed`, only the paths the app routes."""
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
            for key in ("n", "best_of"):
                for branch in fields.get(key, {}).get("anyOf", []):
                    if branch.get("type") == "integer":
                        branch["maximum"] = limits.max_n
            for key in ("prompt", "stop_token_ids"):
                _bound_token_ids(fields.get(key, {}), limits.vocab_size - 1)
    health = _probe("Liveness", "health", "Shutting down.")
    ready = _probe("Readiness: loaded, warmed, not draining", "ready", "Not ready (yet).")
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "hipc server",
            "version": HIPC_VERSION,
            "description": "OpenAI-compatible completions and chat completions.",
        },
        "paths": {
            "/health": health,
            "/ready": ready,
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
    if routed is not None:
        doc["paths"] = {path: item for path, item in doc["paths"].items() if routed(path)}
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
