"""Generation on the engine thread: a job's choices, one after another, token by token.

Used for engines that run one sequence at a time (the reference executor, test fakes); an
engine whose backend steps many sequences (the cpu and GPU backends) is served by batching.py
instead.

The engine is wrapped once in an EngineSlot: it admits `max_context` positions (which may
be fewer than the engine holds) and keeps the last prompt's logits. When the engine's
states allow it (`prefix_reuse`: every state a position-indexed KV cache, which decoding
only writes after the prompt), a request with exactly the same prompt as the last prefill
(the n choices of one request, a retried request) skips the prefill: the cache still holds
it and the logits are the same numbers recomputing would give. A recurrent state holds only
the state after the last token decoded, so with one the prefill always runs again (after
engine.reset(), which zeroes it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hipc.base.errors import HipcError
from hipc.runtime.generate import Generation, GenerationRequest
from hipc.runtime.server.errors import bad_request, internal_error
from hipc.runtime.server.scheduler import Job

if TYPE_CHECKING:  # `hipc chat` imports this module without the server extra
    from hipc.runtime.server.metrics import ServerMetrics

log = logging.getLogger("hipc.server")


def prefix_reuse(engine) -> bool:
    """Whether the engine's states allow a prefill to be reused: compiled engines answer from
    their plan's state kinds (position-indexed KV: yes; a recurrent state: no, it would need a
    snapshot at the end of the prompt). Engines that do not say are not reused."""
    return bool(getattr(engine, "prefix_reuse", False))


class EngineSlot:
    """The engine as Generation sees it: the admitted context, with prefill reuse."""

    def __init__(self, engine, max_context: int, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.max_context = max_context
        self.vocab_size = engine.vocab_size
        self._reuse = prefix_reuse(engine)
        self._metrics = metrics
        self._prompt: tuple[int, ...] | None = None
        self._logits: np.ndarray | None = None

    def reset(self) -> None:
        pass  # deferred to forward(start=0): a reused prefill must not be cleared

    def invalidate(self) -> None:
        self._prompt = self._logits = None

    def forward(self, tokens: Sequence[int], start: int) -> np.ndarray:
        if start == 0:
            key = tuple(tokens)
            if self._reuse and key == self._prompt and self._logits is not None:
                if self._metrics is not None:
                    self._metrics.prompt_reuse.inc()
                return self._logits.copy()
            self.invalidate()
            self.engine.reset()
            logits = self.engine.forward(tokens, 0)
            if self._reuse:
                self._prompt, self._logits = key, np.array(logits, copy=True)
            return logits
        if self._prompt is not None and start < len(self._prompt):
            self.invalidate()  # this write lands inside the kept prompt
        try:
            return self.engine.forward(tokens, start)
        except BaseException:
            self.invalidate()
            raise


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    request: GenerationRequest


class Runner:
    def __init__(self, slot: EngineSlot, tokenizer, metrics: ServerMetrics) -> None:
        self.slot, self.tokenizer, self.metrics = slot, tokenizer, metrics

    def work(
        self, choices: list[ChoiceSpec], stream: bool, prompt_tokens: int
    ) -> Callable[[Job], None]:
        def run(job: Job) -> None:
            self._run(job, choices, stream, prompt_tokens)

        return run

    def _run(self, job: Job, choices: list[ChoiceSpec], stream: bool, prompt_tokens: int) -> None:
        m = self.metrics
        m.queue_wait.observe((job.started_at or job.arrived) - job.arrived)
        m.prompt_tokens.inc(prompt_tokens)
        last: float | None = None
        try:
            for spec in choices:
                if job.cancelled:
                    break
                gen = Generation(self.slot, self.tokenizer, spec.request)
                if stream:
                    job.emit(("start", spec.index))
                steps = gen.steps()
                try:
                    for step in steps:
                        if step.token_ids:
                            now = time.monotonic()
                            if last is None:
                                m.ttft.observe(now - job.arrived)
                            else:
                                m.tpot.observe((now - last) / len(step.token_ids))
                            last = now
                            m.generation_tokens.inc(len(step.token_ids))
                        if stream:
                            job.emit(("step", spec.index, step))
                        if job.cancelled:
                            break
                finally:
                    steps.close()
                if job.cancelled:
                    break
                m.finished.labels(gen.result.finish_reason).inc()
                job.results.append((spec.index, gen.result))
                if stream:
                    job.emit(("end", spec.index, gen.result))
        except HipcError as e:
            job.error = bad_request(str(e))
        except Exception:
            log.exception("generation failed")
            self.slot.invalidate()
            job.error = internal_error()
        finally:
            m.e2e.observe(time.monotonic() - job.arrived)
            job.emit(("done",))
