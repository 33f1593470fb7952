"""The queue in front of a batch engine: requests' choices run together, one step at a time.

The engine thread loops: admit waiting choices while the batch has a free slot and the KV
pool can promise a choice every block it may need (a request waits in the queue until then:
it never fails mid-stream for lack of memory), drop cancelled requests (their blocks go back
at once), run one step of every running sequence, and hand each sequence's logits to its own
Decoding (sampler, seed, stop conditions, logprobs, grammar). Where the backend can leave a
step in flight (a GPU), each row's token is picked and fed first, the next step submitted,
and only then is the text made, stops checked and the events streamed, while it runs; and
where every running choice is plain greedy and the backend `pipelines`, the step after is
submitted before a step is collected, fed the device's picks (runtime/batch.py). A request
starts when its first choice is admitted; its choices run side by side (their shared prompt
is computed once, then found in the prefix cache), and their stream events are released in
choice order, as the one at a time runner emits them.

The surface is the Scheduler's (scheduler.py): submit / cancel / close / hurry / idle, jobs
and their events, `on_change(depth, running)`; QueueFull (a 429) when more than
`max_queued` requests wait beyond the batch's free slots.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hipc.base.errors import HipcError
from hipc.runtime.batch import BatchEngine, Sequence, StepOut
from hipc.runtime.generate import Decoding, Generation
from hipc.runtime.server.errors import bad_request, internal_error
from hipc.runtime.server.scheduler import Job, QueueFull, ShuttingDown

if TYPE_CHECKING:
    from hipc.runtime.server.metrics import ServerMetrics
    from hipc.runtime.server.runner import ChoiceSpec

log = logging.getLogger("hipc.server")


class _Admitted:
    """The engine as Generation's constructor sees it: the context a request may use."""

    def __init__(self, max_context: int) -> None:
        self.max_context = max_context


@dataclass(eq=False)
class _Choice:
    spec: ChoiceSpec
    gen: Generation
    decoding: Decoding | None = None
    seq: Sequence | None = None
    t0: float = 0.0
    ended: bool = False


@dataclass(eq=False)
class _Work:
    """A job's state on the engine thread."""

    job: Job
    choices: list[_Choice]
    stream: bool
    prompt_tokens: int
    next_admit: int = 0
    shown: int = 0  # choices whose events have been released, in order
    held: dict[int, list[Any]] = field(default_factory=lambda: collections.defaultdict(list))
    last_token: float | None = None
    metrics: Any = None  # the server's, or _Quiet for the warmup
    finished: bool = False  # _finish ran: nothing more is streamed

    @property
    def done(self) -> bool:
        return all(c.ended for c in self.choices)


