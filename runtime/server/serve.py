"""`hipc serve`: load the engine once, warm it up, then serve the app with waitress.

The port opens only after warmup, so a client that can connect gets a ready server.
SIGTERM (or Ctrl-C) closes the listening socket at once, lets running and queued requests
finish for --shutdown-timeout seconds, cancels what is left, flushes the responses and
exits 0; a second signal cancels at once.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import signal
import sys
import threading
import time

from hipc.base.errors import HipcError
from hipc.runtime.server.config import Config

log = logging.getLogger("hipc.server")

SPARE_HTTP_THREADS = 4  # /health, /ready, /metrics and 429s still answer with the queue full
MAX_HTTP_THREADS = 512


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def load(config: Config):
    """The engine for config.artifact, loaded once for the life of the server."""
    from hipc.runtime.artifact import is_artifact
    from hipc.runtime.engine import load_engine

    if not config.artifact:
        raise HipcError("no artifact to serve: pass ARTIFACT or set HIPC_ARTIFACT")
    if not is_artifact(config.artifact):
        raise HipcError(
            f"{config.artifact}: not a compiled artifact (make one with: hipc compile MODEL -o NAME.hipc)"
        )
    from pathlib import Path

    if not (Path(config.artifact) / "tokenizer.json").is_file():
        raise HipcError(
            f"{config.artifact}: the artifact has no tokenizer, and the server needs one to read "
            "prompts and write text (compile a model that ships tokenizer.json, or a GGUF file)"
        )
    return load_engine(
        config.artifact,
        threads=config.threads,
        max_context=config.max_context_tokens,
        kv_pool_tokens=kv_pool_tokens(config),
    )


def kv_pool_tokens(config: Config) -> int:
    """Positions in the KV pool: --kv-pool-tokens, else max-batch sequences of the admitted
    context, as far as half the available RAM allows where the artifact may run on the cpu
    (at least one context: every admitted request must fit an empty pool). A GPU backend
    sizes it down further to the device's free memory."""
    from hipc.base.launch_plan import states
    from hipc.runtime.artifact import load_artifact

    plan = load_artifact(config.artifact).plan
    context = int(config.max_context_tokens or plan["max_context"])
    if config.kv_pool_tokens is not None:
        return max(config.kv_pool_tokens, context)
    # the cpu program's pools are float32 whatever the plan's dtype
    per_position = sum(4 * math.prod(s.shape[1:]) for s in states(plan) if s.positional)
    want = config.max_batch * context
    if "cpu" not in plan["targets"]:
        return want
    room = _available_ram() // 2 // max(per_position, 1)
    return max(min(want, room), context)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: the flag's value decides


# what `hipc serve` imports on a request's path; llguidance is optional (structured outputs)
SERVER_MODULES = ("falcon", "waitress", "pydantic", "prometheus_client")


def check_server_extra() -> None:
    """Refuse at start, not with a 500 on the first request, where the server extra is partial."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise HipcError(
            f"hipc serve needs the server extra (pip install 'hipc-compiler[server]'); "
            f"missing: {', '.join(missing)}"
        )


def serve(config: Config) -> int:
    setup_logging(config.log_level)
    check_server_extra()
    from hipc.runtime.server.app import create_app
    from hipc.runtime.server.metrics import multiprocess_dir
    from hipc.runtime.server.service import Service

    _check_port(config.host, config.port)  # before a load that can take minutes
    multiprocess_dir()  # a bad PROMETHEUS_MULTIPROC_DIR, likewise
    t0 = time.perf_counter()
    engine = load(config)
    service = Service(engine, config)
    backend = getattr(engine, "backend", None)
    kv = getattr(backend, "kv_bytes", 0)
    log.info(
        "model %s from %s: %s target, KV cache %s, %d positions per sequence, %.1f MiB in all, "
        "admitting %d tokens per request (loaded in %.2f s)",
        service.model_name,
        config.artifact,
        getattr(backend, "name", "?"),
        service.kv_storage,
        engine.max_context,
        kv / 2**20,
        service.max_context,
        time.perf_counter() - t0,
    )
    _log_batch(service, backend)
    _commit_kv(backend)
    if config.eager_load:
        seconds = service.warmup(config.eager_load_prompt, config.eager_load_max_tokens)
        log.info("warmup: %d tokens in %.2f s", config.eager_load_max_tokens, seconds)
    app = InFlight(create_app(engine, config, service))
    server = _create_server(app, config)
    host, port = _address(server)
    if not config.api_key and not _loopback(host):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", host)
    log.info("ready: http://%s:%s (model %s)", host, port, service.model_name)
    code = _run(server, app, service, config)
    service.metrics.close()
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    log.info("stopped")
    return code


def _check_port(host: str, port: int) -> None:
    """Fail now if the port is taken, rather than after loading and warming the model.

    The socket is bound and closed again: the port itself opens only when the server is
    ready, and a bind that loses a race later still fails with the same one line."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise HipcError(f"--host {host}: cannot resolve ({e})") from None
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress binds
        try:
            probe.bind(address)
        except OSError as e:
            raise HipcError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _log_batch(service, backend) -> None:
    batch = service.batch
    if batch is None:
        log.info(
            "batch: 1 sequence at a time (the %s backend has no paged KV pool)",
            getattr(backend, "name", "?"),
        )
        return
    pool = batch.pool
    log.info(
        "KV pool: %d blocks of %d positions = %d positions, %.1f MiB; up to %d sequences per "
        "step, %d tokens per step",
        pool.n_blocks,
        pool.block,
        pool.n_blocks * pool.block,
        backend.kv_bytes / 2**20,
        batch.max_batch,
        batch.step_rows,
    )
    if batch.recurrent:
        log.info(
            "recurrent states: %d slots of %.2f MiB; prefixes reused from snapshots kept every "
            "%d positions and at each prompt's last full block (at most %d)",
            backend.slots,
            backend.slot_bytes / 2**20,
            batch.snapshot_every,
            batch.max_snapshots,
        )


