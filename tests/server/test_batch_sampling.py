"""The batch loop's sampling (runtime/server/batching.py): greedy rows picked by one argmax
over the step, or by the backend on the device (`step_top`), and every other row by its own
sampler; each choice gets what the one-sequence generation loop gives it."""

from __future__ import annotations

import contextlib
import re
import time

import numpy as np
import pytest

from hipc.runtime.engine import load_engine
from hipc.runtime.generate import Generation, GenerationRequest
from hipc.runtime.sampler import SamplingParams
from hipc.runtime.server.config import Config
from hipc.runtime.server.runner import ChoiceSpec
from hipc.runtime.server.service import Service


class DeviceTop:
    """The cpu backend plus a `step_top` as a GPU backend's would answer it: each row's k
    likeliest token ids (ties to the lower id) and logits, here by a stable sort."""

    max_top_k = 4

    def __init__(self, inner) -> None:
        self.inner = inner
        self.top_calls = self.logit_calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, *args):
        self.logit_calls += 1
        return self.inner.step(*args)

    def step_top(self, ids, pos, seq, tables, out_rows, k):
        self.top_calls += 1
        logits = self.inner.step(ids, pos, seq, tables, out_rows)
        order = np.argsort(-logits, axis=1, kind="stable")[:, :k]
        return order.astype(np.int32), np.take_along_axis(logits, order, axis=1)


