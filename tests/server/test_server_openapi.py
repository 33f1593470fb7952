"""GET /openapi.json: a valid OpenAPI 3.1 document of every route, and schemathesis requests
generated from it (schema-valid and schema-violating) answered by the in-process Falcon app
over a scripted engine with no 5xx, a JSON error body on every 4xx, and every documented
2xx matching its documented schema.

Bounded for CI: a fixed number of examples per operation (HIPC_FUZZ_SCALE multiplies it,
as in test_server_fuzz.py).
"""

from __future__ import annotations

import json
import os

import falcon.testing
import pytest

from hipc.runtime.server.app import create_app
from hipc.runtime.server.config import Config
from hipc.runtime.server.service import Service

from fuzzing import check_answer
from serving import ScriptedEngine, script, tiny_tokenizer

schemathesis = pytest.importorskip("schemathesis")
openapi_spec_validator = pytest.importorskip("openapi_spec_validator")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

KEY = "sk-openapi"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCALE = int(os.environ.get("HIPC_FUZZ_SCALE", "1"))


def make_app():
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, script(tok, "Hi there"), max_context=96)
    cfg = Config(served_model_name="tiny", api_key=KEY, max_n=4, max_body_bytes=8192)
    service = Service(engine, cfg)
    service.warmup("Hi", 2)  # as `hipc serve` does before it opens the port
    return create_app(engine, cfg, service), tok.vocab_size


APP, VOCAB = make_app()


def _document() -> dict:
    r = falcon.testing.TestClient(APP).simulate_get("/openapi.json", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json


def test_document_is_valid_openapi_and_names_every_route():
    doc = _document()
    openapi_spec_validator.validate(doc)  # raises on an invalid document
    routes = {
        route.uri_template
        for root in APP._router._roots
        for route in _walk(root)
        if route.resource is not None
    }
    assert routes and set(doc["paths"]) == routes
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "200" in op["responses"], (path, method)
            if method == "post":
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.split("/")[-1] in doc["components"]["schemas"]


def test_document_uses_json_schema_keywords_only():
    # pydantic writes its own names (ge, le) where a constraint sits under a validator
    def walk(value):
        if isinstance(value, dict):
            assert not {"ge", "gt", "le", "lt", "strict"} & set(value), value
            for key, item in value.items():
                if key == "properties":  # names of fields, not keywords
                    item = list(item.values())
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(_document()["components"]["schemas"])


def _walk(node):
    yield node
    for child in node.children:
        yield from _walk(child)


def test_document_carries_this_servers_limits():
    fields = _document()["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["n"]["anyOf"][0]["maximum"] == 4 and fields["model"]["enum"] == ["tiny"]
    ids = fields["stop_token_ids"]["anyOf"][0]["items"]
    assert ids["maximum"] == VOCAB - 1


def test_unauthenticated_document_is_refused_like_other_routes():
    r = falcon.testing.TestClient(APP).simulate_get("/openapi.json")
    assert r.status_code == 401 and r.json["error"]["code"] == "missing_api_key"


schema = schemathesis.openapi.from_wsgi("/openapi.json", APP, headers=AUTH)
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])


@schema.parametrize()
@settings(
    max_examples=25 * SCALE,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_schemathesis_requests_get_no_5xx_and_documented_answers(case):
    response = case.call(headers=AUTH)
    case.validate_response(
        response,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )
    content_type = response.headers.get("content-type", [""])
    if isinstance(content_type, list):  # schemathesis keeps every value of a header
        content_type = content_type[0]
    check_answer(
        case.method.upper(), case.path, response.status_code, content_type, response.content
    )
    if response.status_code >= 400:
        assert json.loads(response.content)["error"]["message"]


# The wording clients already know, now produced from pydantic's errors (validation.py's
# `_from_pydantic`): one case per kind of error the models report.
WORDING = [
    ({"frobnicate": 1}, "Unrecognized request argument supplied: frobnicate", "frobnicate"),
    ({"model": None}, "Missing required parameter: 'model'.", "model"),
    ({"model": ""}, "'model' must not be empty.", "model"),
    (
        {"temperature": "hot"},
        "Invalid type for 'temperature': expected a number, but got a string instead.",
        "temperature",
    ),
    (
        {"top_p": 0},
        "Invalid value for 'top_p': expected a number > 0.0 and <= 1.0, but got 0 instead.",
        "top_p",
    ),
    (
        {"temperature": 10**400},
        "Invalid value for 'temperature': expected a number >= 0.0 and <= 2.0, but got "
        f"{repr(10**400)[:60]}... (401 characters) instead.",
        "temperature",
    ),
    (
        {"max_tokens": 2.5},
        "Invalid type for 'max_tokens': expected an integer, but got a number instead.",
        "max_tokens",
    ),
    (
        {"max_tokens": 1e30},
        "Invalid value for 'max_tokens': expected an integer from 1 to 2147483647, but got "
        "1000000000000000019884624838656 instead.",
        "max_tokens",
    ),
    (
        {"n": 5},
        "Invalid value for 'n': expected an integer from 1 to 4, but got 5 instead.",
        "n",
    ),
    (
        {"stream": 1},
        "Invalid type for 'stream': expected a boolean, but got a number instead.",
        "stream",
    ),
    (
        {"reasoning_effort": []},
        "Invalid type for 'reasoning_effort': expected a string, but got an array instead.",
        "reasoning_effort",
    ),
]


@pytest.mark.parametrize("fields,message,param", WORDING, ids=[w[2] for w in WORDING])
def test_pydantic_errors_keep_the_servers_wording(fields, message, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **fields}
    r = falcon.testing.TestClient(APP).simulate_post(
        "/v1/chat/completions", json=body, headers=AUTH
    )
    assert r.status_code == 400, r.text
    assert r.json["error"]["message"] == message
    assert r.json["error"]["param"] == param


def test_first_fault_reported_is_the_same_whatever_pydantic_finds_first():
    # response_format is checked before the sampling fields, as it was before pydantic
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": "hot",
        "response_format": {"type": "yaml"},
    }
    r = falcon.testing.TestClient(APP).simulate_post(
        "/v1/chat/completions", json=body, headers=AUTH
    )
    assert r.json["error"]["param"] == "response_format.type", r.json