def _commit_kv(backend) -> None:
    """Touch every page of a host-memory KV cache now: numpy's zeros are mapped lazily, and
    memory that runs out should do so at startup, not in the middle of a long request."""
    for state in getattr(backend, "kv", None) or ():
        fill = getattr(state, "fill", None)
        if fill is not None:
            fill(0)


def _create_server(app, config: Config):
    import waitress

    from hipc.runtime.server.connections import CLEANUP_INTERVAL, harden

    threads = http_threads(config)
    try:
        server = waitress.create_server(
            app,
            host=config.host,
            port=config.port,
            threads=threads,
            connection_limit=_connection_limit(config.max_connections),
            # NOTE: a connection waiting for its next request is closed after this; one
            # whose request is arriving too slowly is closed by connections.harden
            channel_timeout=max(1, round(config.read_timeout)),
            cleanup_interval=CLEANUP_INTERVAL,
            # NOTE: lookahead keeps reading a connection while its request runs, so a client
            # that hangs up is noticed (waitress.client_disconnected) and its work cancelled
            channel_request_lookahead=1,
            # waitress stops reading bodies past this (its 413, made JSON by harden);
            # below it the app answers oversized bodies with its own 413
            max_request_body_size=4 * config.max_body_bytes,
            ident="hipc",
            clear_untrusted_proxy_headers=True,
            expose_tracebacks=False,
        )
    except OSError as e:
        raise HipcError(f"cannot listen on {config.host}:{config.port}: {e.strerror}") from None
    harden(server, config.read_timeout)
    return server


def http_threads(config: Config) -> int:
    """A waitress thread per request the engine may hold at once (a streamed one keeps its
    thread to the end): --max-batch running and --max-queued-requests waiting, plus spares
    for /health, /metrics and the 429s. Fewer would leave batch slots empty while requests
    wait inside waitress, unseen by the scheduler."""
    return min(config.max_batch + config.max_queued_requests + SPARE_HTTP_THREADS, MAX_HTTP_THREADS)


def _connection_limit(wanted: int) -> int:
    """`wanted` open connections, as far as the process' file-descriptor limit allows (the
    soft limit is raised toward the hard one first, as servers do)."""
    import resource

    spare = 64  # the artifact, the listening socket, logs, the tokenizer's files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + spare
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    if soft != resource.RLIM_INFINITY and soft - spare < wanted:
        log.warning(
            "--max-connections %d: the file-descriptor limit is %d; accepting %d at once",
            wanted,
            soft,
            max(soft - spare, 16),
        )
        return max(soft - spare, 16)
    return wanted


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _address(server) -> tuple[str, int]:
    if hasattr(server, "effective_port"):
        return str(server.effective_host), int(server.effective_port)
    first = server.effective_listen[0]
    return str(first[0]), int(first[1])


class InFlight:
    """WSGI wrapper that counts requests until their response body is closed."""

    def __init__(self, app) -> None:
        self.app = app
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, environ, start_response):
        with self._lock:
            self.count += 1
        try:
            body = self.app(environ, start_response)
        except BaseException:
            self._done()
            raise
        return _Closing(body, self._done)

    def _done(self) -> None:
        with self._lock:
            self.count -= 1


class _Closing:
    def __init__(self, body, on_close) -> None:
        self._body, self._on_close, self._closed = body, on_close, False

    def __iter__(self):
        return iter(self._body)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._on_close()


def _run(server, app: InFlight, service, config: Config) -> int:
    from waitress import wasyncore
    from waitress.server import BaseWSGIServer

    sockets = server._map if hasattr(server, "_map") else server.map
    signals = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: signals.append(signum))
    while not signals:
        wasyncore.loop(timeout=0.5, use_poll=True, map=sockets, count=1)

    log.info(
        "%s: not accepting new connections; finishing running and queued requests (up to %.1f s)",
        signal.Signals(signals[0]).name,
        config.shutdown_timeout,
    )
    for listener in [d for d in sockets.values() if isinstance(d, BaseWSGIServer)]:
        wasyncore.dispatcher.close(listener)  # the socket only; the loop keeps serving
    drain = threading.Thread(target=service.close, args=(config.shutdown_timeout,), daemon=True)
    drain.start()
    hard_deadline = time.monotonic() + config.shutdown_timeout + 10
    hurried = False
    while time.monotonic() < hard_deadline:
        if len(signals) > 1 and not hurried:
            log.info("second signal: cancelling what is left")
            service.scheduler.hurry()
            hurried = True
        flushed = all(not getattr(d, "total_outbufs_len", 0) for d in list(sockets.values()))
        if not drain.is_alive() and app.count == 0 and flushed:
            break
        wasyncore.loop(timeout=0.05, use_poll=True, map=sockets, count=1)
    else:
        log.warning("shutdown: %d requests still open at the deadline; closing them", app.count)
    wasyncore.close_all(sockets)
    server.task_dispatcher.shutdown(timeout=2)
    return 0