class Overlapped(DeviceTop):
    """DeviceTop plus a GPU backend's asynchronous step (gpu_common's submit_step/collect):
    submit_step keeps copies of the inputs, as the GPU backend copies them to pinned
    buffers, and the step runs only at collect, as the device's result is there only then;
    whatever the batch changes between the two (sequences fed, admitted or released) must
    not reach the step in flight."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.queued = None
        self.submits = 0

    def submit_step(self, ids, pos, seq, tables, out_rows, top=0):
        assert self.queued is None, "a second step submitted before the first was collected"
        self.submits += 1
        self.queued = tuple(np.array(a) for a in (ids, pos, seq, tables, out_rows)), top

    def collect(self, copy=True):
        (args, top), self.queued = self.queued, None
        return self.step_top(*args, top) if top else self.step(*args)


class Pipelined(DeviceTop):
    """Overlapped plus steps ahead (gpu_common's `pipelines`): a step may be submitted
    before the one in flight is collected, its `feed` runs' ids taken from that step's top-1
    picks as the device copies them. Steps run in order, each when the next one needs its
    picks or at its collect."""

    pipelines = True

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.queue: list[list] = []  # [inputs, top, result or None]
        self.submits = self.ahead = 0

    def _run(self, entry) -> None:
        if entry[2] is None:
            args, top = entry[0], entry[1]
            entry[2] = self.step_top(*args, top) if top else self.step(*args).copy()

    def submit_step(self, ids, pos, seq, tables, out_rows, top=0, feed=None):
        self.submits += 1
        ids = np.array(ids)
        if feed is not None:
            assert len(self.queue) == 1 and self.queue[0][1], "fed from a device-picked step"
            self.ahead += 1
            self._run(self.queue[0])
            picks = self.queue[0][2][0][:, 0]
            for row, src, n in feed:
                ids[row : row + n] = picks[src : src + n]
        else:
            assert not self.queue, "a second step submitted before the first was collected"
        args = (ids, *(np.array(a) for a in (pos, seq, tables, out_rows)))
        self.queue.append([args, top, None])

    def collect(self, copy=True):
        entry = self.queue.pop(0)
        self._run(entry)
        return entry[2]


class Drawing(Pipelined):
    """Pipelined plus draws at a temperature on the device (gpu_common's `draws` with top 1:
    each row's (1 / temperature, u); 0 keeps the greedy pick, else the token the host
    sampler's inverse_cdf draws by u from exp((logits - max) / temperature))."""

    draws_on_device = 4

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.drawn = 0

    def submit_step(self, ids, pos, seq, tables, out_rows, top=0, feed=None, draws=None):
        super().submit_step(ids, pos, seq, tables, out_rows, top, feed)
        self.queue[-1].append(None if draws is None else np.array(draws))

    def _run(self, entry) -> None:
        from hipc.runtime.sampler import inverse_cdf

        if entry[2] is not None:
            return
        super()._run(entry)
        draws = entry[3]
        if draws is None or not (draws[:, 0] > 0).any():
            return
        args = entry[0]
        logits = self.inner.step(*args)
        ids = entry[2][0].copy()
        for r, (inv_t, u) in enumerate(draws):
            if inv_t > 0:
                w = np.exp((logits[r].astype(np.float64) - logits[r].max()) * float(inv_t))
                ids[r, 0] = inverse_cdf(w, float(u))
                self.drawn += 1
        entry[2] = (ids, entry[2][1])


BACKENDS = {
    "host-argmax": None,
    "device-top": DeviceTop,
    "overlapped": Overlapped,
    "pipelined": Pipelined,
}


@pytest.fixture(scope="module")
def engines(tiny_artifact):
    alone = load_engine(tiny_artifact, threads=1)
    batched = load_engine(tiny_artifact, threads=1)
    yield alone, batched
    alone.close()
    batched.close()


def requests(engine, sampled: bool) -> list[GenerationRequest]:
    rng = np.random.default_rng(4)
    out = []
    for i in range(6):
        prompt = tuple(int(t) for t in rng.integers(3, engine.vocab_size, 5 + 3 * i))
        sampling, n = SamplingParams(), 12 + i
        if sampled and i % 2:
            # short: the greedy rows then step on by themselves (the device's picks again)
            sampling, n = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=i), 4
        out.append(GenerationRequest(prompt, n, sampling, ignore_eos=True))
    return out


def alone(engine, request: GenerationRequest) -> list[int]:
    gen = Generation(engine, engine.tokenizer, request)
    for _ in gen.steps():
        pass
    return gen.result.token_ids


def batched(service: Service, reqs: list[GenerationRequest]) -> list[list[int]]:
    jobs = []
    for r in reqs:
        job = service.scheduler.job([ChoiceSpec(0, r)], False, len(r.prompt_ids))
        service.scheduler.submit(job)
        jobs.append(job)
    out = []
    for job in jobs:
        assert job.done.wait(60)
        assert job.error is None
        out.append(job.results[0][1].token_ids)
    return out


@contextlib.contextmanager
def serving(engine, wrapper=None):
    """A Service over `engine`, its backend wrapped in `wrapper` (one of BACKENDS') meanwhile:
    (service, the wrapper instance or None)."""
    inner = engine.backend
    backend = wrapper(inner) if wrapper else None
    if backend is not None:
        engine.backend = backend
    try:
        service = Service(engine, Config(max_batch=4, eager_load=False))
        try:
            yield service, backend
        finally:
            service.close(5)
    finally:
        engine.backend = inner


@pytest.mark.parametrize("kind", list(BACKENDS))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "greedy+sampled"])
def test_batched_choices_get_their_lone_tokens(engines, kind, sampled):
    lone, engine = engines
    with serving(engine, BACKENDS[kind]) as (service, backend):
        reqs = requests(engine, sampled)
        got = batched(service, reqs)
        body = service.metrics.render()[0].decode()
    for r, tokens in zip(reqs, got, strict=True):
        assert tokens == alone(lone, r)
    if backend is not None:
        # all-greedy steps ask the device for tokens; a step with a sampled row, for logits
        assert backend.top_calls > 0
        assert (backend.logit_calls > 0) == sampled
    if kind == "pipelined":
        # all-greedy runs go ahead; a sampled row stops that until it ends
        assert backend.submits > 0 and not backend.queue and backend.ahead > 0
    if kind == "overlapped":
        assert backend.submits > 0 and backend.queued is None
        # every step waited for and every gap to the next submit, in /metrics
        waits = re.search(r"^hipc_step_wait_seconds_count (\S+)", body, re.M)
        gaps = re.search(r"^hipc_step_gap_seconds_count (\S+)", body, re.M)
        assert waits and gaps and 0 < float(gaps.group(1)) < float(waits.group(1)), body[-600:]


