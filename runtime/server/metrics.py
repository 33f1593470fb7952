"""The server's Prometheus metrics, through prometheus-client, one CollectorRegistry per app.

Label values come only from a fixed set (route templates, status codes, reasons), so the
number of series is bounded whatever clients send.

With PROMETHEUS_MULTIPROC_DIR set before the server starts (several worker processes
behind one port, each with its own app), prometheus-client keeps every process's counters,
histograms and gauges in files there and /metrics adds them up. That is why the gauges are
set when the queue changes rather than read at scrape time (a callable read at scrape time
sees only the answering process), and why the process_* series are left out in that mode:
prometheus-client can only report the process that answers.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client import multiprocess as _multiprocess
from prometheus_client.exposition import choose_encoder

from hipc.base.errors import HipcError

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


def multiprocess_dir() -> str | None:
    """PROMETHEUS_MULTIPROC_DIR, checked now: prometheus-client would fail at the first
    request's count with a traceback."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
    if path is not None and not os.path.isdir(path):
        raise HipcError(f"PROMETHEUS_MULTIPROC_DIR={path}: not a directory (create it first)")
    return path


class ServerMetrics:
    """Every metric the server exports; `render(accept)` is the /metrics answer."""

    def __init__(self, kv_bytes: float = 0, max_context: float = 0) -> None:
        # NOTE: a registry per app, not prometheus-client's global one: tests (and any
        # embedder) create many apps in one process, and the global one refuses a name twice
        self.registry = r = CollectorRegistry()
        self.multiprocess = multiprocess_dir() is not None
        self.requests = Counter(
            "hipc_requests_total",
            "HTTP requests by route and status",
            ("endpoint", "status"),
            registry=r,
        )
        self.prompt_tokens = Counter(
            "hipc_prompt_tokens_total", "prompt tokens admitted", registry=r
        )
        self.generation_tokens = Counter(
            "hipc_generation_tokens_total", "tokens generated", registry=r
        )
        self.finished = Counter(
            "hipc_choices_finished_total", "choices finished, by reason", ("reason",), registry=r
        )
        self.cancelled = Counter(
            "hipc_requests_cancelled_total",
            "requests cancelled before finishing",
            ("reason",),
            registry=r,
        )
        self.rejected = Counter(
            "hipc_requests_rejected_total",
            "requests refused before queueing",
            ("reason",),
            registry=r,
        )
        self.prompt_reuse = Counter(
            "hipc_prompt_reuse_total",
            "prefills skipped: the prompt's KV was still in the cache",
            registry=r,
        )
        self.ttft = Histogram(
            "hipc_time_to_first_token_seconds",
            "from request arrival (queueing included) to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "hipc_time_per_output_token_seconds",
            "between consecutive generated tokens",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "hipc_queue_wait_seconds",
            "time a request waited for the engine",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "hipc_request_duration_seconds",
            "generation requests, arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # live* modes: a worker that exits (close()) stops counting toward the sums
        self.queue_depth = Gauge(
            "hipc_queue_depth",
            "requests waiting for the engine",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.running = Gauge(
            "hipc_requests_running",
            "requests on the engine now",
            registry=r,
            multiprocess_mode="livesum",
        )
        Gauge(
            "hipc_kv_cache_bytes",
            "bytes of the preallocated KV cache",
            registry=r,
            multiprocess_mode="livesum",
        ).set(kv_bytes)
        Gauge(
            "hipc_max_context_tokens",
            "context admitted per request",
            registry=r,
            multiprocess_mode="livemax",
        ).set(max_context)
        # continuous batching (the cpu target): sequences are the choices of requests
        self.sequences_running = Gauge(
            "hipc_sequences_running",
            "sequences in the batch now",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.sequences_waiting = Gauge(
            "hipc_sequences_waiting",
            "sequences waiting for a batch slot or KV blocks",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.batch_size = Histogram(
            "hipc_batch_size",
            "sequences advanced per engine step",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
            registry=r,
        )
        # where a step stays in flight while the host works (a GPU's): how long the engine
        # thread waited for each step, and its critical path from collecting a step to
        # submitting the next (the device idles that long): the host's share of a step
        self.step_wait = Histogram(
            "hipc_step_wait_seconds",
            "time the engine thread waited for a step in flight to finish",
            buckets=(0.001, 0.002, 0.004, 0.006, 0.008, 0.012, 0.02, 0.05, 0.1, 0.5),
            registry=r,
        )
        self.step_gap = Histogram(
            "hipc_step_gap_seconds",
            "host time from collecting a step to submitting the next (the device idle)",
            buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
            registry=r,
        )
        self.kv_blocks_used = Gauge(
            "hipc_kv_blocks_used",
            "KV pool blocks held by sequences",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.kv_blocks_free = Gauge(
            "hipc_kv_blocks_free",
            "KV pool blocks held by no sequence (prefix-cached ones included)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.prefix_queried = Gauge(
            "hipc_prefix_cache_queried_tokens",
            "prompt tokens looked up in the prefix cache since start",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.prefix_hits = Gauge(
            "hipc_prefix_cache_hit_tokens",
            "prompt tokens found in the prefix cache (not computed) since start",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.prefix_hit_rate = Gauge(
            "hipc_prefix_cache_hit_rate",
            "share of prompt tokens found in the prefix cache since start",
            registry=r,
            multiprocess_mode="liveall",
        )
        if self.multiprocess:
            self._scraped = CollectorRegistry()
            _multiprocess.MultiProcessCollector(self._scraped)
        else:
            ProcessCollector(registry=r)  # process_resident_memory_bytes and its kin
            self._scraped = r

    def set_load(self, depth: int, running: int) -> None:
        """The scheduler's on_change: called (under its lock) whenever the queue moves."""
        self.queue_depth.set(depth)
        self.running.set(running)

    def set_sequences(self, running: int, waiting: int) -> None:
        self.sequences_running.set(running)
        self.sequences_waiting.set(waiting)

    def set_pool(self, pool) -> None:
        """The KV pool's blocks and prefix-cache counts (a runtime.kv_pool.KVPool)."""
        self.kv_blocks_used.set(pool.used)
        self.kv_blocks_free.set(pool.free)
        self.prefix_queried.set(pool.queried_tokens)
        self.prefix_hits.set(pool.hit_tokens)
        self.prefix_hit_rate.set(
            pool.hit_tokens / pool.queried_tokens if pool.queried_tokens else 0
        )

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The /metrics body and its content type: the classic text format, or OpenMetrics
        when the scraper asks for it (as Prometheus does)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self._scraped), content_type

    def close(self) -> None:
        """At the end of a worker: its live gauges leave the multiprocess sums."""
        if self.multiprocess:
            _multiprocess.mark_process_dead(os.getpid())
