"""The queue in front of the one engine.

One worker thread owns the engine and runs one job at a time, start to finish, so requests
are never interleaved. At most `max_queued` jobs wait; one more is refused (QueueFull, a
429). A job can be cancelled while it waits (it leaves the queue) or while it runs (the
work checks `job.cancelled` between tokens). `close()` stops new submissions, lets what is
running and waiting finish for a grace period, then cancels the rest.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hipc.server")


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class Job:
    """One request's work; its events flow from the engine thread to the HTTP thread."""

    def __init__(self, work: Callable[[Job], None]) -> None:
        self.work = work
        self.arrived = time.monotonic()
        self.started_at: float | None = None
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.started = threading.Event()
        self.done = threading.Event()
        self.cancel_reason: str | None = None
        self.error: BaseException | None = None
        self.results: list[Any] = []
        self._on_cancel: Callable[[Job], None] | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not None

    def cancel(self, reason: str) -> None:
        """Stop this job (no-op once it is done); a waiting job leaves the queue at once."""
        if self.done.is_set() or self.cancel_reason is not None:
            return
        self.cancel_reason = reason
        if self._on_cancel is not None:
            self._on_cancel(self)

    def emit(self, event: Any) -> None:
        self.events.put(event)


class Scheduler:
    def __init__(
        self,
        max_queued: int,
        on_cancel: Callable[[Job], None] | None = None,
        on_change: Callable[[int, int], None] | None = None,
    ) -> None:
        """on_change(depth, running) is called under the lock after every move of the queue,
        so its calls arrive in order (the metrics' gauges are set from it)."""
        self.max_queued = max_queued
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self._stop = False
        self._deadline = float("inf")
        self._on_cancel = on_cancel
        self._on_change = on_change
        self._thread = threading.Thread(target=self._loop, name="hipc-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return 1 if self._running is not None else 0

    @property
    def accepting(self) -> bool:
        return not self._closed

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                raise ShuttingDown
            if len(self._waiting) + self.running > self.max_queued:
                raise QueueFull
            job._on_cancel = self._cancelled
            self._waiting.append(job)
            self._changed()
            self._cv.notify_all()

    def _cancelled(self, job: Job) -> None:
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running (it will notice) or already gone
            self._changed()
            job.done.set()
            self._cv.notify_all()
        if self._on_cancel is not None:
            self._on_cancel(job)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stop:
                    self._cv.wait()
                if self._stop and not self._waiting:
                    return
                job = self._waiting.popleft()
                self._running = job
                self._changed()
            job.started_at = time.monotonic()
            job.started.set()
            try:
                job.work(job)
            except BaseException as e:  # the work reports its own errors; this is a bug
                log.exception("engine job failed")
                job.error = e
            finally:
                with self._cv:
                    self._running = None
                    self._changed()
                    job.done.set()
                    self._cv.notify_all()
                if job.cancelled and self._on_cancel is not None:
                    self._on_cancel(job)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._waiting), self.running)

    def hurry(self) -> None:
        """Make a close() in progress cancel now instead of waiting out its grace."""
        with self._cv:
            self._deadline = 0.0
            self._cv.notify_all()

    def idle(self) -> bool:
        with self._cv:
            return self._running is None and not self._waiting

    def close(self, grace: float) -> None:
        """Refuse new jobs; give running and waiting ones `grace` seconds, then cancel them."""
        with self._cv:
            self._closed = True
            self._deadline = min(self._deadline, time.monotonic() + grace)
            while (
                self._running is not None or self._waiting
            ) and time.monotonic() < self._deadline:
                self._cv.wait(0.05)
            pending = list(self._waiting)
            running = self._running
        for job in pending:
            job.cancel("shutdown")
        if running is not None:
            running.cancel("shutdown")
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
