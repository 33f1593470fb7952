"""Bearer-token authentication (`--api-key` / HIPC_API_KEY) as Falcon middleware."""

from __future__ import annotations

import hmac

from hipc.runtime.server.errors import APIError

PUBLIC_PATHS = frozenset({"/health", "/ready"})  # probes carry no key


class BearerAuth:
    def __init__(self, api_key: str) -> None:
        self._key = api_key.encode("utf-8")

    def process_resource(self, req, resp, resource, params) -> None:
        if req.path in PUBLIC_PATHS:
            return
        scheme, _, token = (req.get_header("Authorization") or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized(
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                "missing_api_key",
            )
        # NOTE: compare_digest takes as long for a near miss as for a wild guess
        if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self._key):
            raise _unauthorized("Incorrect API key provided.", "invalid_api_key")


def _unauthorized(message: str, code: str) -> APIError:
    return APIError(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})
