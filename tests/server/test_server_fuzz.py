"""The server's own fuzzer: hypothesis-generated hostile requests over every route, each
answered without a 5xx and, when refused, with OpenAI's JSON error body.

Bounded for CI (about 400 requests, well under a minute); docs/benchmarks/fuzz_server.py
runs the same strategies for tens of thousands of requests against a live server.
"""

from __future__ import annotations

import http.client
import os

import falcon.testing
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hipc.runtime.server.app import create_app
from hipc.runtime.server.config import Config
from hipc.runtime.server.service import Service

from fuzzing import CHAT, COMP, check_answer, raw_bodies, requests
from serving import ScriptedEngine, script, tiny_tokenizer

KEY = "sk-fuzz"
# HIPC_FUZZ_SCALE=20 runs twenty times as many examples (locally, to look harder)
SCALE = int(os.environ.get("HIPC_FUZZ_SCALE", "1"))
FUZZ = settings(
    max_examples=150 * SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)


@pytest.fixture(scope="module")
def app():
    tok = tiny_tokenizer()
    # a short reply then EOS; with ignore_eos the script repeats up to the context
    engine = ScriptedEngine(tok, script(tok, "Hi there"), max_context=96)
    cfg = Config(served_model_name="tiny", api_key=KEY, max_n=4, max_body_bytes=8192)
    service = Service(engine, cfg)
    return falcon.testing.TestClient(create_app(engine, cfg, service)), tok.vocab_size


def _simulate(client, method, path, body, auth):
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = f"Bearer {KEY}"
    r = client.simulate_request(method, path, body=body, headers=headers)
    check_answer(method, path, r.status_code, r.headers.get("content-type", ""), r.content)
    return r


@pytest.mark.parametrize("path", [COMP, CHAT])
def test_fuzzed_bodies_never_5xx(app, path):
    client, vocab = app

    @FUZZ
    @given(body=raw_bodies(path, vocab))
    def run(body):
        _simulate(client, "POST", path, body, True)

    run()


def test_fuzzed_routes_methods_and_auth_never_5xx(app):
    client, vocab = app

    @settings(FUZZ, max_examples=100 * SCALE)
    @given(request=requests(vocab))
    def run(request):
        _simulate(client, *request)

    run()


def test_fuzzed_requests_over_a_socket(tiny_server):
    """Through waitress too (its parser, its limits, streaming over a real connection)."""
    vocab = 384

    @settings(FUZZ, max_examples=60 * SCALE, phases=[Phase.generate])
    @given(request=requests(vocab), header=st.sampled_from(["", "gzip", "chunked"]))
    def run(request, header):
        method, path, body, auth = request
        conn = http.client.HTTPConnection(tiny_server.host, tiny_server.port, timeout=60)
        try:
            headers = {"Content-Type": "application/json"}
            if auth:
                headers["Authorization"] = f"Bearer {tiny_server.api_key}"
            if header and body is not None:
                headers["Transfer-Encoding"] = header
                body = iter([body]) if header == "chunked" else body
            conn.request(
                method, path, body=body, headers=headers, encode_chunked=header == "chunked"
            )
            r = conn.getresponse()
            check_answer(method, path, r.status, r.getheader("content-type", ""), r.read())
        finally:
            conn.close()

    run()
    assert tiny_server.request("GET", "/health", auth=False)[0] == 200
    assert "Traceback" not in tiny_server.log()
