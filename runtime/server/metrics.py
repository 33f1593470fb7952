"""Prometheus metrics in the text exposition format (0.0.4), with no client library.

Label values come only from a fixed set (route templates, status codes, reasons), so the
number of series is bounded whatever clients send.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self._values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def lines(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]


class Gauge(_Metric):
    """A value read at scrape time from a callable."""

    kind = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], float]) -> None:
        super().__init__(name, help)
        self._read = read

    def lines(self) -> list[str]:
        return [f"{self.name} {_num(self._read())}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help)
        self.bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def lines(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            running += n
            out.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {running}')
        out.append(f"{self.name}_sum {_num(total)}")
        out.append(f"{self.name}_count {running}")
        return out


def _resident_bytes() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0.0


class ServerMetrics:
    """Every metric the server exports; `render()` is the /metrics body."""

    def __init__(
        self,
        queue_depth: Callable[[], float] = lambda: 0,
        running: Callable[[], float] = lambda: 0,
        kv_bytes: float = 0,
        max_context: float = 0,
    ) -> None:
        self.requests = Counter(
            "hipc_requests_total", "HTTP requests by route and status", ("endpoint", "status")
        )
        self.prompt_tokens = Counter("hipc_prompt_tokens_total", "prompt tokens admitted")
        self.generation_tokens = Counter("hipc_generation_tokens_total", "tokens generated")
        self.finished = Counter(
            "hipc_choices_finished_total", "choices finished, by reason", ("reason",)
        )
        self.cancelled = Counter(
            "hipc_requests_cancelled_total", "requests cancelled before finishing", ("reason",)
        )
        self.rejected = Counter(
            "hipc_requests_rejected_total", "requests refused before queueing", ("reason",)
        )
        self.prompt_reuse = Counter(
            "hipc_prompt_reuse_total", "prefills skipped: the prompt's KV was still in the cache"
        )
        self.ttft = Histogram(
            "hipc_time_to_first_token_seconds",
            "from request arrival (queueing included) to its first generated token",
            LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "hipc_time_per_output_token_seconds",
            "between consecutive generated tokens",
            TOKEN_BUCKETS,
        )
        self.queue_wait = Histogram(
            "hipc_queue_wait_seconds", "time a request waited for the engine", LATENCY_BUCKETS
        )
        self.e2e = Histogram(
            "hipc_request_duration_seconds",
            "generation requests, arrival to last token",
            LATENCY_BUCKETS,
        )
        self._all: list[_Metric] = [
            self.requests,
            self.prompt_tokens,
            self.generation_tokens,
            self.finished,
            self.cancelled,
            self.rejected,
            self.prompt_reuse,
            self.ttft,
            self.tpot,
            self.queue_wait,
            self.e2e,
            Gauge("hipc_queue_depth", "requests waiting for the engine", queue_depth),
            Gauge("hipc_requests_running", "requests on the engine now", running),
            Gauge("hipc_kv_cache_bytes", "bytes of the preallocated KV cache", lambda: kv_bytes),
            Gauge("hipc_max_context_tokens", "context admitted per request", lambda: max_context),
            Gauge(
                "process_resident_memory_bytes", "resident memory of this process", _resident_bytes
            ),
        ]

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._all:
            lines += metric.header() + metric.lines()
        return "\n".join(lines) + "\n"
