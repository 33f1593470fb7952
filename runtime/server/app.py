"""create_app(engine, config): the Falcon WSGI app. It only wires; the work is in Service."""

from __future__ import annotations

import logging
import time

import falcon

from hipc.runtime.server import resources
from hipc.runtime.server.auth import BearerAuth
from hipc.runtime.server.config import Config
from hipc.runtime.server.errors import APIError, internal_error
from hipc.runtime.server.metrics import ServerMetrics
from hipc.runtime.server.service import Service

log = logging.getLogger("hipc.server")


def create_app(engine, config: Config | None = None, service: Service | None = None) -> falcon.App:
    config = config or Config()
    service = service or Service(engine, config)
    middleware: list = [RequestLog(service.metrics)]
    if config.api_key:
        middleware.append(BearerAuth(config.api_key))
    router = falcon.routing.CompiledRouter()
    app = falcon.App(middleware=middleware, router=router)
    app.req_options.strip_url_path_trailing_slash = True
    app.add_route("/health", resources.Health(service))
    app.add_route("/ready", resources.Ready(service))
    app.add_route("/metrics", resources.Metrics(service))
    # the document lists the routes the router finds, so a new route needs its entry
    app.add_route("/openapi.json", resources.OpenAPI(service, bool(config.api_key), router))
    app.add_route("/v1/models", resources.Models(service))
    app.add_route("/v1/models/{model_id}", resources.Model(service))
    app.add_route("/v1/completions", resources.Completions(service))
    app.add_route("/v1/chat/completions", resources.ChatCompletions(service))
    app.add_error_handler(Exception, _unexpected_error)
    app.add_error_handler(falcon.HTTPError, _http_error)
    app.add_error_handler(APIError, _api_error)
    return app


class RequestLog:
    """Counts every response by route and status, and logs one line per request.

    A streamed response is logged when its stream ends (or the client leaves), so the
    time is the whole request's, not the time to its headers.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def process_request(self, req, resp) -> None:
        req.context.t0 = time.perf_counter()

    def process_response(self, req, resp, resource, req_succeeded) -> None:
        # NOTE: route templates, never raw paths: label values stay a bounded set
        endpoint = req.uri_template if resource is not None and req.uri_template else "unmatched"
        status = str(resp.status_code)
        self.metrics.requests.labels(endpoint, status).inc()
        t0 = getattr(req.context, "t0", time.perf_counter())
        if resp.stream is not None and not hasattr(resp.stream, "read"):
            resp.stream = _LoggedStream(resp.stream, req.method, endpoint, status, t0)
            return
        _log_request(req.method, endpoint, status, t0, "")


def _log_request(method: str, endpoint: str, status: str, t0: float, what: str) -> None:
    ms = (time.perf_counter() - t0) * 1e3
    log.info("%s %s %s %.1f ms%s", method, endpoint, status, ms, what)


class _LoggedStream:
    """An SSE body that writes the request's log line once it is done."""

    def __init__(self, body, method: str, endpoint: str, status: str, t0: float) -> None:
        self._body, self._line, self._t0 = body, (method, endpoint, status), t0
        self._chunks, self._finished, self._logged = 0, False, False

    def __iter__(self):
        for chunk in self._body:
            self._chunks += 1
            yield chunk
        self._finished = True

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            if not self._logged:
                self._logged = True
                end = "" if self._finished else ", client left"
                _log_request(*self._line, self._t0, f" (stream, {self._chunks} chunks{end})")


def _api_error(req, resp, ex: APIError, params) -> None:
    resp.status = ex.status
    resp.media = ex.body()
    for name, value in ex.headers.items():
        resp.set_header(name, value)


def _http_error(req, resp, ex: falcon.HTTPError, params) -> None:
    """Falcon's own errors (no route, wrong method, bad header) in OpenAI's shape."""
    message = ex.description or ex.title or "HTTP error"
    if ex.status_code == 404:
        message = f"Unknown request URL: {req.method} {req.path}."
    elif ex.status_code == 405:
        message = f"Method {req.method} is not allowed on {req.path}."
    err = APIError(ex.status_code, message, code=None)
    _api_error(req, resp, err, params)
    for name, value in (ex.headers or {}).items():
        resp.set_header(name, value)


def _unexpected_error(req, resp, ex: Exception, params) -> None:
    log.exception("unhandled error on %s %s", req.method, req.path)
    _api_error(req, resp, internal_error(), params)