def test_choices_at_a_temperature_alone_are_drawn_on_the_device(engines):
    """Where the backend draws on the device, a batch of greedy choices and choices at a
    temperature alone asks it for every row's token (no logits back) and goes ahead step
    after step; each choice gets the tokens it gets alone, sampled on the host from the same
    seed (the uniform numbers come from its generator in the same order). A choice with
    top_p in the batch sends every row's logits to the host again."""
    lone, engine = engines
    with serving(engine, Drawing) as (service, backend):
        reqs = [
            GenerationRequest(r.prompt_ids, r.max_tokens, SamplingParams(temperature=1.5, seed=i),
                              ignore_eos=True) if i % 2 else r
            for i, r in enumerate(requests(engine, False))
        ]  # fmt: skip
        got = batched(service, reqs)
        assert backend.logit_calls == 0 and backend.drawn > 0 and backend.ahead > 0
        for r, tokens in zip(reqs, got, strict=True):
            assert tokens == alone(lone, r)
        assert any(len(set(tokens)) > 3 for tokens in got[1::2])  # the draws move
        mixed = [reqs[0], GenerationRequest(reqs[1].prompt_ids, 4, SamplingParams(
            temperature=1.5, top_p=0.9, seed=1), ignore_eos=True)]  # fmt: skip
        got = batched(service, mixed)
        assert backend.logit_calls > 0
        for r, tokens in zip(mixed, got, strict=True):
            assert tokens == alone(lone, r)


@pytest.mark.parametrize("wrapper", [Overlapped, Pipelined], ids=["overlapped", "pipelined"])
def test_overlapped_steps_keep_stop_strings_and_return_every_block(engines, wrapper):
    """With the next step in flight while a step's tokens are streamed (and, pipelined, one
    more ahead of it), a choice that a stop string ends has a token or two more computed (its
    rows of the steps in flight are wasted): its text and tokens are still what it gets
    alone, and every block comes back."""
    lone, engine = engines
    with serving(engine, wrapper) as (service, backend):
        reqs = []
        for r in requests(engine, sampled=False):
            text = Generation(lone, lone.tokenizer, r)
            for _ in text.steps():
                pass
            full = text.result.text
            # a stop string from the middle of the lone reply (where it has one)
            stop = full[len(full) // 2 : len(full) // 2 + 3].strip()
            reqs.append(GenerationRequest(r.prompt_ids, r.max_tokens, stop=(stop,) if stop else ()))
        jobs = []
        for r in reqs:
            job = service.scheduler.job([ChoiceSpec(0, r)], False, len(r.prompt_ids))
            service.scheduler.submit(job)
            jobs.append(job)
        for r, job in zip(reqs, jobs, strict=True):
            assert job.done.wait(60) and job.error is None
            res = job.results[0][1]
            want = Generation(lone, lone.tokenizer, r)
            for _ in want.steps():
                pass
            assert (res.text, res.token_ids, res.finish_reason) == (
                want.result.text,
                want.result.token_ids,
                want.result.finish_reason,
            )
        assert sum(r.stop != () for r in reqs) >= 3
        assert any(j.results[0][1].finish_reason == "stop" for j in jobs)
        assert wait_idle(service)
        assert service.batch.pool.used == 0 and not service.batch.running
        assert not service.batch.in_flight
    assert backend.submits > 0


def wait_idle(service: Service, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.scheduler.idle() and not service.batch.in_flight:
            return True
        time.sleep(0.01)
    return False


def test_a_choice_failing_mid_step_ends_its_request_and_the_loop_goes_on(engines):
    """Two choices of one request fail in the same step (a logit_bias id past the
    vocabulary: the sampler's 400); the request gets that error, the other row of the step is
    skipped, not touched after its job ended, and the next request is served as alone."""
    lone, engine = engines
    service = Service(engine, Config(max_batch=4, eager_load=False))
    try:
        bad = SamplingParams(temperature=0.5, logit_bias=((10**6, 1.0),), seed=1)
        prompt = tuple(range(3, 9))
        req = GenerationRequest(prompt, 4, bad, ignore_eos=True)
        job = service.scheduler.job([ChoiceSpec(0, req), ChoiceSpec(1, req)], False, 12)
        service.scheduler.submit(job)
        assert job.done.wait(60)
        assert getattr(job.error, "status", None) == 400
        assert "logit_bias" in str(job.error)
        good = requests(engine, sampled=False)[:2]
        assert batched(service, good) == [alone(lone, r) for r in good]
        assert service.batch.pool.used == 0 and not service.batch.running
    finally:
        service.close(5)
