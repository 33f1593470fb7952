"""The generation loop: prefill, then sample-and-decode, streaming text as it completes.

Works over any engine with `max_context`, `reset()` and `forward(tokens, start)`
(logits of the last token): the reference executor and compiled artifacts alike.
Text is streamed through an incremental decoder, so a multi-byte character split
across tokens is emitted whole, and text that could still turn into a stop string is
held back until it cannot.

Iterating a Generation gives text deltas (the CLI); `steps()` gives one Step per generated
token with its id and, when asked for, its log-probability (the server, which also stops
iterating to cancel: nothing runs between steps).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hipc.base.errors import HipcError
from hipc.base.tokenizer import IncrementalDecoder, Tokenizer
from hipc.runtime.sampler import Sampler, SamplingParams, token_logprobs


class Engine(Protocol):
    max_context: int

    def reset(self) -> None: ...

    def forward(self, tokens: Sequence[int], start: int) -> np.ndarray: ...


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int | None = None  # None = the rest of the context
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: the chosen token's and the n most likely
    grammar: str | None = None  # llguidance grammar the output must match (runtime/constraint.py)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Step:
    """What one step released: text (often '' while it is held back) and the tokens since
    the previous step (one, or none for the final flush), with their logprobs if asked for."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class GenerationResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_token_ids) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # the first generated token comes from prefill; decode steps make the rest
        steps = max(len(self.token_ids) - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt_token_ids,
            "finish_reason": self.finish_reason,
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
        }


