"""The error a request can end in, carried to the client in OpenAI's JSON shape."""

from __future__ import annotations


class APIError(Exception):
    """An HTTP error with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def server_busy(message: str) -> APIError:
    return APIError(429, message, type="server_overloaded", code="queue_full")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="service_unavailable")


def internal_error(message: str = "the server hit an internal error") -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")
