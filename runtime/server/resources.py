"""Thin responders: read the request, call the service, set the response."""

from __future__ import annotations

from collections.abc import Callable

from hipc.runtime.server.service import Service
from hipc.runtime.server.validation import parse_chat, parse_completion, read_json


def _disconnected(req) -> Callable[[], bool]:
    # waitress tells whether the client went away; other servers (falcon.testing) do not
    return req.env.get("waitress.client_disconnected") or (lambda: False)


def _respond(resp, out) -> None:
    if isinstance(out, dict):
        resp.media = out
        return
    resp.content_type = "text/event-stream; charset=utf-8"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")
    resp.stream = out


class Health:
    def __init__(self, service: Service) -> None:
        self.service = service

    def on_get(self, req, resp) -> None:
        if self.service.accepting:
            resp.media = {"status": "ok"}
        else:
            resp.status = 503
            resp.media = {"status": "shutting_down"}


class Ready:
    """Readiness, as Kubernetes probes it: 200 only when new traffic would be served now
    (loaded, warmed, not draining); /health stays the liveness probe."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def on_get(self, req, resp) -> None:
        if not self.service.accepting:
            status = "shutting_down"
        elif not self.service.warm:
            status = "warming_up"
        else:
            status = "ok"
        resp.media = {"status": status}
        if status != "ok":
            resp.status = 503


class Models:
    def __init__(self, service: Service) -> None:
        self.service = service

    def on_get(self, req, resp) -> None:
        resp.media = self.service.models()


class Model:
    def __init__(self, service: Service) -> None:
        self.service = service

    def on_get(self, req, resp, model_id: str) -> None:
        resp.media = self.service.model_card(model_id)


class Completions:
    def __init__(self, service: Service) -> None:
        self.service = service

    def on_post(self, req, resp) -> None:
        limits = self.service.limits
        params = parse_completion(read_json(req.bounded_stream, req.content_length, limits), limits)
        _respond(resp, self.service.complete(params, _disconnected(req)))


class ChatCompletions:
    def __init__(self, service: Service) -> None:
        self.service = service

    def on_post(self, req, resp) -> None:
        limits = self.service.limits
        params = parse_chat(read_json(req.bounded_stream, req.content_length, limits), limits)
        _respond(resp, self.service.chat(params, _disconnected(req)))


class Metrics:
    def __init__(self, service: Service) -> None:
        self.service = service

    def on_get(self, req, resp) -> None:
        resp.data, resp.content_type = self.service.metrics.render(req.get_header("Accept"))


class OpenAPI:
    """The document is built once, on the first request: pydantic's schema generation takes
    tens of milliseconds and the server's limits do not change while it runs."""

    def __init__(self, service: Service, api_key: bool, router) -> None:
        self.service, self.api_key, self.router = service, api_key, router
        self._doc: dict | None = None

    def on_get(self, req, resp) -> None:
        from hipc.runtime.server.openapi import openapi_document

        if self._doc is None:
            self._doc = openapi_document(
                self.service.limits,
                self.service.model_name,
                self.api_key,
                routed=lambda path: self.router.find(path) is not None,
            )
        resp.media = self._doc
