"""What waitress does with connections before a request reaches the app, hardened.

Two things waitress leaves open to any client on the network:

- It closes a connection only after `channel_timeout` seconds *without a byte*, so a client
  that trickles a header line every few seconds holds its connection forever, and about
  a hundred of them fill `connection_limit`: nobody else is accepted, /health included.
  Here every request must arrive whole (headers and body) within `read_timeout` seconds of
  its first byte, and a connection waiting for its next request is closed after as long.
- Its own refusals (a malformed request line, a body past its limit, an unknown
  Transfer-Encoding) are plain text. Here they are OpenAI's JSON error shape, like every
  answer of the app.
"""

from __future__ import annotations

import json
import time

from waitress.channel import ClientDisconnected, HTTPChannel
from waitress.task import ErrorTask

# How often waitress runs its maintenance (closing late connections), in seconds; its
# default of 30 would let a late connection live up to 30 s past its deadline.
CLEANUP_INTERVAL = 1


def error_body(code: int, message: str) -> bytes:
    kind = "invalid_request_error" if code < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return json.dumps(body).encode("utf-8")


class JSONErrorTask(ErrorTask):
    """waitress' own 4xx/5xx answers with OpenAI's JSON body."""

    def execute(self) -> None:
        e = self.request.error
        code, reason = e.code, e.reason
        if code == 501:
            # NOTE: waitress' one 5xx is an unknown Transfer-Encoding: the client's doing,
            # so a 4xx, which keeps "5xx = the server's fault" true for whoever counts them
            code, reason = 400, "Bad Request"
        data = error_body(code, f"{reason}: {e.body}".strip().rstrip(":"))
        self.status = f"{code} {reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(data)
        self.write(data)


class DeadlineChannel(HTTPChannel):
    """An HTTP connection that records when its current request began to arrive."""

    error_task_class = JSONErrorTask
    request_started = 0.0

    def received(self, data: bytes) -> bool:
        if self.request is None and data:
            self.request_started = time.time()
        return super().received(data)


def harden(server, read_timeout: float) -> None:
    """Make `server` (waitress.create_server's) answer in JSON and enforce the deadline."""
    from waitress.server import BaseWSGIServer

    servers = [server] if isinstance(server, BaseWSGIServer) else _listeners(server)
    for s in servers:
        s.channel_class = DeadlineChannel
        s.maintenance = _maintenance(s, read_timeout)


def _listeners(server) -> list:
    from waitress.server import BaseWSGIServer

    return [d for d in server.map.values() if isinstance(d, BaseWSGIServer)]


def _maintenance(server, read_timeout: float):
    def maintenance(now: float) -> None:
        idle_cutoff = now - server.adj.channel_timeout
        cutoff = now - read_timeout
        for channel in list(server.active_channels.values()):
            if channel.requests:
                continue  # a request is running: its answer is owed, however long
            if channel.request is not None:
                if getattr(channel, "request_started", now) < cutoff:
                    _time_out(channel, read_timeout)
            elif channel.last_activity < idle_cutoff:
                channel.will_close = True  # idle between requests: closed, as HTTP allows

    return maintenance


def _time_out(channel, read_timeout: float) -> None:
    """Answer a request that arrives too slowly with a 408, then close its connection."""
    if channel.close_when_flushed or channel.will_close:
        return
    data = error_body(
        408,
        f"Request Timeout: the request did not arrive within {read_timeout:g} seconds "
        "(--read-timeout)",
    )
    head = (
        "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode("ascii")
    channel.request = None
    try:
        channel.write_soon(head + data)
    except ClientDisconnected:
        channel.will_close = True
        return
    channel.close_when_flushed = True