class BatchScheduler:
    def __init__(
        self,
        batch: BatchEngine,
        tokenizer,
        metrics: ServerMetrics,
        max_context: int,
        max_queued: int,
        on_cancel=None,
        on_change=None,
    ) -> None:
        self.batch, self.tokenizer, self.metrics = batch, tokenizer, metrics
        self.admitted = _Admitted(max_context)
        self.max_queued = max_queued
        self._waiting: collections.deque[Job] = collections.deque()
        self._work: dict[Job, _Work] = {}  # submitted, not finished
        self._active: list[_Work] = []  # started (at least one choice admitted)
        self._owner: dict[Sequence, tuple[_Work, _Choice]] = {}  # running sequences' choices
        # of them, those drawn at a temperature (Decoding.device_draw > 0: picked on the
        # device where the batch draws for every row) and those sampled on the host
        # (device_draw None: no device-picked tokens then)
        self._drawn = self._host = 0
        self._cv = threading.Condition()
        self._closed = self._stop = False
        self._deadline = float("inf")
        self._on_cancel, self._on_change = on_cancel, on_change
        self._publish_pool()
        self._thread = threading.Thread(target=self._loop, name="hipc-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the HTTP side

    def job(
        self, choices: list[ChoiceSpec], stream: bool, prompt_tokens: int, counted: bool = True
    ) -> Job:
        """A job for these choices (validated already: each fits the admitted context);
        `counted` False keeps it out of the request metrics (the warmup)."""
        job = Job(_no_work)
        work = [_Choice(c, Generation(self.admitted, self.tokenizer, c.request)) for c in choices]
        metrics = self.metrics if counted else _Quiet()
        self._work[job] = _Work(job, work, stream, prompt_tokens, metrics=metrics)
        return job

    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def accepting(self) -> bool:
        return not self._closed

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                self._work.pop(job, None)
                raise ShuttingDown
            # what is waiting beyond the free slots is the queue (at batch 1 with one request
            # running: exactly the one-at-a-time scheduler's rule)
            free = max(self.batch.max_batch - len(self.batch.running), 0)
            if len(self._waiting) >= self.max_queued + free:
                self._work.pop(job, None)
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
                self._cv.notify_all()  # running: the loop drops it before the next step
                return
            self._work.pop(job, None)
            self._changed()
            job.done.set()
            self._cv.notify_all()
        if self._on_cancel is not None:
            self._on_cancel(job)

    def hurry(self) -> None:
        with self._cv:
            self._deadline = 0.0
            self._cv.notify_all()

    def idle(self) -> bool:
        with self._cv:
            return not self._active and not self._waiting

    def close(self, grace: float) -> None:
        """Refuse new jobs; give running and waiting ones `grace` seconds, then cancel them."""
        with self._cv:
            self._closed = True
            self._deadline = min(self._deadline, time.monotonic() + grace)
            while (self._active or self._waiting) and time.monotonic() < self._deadline:
                self._cv.wait(0.05)
            pending = list(self._waiting) + [w.job for w in self._active]
        for job in pending:
            job.cancel("shutdown")
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (
                    not self._active
                    and not self._waiting
                    and not self._stop
                    and not self.batch.in_flight
                ):
                    self._cv.wait()
                if (
                    self._stop
                    and not self._active
                    and not self._waiting
                    and not self.batch.in_flight
                ):
                    return
            try:
                if not self.batch.in_flight:
                    self._prepare()
                    if not self._submit():
                        with self._cv:  # nothing admissible now: wait for a change
                            if self._waiting and not self._active:
                                self._cv.wait(0.05)
                        continue
                if self.batch.can_submit_ahead:
                    # the next step goes in before this one is collected: its decode rows
                    # take this step's tokens as the device picked them, so the device never
                    # waits for this thread between steps
                    self._prepare()
                    self._submit(ahead=True)
                t0 = time.perf_counter()
                out = self.batch.collect()
                collected = time.perf_counter()
                rows = self.batch.last_batch
                taken = self._take(out)
                if self.batch.overlaps:
                    if not self.batch.in_flight:
                        # the next step's inputs are fed: the device runs it while this
                        # thread detokenizes, checks stops and streams this step's tokens
                        # (and the HTTP threads write them)
                        self._prepare()
                        if self._submit():
                            self.metrics.step_gap.observe(time.perf_counter() - collected)
                    self.metrics.step_wait.observe(collected - t0)
                self._publish_step(rows)
                self._stream(taken)
            except Exception:
                # a bug, not a request's fault: every running request gets a 500 and the loop
                # goes on (a dead engine thread would hang every later request)
                log.exception("batch step failed")
                for w in list(self._active):
                    w.job.error = internal_error()
                    self._finish(w)
                continue

    def _prepare(self) -> None:
        """Admit what fits, drop cancelled and failed requests (their blocks go back)."""
        with self._cv:
            self._admit()
            active = list(self._active)
        for w in active:
            if w.job.cancelled or w.job.error is not None:
                self._finish(w)

    def _submit(self, ahead: bool = False) -> bool:
        """Start the next step (`ahead` of the one in flight where every running choice's
        token is picked on the device); False when no sequence has a token to compute or it
        cannot go ahead."""
        if not self.batch.running:
            return False
        # every running choice plain greedy, or drawn at a temperature alone where the batch
        # draws on the device for all its rows: the backend picks the tokens (rows x 1
        # values back instead of rows x vocab logits), the draws' uniform numbers taken
        # from each choice's generator as its host sampler would
        top = 1 if self._picked_on_device else 0
        if ahead and not top:
            return False
        draw = self._draw if top and self._drawn else None
        return self.batch.submit(top, ahead=ahead, draw=draw)

    def _draw(self, seq: Sequence) -> tuple[float, float]:
        return self._owner[seq][1].decoding.draw()

    def _admit(self) -> None:
        """Under the lock: start choices, first come first served, while they fit."""
        for w in self._active:
            if not self._admit_choices(w):
                return
        while self._waiting:
            job = self._waiting[0]
            w = self._work[job]
            complete = self._admit_choices(w)
            if w.next_admit == 0 and job.error is None:
                return  # not one choice fits yet: it keeps its place at the head
            self._waiting.popleft()
            self._active.append(w)
            job.started_at = time.monotonic()
            w.metrics.queue_wait.observe(job.started_at - job.arrived)
            w.metrics.prompt_tokens.inc(w.prompt_tokens)
            job.started.set()
            self._changed()
            if not complete:
                return

    def _admit_choices(self, w: _Work) -> bool:
        """Admit w's next choices; True if all of them are in (the next job may try)."""
        while w.next_admit < len(w.choices):
            if w.job.cancelled:
                return True
            c = w.choices[w.next_admit]
            prompt = c.gen.result.prompt_token_ids
            if w.job.error is not None:
                return True
            try:
                seq = self.batch.admit(prompt, len(prompt) + c.gen.max_tokens)
            except HipcError as e:  # the loop finishes the job with this error
                w.job.error = bad_request(str(e))
                return True
            if seq is None:
                return False
            if seq.cached:
                w.metrics.prompt_reuse.inc()
            c.seq, c.decoding, c.t0 = seq, c.gen.decoding(), time.perf_counter()
            self._owner[seq] = (w, c)
            self._count(c.decoding, 1)
            w.next_admit += 1
            if w.stream:
                self._emit(w, c.spec.index, ("start", c.spec.index))
        return True

    def _take(self, out: StepOut) -> list[tuple[_Work, _Choice, int | None]]:
        """Sample every finished row of the step and feed its token (the next step's input):
        the device's picks (greedy or drawn, submitted so), else the rows whose sampling is
        the raw argmax in one call over the step's logits, the others each by its own sampler. The rest of each
        row's work (text, stops, streaming) is `_stream`'s, which may run while the next
        step does: a token fed here whose row then ends (a stop string) costs a wasted row."""
        taken: list[tuple[_Work, _Choice, int | None]] = []
        if not out.seqs:
            return taken
        greedy = None
        if out.top_ids is not None:
            greedy = out.top_ids[:, 0].tolist()
        else:
            plain = [self._owner[s][1].decoding.greedy_argmax for s in out.seqs]
            if all(plain):
                greedy = np.argmax(out.logits, axis=1).tolist()
            elif any(plain):
                # a mix: each greedy row's argmax over its view (gathering them would copy)
                greedy = [int(np.argmax(out.logits[i])) if p else None for i, p in enumerate(plain)]
        now = time.perf_counter()
        feed = self.batch.feed
        for i, seq in enumerate(out.seqs):
            owner = self._owner.get(seq)  # gone when an earlier row's failure ended its job
            if owner is None or owner[0].finished or owner[1].ended:
                continue
            w, c = owner
            res = c.gen.result
            if not res.token_ids and not res.prefill_s:
                res.prefill_s = now - c.t0
                c.t0 = now
            d = c.decoding
            try:
                token = greedy[i] if greedy is not None else None
                token = d.take(token) if token is not None else d.sample(out.logits[i])
            except HipcError as e:
                w.job.error = bad_request(str(e))
                self._finish(w)
                continue
            except Exception:
                log.exception("generation failed")
                w.job.error = internal_error()
                self._finish(w)
                continue
            if token is not None and d.continues():
                feed(seq, token)
            taken.append((w, c, token))
        return taken

    def _stream(self, taken: list[tuple[_Work, _Choice, int | None]]) -> None:
        """The second half of each row's work: detokenize its token, check the stop strings
        and the length, stream the text; end the choices (and jobs) that finished."""
        touched: dict[_Work, None] = {}
        for w, c, token in taken:
            if w.finished or c.ended:  # failed, or cancelled since _take
                continue
            try:
                step = None if token is None else c.decoding.emit()
            except HipcError as e:
                w.job.error = bad_request(str(e))
                self._finish(w)
                continue
            except Exception:
                log.exception("generation failed")
                w.job.error = internal_error()
                self._finish(w)
                continue
            touched[w] = None
            if step is None:
                self._end(w, c)
                continue
            self._count_tokens(w, len(step.token_ids))
            if w.stream:
                self._emit(w, c.spec.index, ("step", c.spec.index, step))
        for w in touched:
            if not w.finished and w.done:
                self._finish(w)

    @property
    def _picked_on_device(self) -> bool:
        if not self._owner or self._host:
            return False
        return not self._drawn or len(self._owner) <= self.batch.draws_on_device

    def _count(self, decoding, n: int) -> None:
        """A running choice in (n 1) or out (-1) of the drawn and host-sampled counts."""
        inv_t = decoding.device_draw
        if inv_t is None:
            self._host += n
        elif inv_t:
            self._drawn += n

    def _release(self, seq: Sequence) -> None:
        self.batch.release(seq)
        owner = self._owner.pop(seq, None)
        if owner is not None:
            self._count(owner[1].decoding, -1)

    def _end(self, w: _Work, c: _Choice) -> None:
        self._release(c.seq)
        res = c.gen.result
        res.decode_s = time.perf_counter() - c.t0
        last = c.decoding.finish()
        if last is not None:
            self._count_tokens(w, len(last.token_ids))
            if w.stream:
                self._emit(w, c.spec.index, ("step", c.spec.index, last))
        w.metrics.finished.labels(res.finish_reason).inc()
        w.job.results.append((c.spec.index, res))
        c.ended = True  # before its "end" event: the next choice's held events follow it
        if w.stream:
            self._emit(w, c.spec.index, ("end", c.spec.index, res))

    def _count_tokens(self, w: _Work, n: int) -> None:
        if not n:
            return
        m, now = w.metrics, time.monotonic()
        if w.last_token is None:
            m.ttft.observe(now - w.job.arrived)
        else:
            m.tpot.observe((now - w.last_token) / n)
        w.last_token = now
        m.generation_tokens.inc(n)

    def _emit(self, w: _Work, index: int, event: tuple) -> None:
        """Stream events in choice order: choice i's wait until every choice before it ended."""
        if len(w.choices) == 1:
            w.job.emit(event)
            return
        order = [c.spec.index for c in w.choices]
        if order[w.shown] == index:
            w.job.emit(event)
        else:
            w.held[index].append(event)
        while w.shown < len(order) and w.choices[w.shown].ended:
            w.shown += 1
            if w.shown < len(order):
                for e in w.held.pop(order[w.shown], []):
                    w.job.emit(e)

    def _finish(self, w: _Work) -> None:
        """The job is over (finished, cancelled or failed): free its blocks, tell its waiter."""
        if w.finished:
            return
        w.finished = True
        for c in w.choices:
            if c.seq is not None:
                self._release(c.seq)
        w.metrics.e2e.observe(time.monotonic() - w.job.arrived)
        w.job.emit(("done",))
        with self._cv:
            if w in self._active:
                self._active.remove(w)
            self._work.pop(w.job, None)
            self._changed()
            w.job.done.set()
            self._cv.notify_all()
        self._publish_pool()
        if w.job.cancelled and self._on_cancel is not None:
            self._on_cancel(w.job)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._waiting), len(self._active))
        waiting_seqs = sum(len(self._work[j].choices) for j in self._waiting if j in self._work)
        waiting_seqs += sum(len(w.choices) - w.next_admit for w in self._active)
        self.metrics.set_sequences(len(self.batch.running), waiting_seqs)

    def _publish_step(self, rows: int) -> None:
        self.metrics.batch_size.observe(rows)
        self._publish_pool()

    def _publish_pool(self) -> None:
        self.metrics.set_pool(self.batch.pool)


class _Quiet:
    """Swallows metric updates: `m.finished.labels("stop").inc()` does nothing."""

    def __getattr__(self, name: str) -> _Quiet:
        return self

    def __call__(self, *args: Any, **kw: Any) -> _Quiet:
        return self


def _no_work(job: Job) -> None:  # a batch job's work is done by the scheduler's loop
    raise AssertionError("batch jobs run on the BatchScheduler's loop")