class Generation:
    """Iterate for text deltas, or `steps()` for Steps; `result` is complete once iteration ends."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, request: GenerationRequest) -> None:
        prompt = list(request.prompt_ids)
        if not prompt:
            raise HipcError("the prompt is empty")
        room = engine.max_context - len(prompt)
        if room <= 0:
            raise HipcError(
                f"the prompt is {len(prompt)} tokens; the context holds {engine.max_context} "
                "(compile with a larger --max-context or shorten the prompt)"
            )
        self.max_tokens = room if request.max_tokens is None else min(request.max_tokens, room)
        self.engine, self.tokenizer, self.request = engine, tokenizer, request
        self.result = GenerationResult(prompt_token_ids=prompt)
        stops = set(request.stop_token_ids)
        if not request.ignore_eos:
            stops.update(tokenizer.eos_token_ids)
        self._stop_ids = stops

    def __iter__(self) -> Iterator[str]:
        for step in self.steps():
            if step.text:
                yield step.text

    def steps(self) -> Iterator[Step]:
        res = self.result
        decoding = self.decoding()
        self.engine.reset()
        t0 = time.perf_counter()
        logits = self.engine.forward(res.prompt_token_ids, 0)
        res.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pos = len(res.prompt_token_ids)
        # An engine that can start a step and collect it later (CompiledEngine) runs the next
        # step on the GPU while this token is detokenized, checked for stop strings and
        # handed to the consumer; a step started for a sequence that then stops is collected
        # and dropped.
        submit = getattr(self.engine, "submit", None)
        # the logits of a step collected are sampled before the next submit: a view of the
        # engine's buffer serves (a copy of a 128k vocabulary is tens of microseconds per
        # token, with the GPU idle)
        view = submit is not None and "copy" in inspect.signature(self.engine.collect).parameters
        # a greedy sequence wants only each step's argmax, which the engine may pick on the
        # device (one value copied back instead of a vocabulary of logits); so does one drawn
        # at a temperature alone, where the engine draws on the device (Decoding.draw: the
        # same uniform numbers from the sequence's generator, one a token)
        drawn = bool(decoding.device_draw) and getattr(self.engine, "can_draw", False)
        # the submit's draw for each token (Decoding.draw takes its uniform number)
        draw = (lambda: {"draw": decoding.draw()}) if drawn else dict
        argmax = (
            submit is not None
            and (decoding.greedy_argmax or drawn)
            and hasattr(self.engine, "collect_argmax")
        )
        # and where the engine can, the step after is queued before this one is collected,
        # its token the device's pick: the device goes from step to step without waiting for
        # the host (a step queued for a sequence that then stops is dropped)
        ahead = argmax and getattr(self.engine, "can_submit_next", False)
        picked = None  # the step's argmax, where collected as such
        queued = False  # a step for the next token is in flight already (ahead)
        while (
            token := decoding.sample(logits) if picked is None else decoding.take(picked)
        ) is not None:
            running = submit is not None and decoding.continues()
            if running and not queued:
                if argmax:
                    submit([token], pos, argmax=True, **draw())
                else:
                    submit([token], pos)
            # the token the step in flight computes leaves room for one more step
            queued = ahead and running and decoding.continues(1)
            if queued:
                self.engine.submit_next(pos + 1, **draw())
            step = decoding.emit()
            if step is None:
                if queued:
                    self.engine.drop_steps()
                    queued = False
                elif running and argmax:
                    self.engine.collect_argmax()
                elif running:
                    self.engine.collect()
                break
            yield step
            if argmax and running:
                picked = self.engine.collect_argmax()
            elif running:
                logits = self.engine.collect(copy=False) if view else self.engine.collect()
            else:
                logits, picked = self.engine.forward([token], pos), None
            pos += 1
        if queued:  # a step for the token after a stop token: waited for and dropped
            self.engine.drop_steps()
        res.decode_s = time.perf_counter() - t0
        last = decoding.finish()
        if last is not None:
            yield last

    def decoding(self) -> Decoding:
        """The per-token half of this generation, driven by whoever computes the logits (a
        batch engine steps many of them at once)."""
        return Decoding(self)


class Decoding:
    """One sequence after its prompt: `advance(logits)` samples the next token and says what
    to stream; it returns None once the sequence has finished (then `finish()` gives the last
    Step, if any). Sampler, stop conditions, logprobs and grammar are this sequence's own."""

    def __init__(self, gen: Generation) -> None:
        self.gen, self.request, self.result = gen, gen.request, gen.result
        req = gen.request
        self.sampler = Sampler(req.sampling)
        self.decoder = IncrementalDecoder(
            gen.tokenizer, skip_special_tokens=True, context=gen.result.prompt_token_ids
        )
        self.text, self.emitted = "", 0
        self.hold = max((len(s) for s in req.stop), default=1) - 1
        self.pending: list[int] = []
        self.pending_lp: list[TokenLogprob] = []
        self.constraint = None
        if req.grammar is not None:
            from hipc.runtime.constraint import Constraint

            self.constraint = Constraint(gen.tokenizer, req.grammar)
        self.next_token: int | None = None
        self.done = gen.max_tokens <= 0

    def advance(self, logits: np.ndarray) -> Step | None:
        """The Step to stream after sampling from `logits` (then feed `next_token`), or None
        when this token ended the sequence."""
        return None if self.sample(logits) is None else self.emit()

    def advance_token(self, token: int) -> Step | None:
        """`advance` for a token sampled outside (a batch's argmax; `greedy_argmax` only)."""
        return None if self.take(token) is None else self.emit()

    @property
    def greedy_argmax(self) -> bool:
        """Whether the raw logits' argmax is this sequence's whole sampling step (greedy, no
        penalty, bias or grammar, no logprobs): a batch then picks it for all such rows at
        once, or on the device."""
        return self.device_draw == 0.0

    @property
    def device_draw(self) -> float | None:
        """1 / temperature where this sequence's sampling step is the raw logits' argmax (0)
        or a draw from their softmax at a temperature alone (no truncation, penalty, bias,
        grammar or logprobs): what a device pick makes (`draw()`); None where it needs the
        host sampler."""
        p = self.sampler.params
        if (
            self.sampler.moves_logits
            or self.constraint is not None
            or self.request.logprobs is not None
        ):
            return None
        if p.greedy:
            return 0.0
        if p.top_k or p.top_p < 1.0 or p.min_p > 0:
            return None
        return 1.0 / max(p.temperature, 1e-6)  # (the host sampler's floor)

    def draw(self) -> tuple[float, float]:
        """(1 / temperature, u) for a device pick of the next token (`device_draw` not None):
        u is the uniform number the host sampler's draw would take from this sequence's
        generator, so the device picks the token the host would (but within float32 rounding
        of a boundary between two tokens); a greedy sequence's (0, 0) takes none."""
        inv_t = self.device_draw
        if inv_t is None:
            raise HipcError("this sequence's sampling needs its logits on the host")
        if not inv_t:
            return 0.0, 0.0
        # (a u that float32 would round up to 1 is the float32 just below it)
        return inv_t, min(self.sampler.rng.random(), 1.0 - 2.0**-24)

    def sample(self, logits: np.ndarray) -> int | None:
        """advance's first half: the token sampled from `logits` (recorded), or None when it
        ends the sequence (a stop token). `emit()` does the rest; between the two, whoever
        runs the model may already start the step that feeds the token (`continues()`)."""
        if self.done:
            return None
        constraint = self.constraint
        allowed = None if constraint is None else constraint.allowed(logits.size)
        res = self.result
        return self.take(self.sampler(logits, res.prompt_token_ids, res.token_ids, allowed), logits)

    def take(self, token: int, logits: np.ndarray | None = None) -> int | None:
        """Record `token`, sampled for this sequence (by `sample`, or for a batch of
        `greedy_argmax` rows at once); None when it ends the sequence. `logits` are needed
        only for logprobs."""
        if self.done:
            return None
        gen, req, res = self.gen, self.request, self.result
        self.done = True
        if token in gen._stop_ids:
            res.finish_reason = "stop"
            return None
        if self.constraint is not None:
            self.constraint.advance(token)
        res.token_ids.append(token)
        self.pending.append(token)
        if req.logprobs is not None:
            lp, top = token_logprobs(logits, token, req.logprobs)
            self.pending_lp.append(TokenLogprob(token, lp, top))
            res.logprobs.append(self.pending_lp[-1])
        return token

    def continues(self, later: int = 0) -> bool:
        """After `sample`: whether the length limit leaves room for a step after this token
        (`later`: after that many tokens more; a stop string or the grammar may still end
        the sequence in `emit`)."""
        return len(self.result.token_ids) + later < self.gen.max_tokens

    def emit(self) -> Step | None:
        """advance's second half: detokenize the sampled token and check the stop strings,
        the grammar and the length; the Step to stream, or None when the sequence ended."""
        gen, req, res = self.gen, self.request, self.result
        constraint = self.constraint
        token = res.token_ids[-1]
        self.text += self.decoder.feed(token)
        cut = _find_stop(self.text, req.stop, self.emitted)
        if cut is not None:
            self.text, res.finish_reason = self.text[:cut], "stop"
            return None
        if constraint is not None and constraint.done:
            res.finish_reason = "stop"
            return None
        if len(res.token_ids) >= gen.max_tokens:
            res.finish_reason = "length"
            return None
        self.done = False
        delta = ""
        if len(self.text) - self.hold > self.emitted:
            delta = self.text[self.emitted : len(self.text) - self.hold]
            self.emitted = len(self.text) - self.hold
        step = Step(delta, tuple(self.pending), tuple(self.pending_lp))
        self.pending.clear()
        self.pending_lp.clear()
        self.next_token = token
        return step

    def finish(self) -> Step | None:
        """Flush held-back text once the sequence has ended: the last Step, if any."""
        req, res = self.request, self.result
        text = self.text
        if res.finish_reason == "length" or res.finish_reason is None:
            text += self.decoder.flush()
            cut = _find_stop(text, req.stop, self.emitted)
            if cut is not None:
                text, res.finish_reason = text[:cut], "stop"
        res.finish_reason = res.finish_reason or "length"
        res.text = self.text = text
        if len(text) > self.emitted or self.pending:
            return Step(text[self.emitted :], tuple(self.pending), tuple(self.pending_lp))
        return None


def _find_stop(text: str, stops: Sequence[str], emitted: int) -> int | None:
    if not stops:
        return None
    start = max(emitted - max(len(s) for s in stops), 0)
    hits = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
