"""Continuous batching on the CPU target (runtime/batch.py over the paged KV pool).

Every sequence of a batch must produce what it produces alone: greedy tokens equal, and
logits bitwise equal for float weights, where every CPU kernel computes a row the same way
whatever the step's other rows. Quantized weights are within 1e-3 of the largest logit:
a decode step of one row runs the GEMV kernels, a step of several rows the row-lane GEMM,
which add the same exact integer block products in another order (measured: 1.1e-4 Q8_0,
2.8e-4 Q4_1, 2.0e-4 Q4_K_M on this model).
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.base.errors import HipcError
from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.runtime.batch import BatchEngine
from hipc.runtime.engine import load_engine

from batch_runs import assert_pool_full, run, run_overlapped
from support import write_tiny_hf

STEP = 16  # the artifact's tokens per step: prompts longer than it prefill in chunks
CONTEXT = 128
RNG = np.random.default_rng(7)
PROMPTS = [[int(t) for t in RNG.integers(0, 97, n)] for n in (3, 17, 40, 1, 33, 16)]
NEW = [10, 7, 12, 5, 9, 6]


@pytest.fixture(scope="module", params=[None, "q4_1"], ids=["f32", "q4_1"])
def artifact(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    src = write_tiny_hf(
        root / "src",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
    )
    out = root / "m.hipc"
    options = CompileOptions(max_context=CONTEXT, max_tokens=STEP, quant=request.param)
    compile_model(src, out, options, verbose=False)
    return out, request.param


@pytest.fixture(scope="module")
def engine(artifact):
    e = load_engine(artifact[0], target="cpu", threads=1, kv_pool_tokens=40 * 16)
    yield e
    e.close()


def alone(engine, i: int, prompts=PROMPTS, new=NEW):
    joins = [None] * len(prompts)
    joins[i] = 0
    return run(BatchEngine(engine, max_batch=4), joins, new, prompts)[i]


def assert_same(got, want, quant):
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1], strict=True):
        if quant is None:
            np.testing.assert_array_equal(g, w)
        else:
            assert np.abs(g - w).max() <= 1e-3 * np.abs(w).max()


def test_alone_in_the_batch_engine_is_the_one_sequence_engine(engine):
    """A sequence alone in the batch engine is what forward() computes (chunks of STEP)."""
    for i in (2, 3):
        logits = [engine.forward(PROMPTS[i], 0)]
        tokens = []
        for k in range(NEW[i]):
            tokens.append(int(np.argmax(logits[-1])))
            if k + 1 < NEW[i]:
                logits.append(engine.forward([tokens[-1]], len(PROMPTS[i]) + k))
        got = alone(engine, i)
        assert got[0] == tokens
        for g, w in zip(got[1], logits, strict=True):
            np.testing.assert_array_equal(g, w)


def test_forward_without_a_copy_on_the_cpu(engine):
    """forward(copy=False) is the same step on the CPU backend, whose logits are a new array
    either way (the view contract is the GPU backends')."""
    n = len(PROMPTS[0])
    engine.forward(PROMPTS[0], 0)
    a = engine.forward([1], n, copy=False)
    b = engine.forward([1], n)
    np.testing.assert_array_equal(a, b)
    assert not np.shares_memory(a, b)


def test_the_backends_one_sequence_view_refuses_positions_past_its_context(engine):
    """forward() skips step()'s table checks (its own table is valid by construction) but not
    the context's bound: past it, the one-sequence table would wrap onto block 0."""
    backend = engine.backend
    for start, n in ((backend.max_context, 1), (backend.max_context - 2, 3), (-1, 1)):
        with pytest.raises(HipcError, match="past the"):
            backend.forward(np.ones(n, np.int64), start, False)
    assert backend.forward(np.ones(1, np.int64), backend.max_context - 1, False).shape == (
        1,
        backend.vocab,
    )


def test_every_sequence_of_a_batch_produces_what_it_produces_alone(engine, artifact):
    want = {i: alone(engine, i) for i in range(len(PROMPTS))}
    # joining at different steps, prompts chunked by 8 among decode rows, leaving after
    # different numbers of tokens
    be = BatchEngine(engine, max_batch=4, prefill_chunk=8)
    got = run(be, [0, 0, 2, 3, 5, 5], NEW, PROMPTS)
    assert be.steps < sum(len(p) // 8 + n for p, n in zip(PROMPTS, NEW, strict=True))
    for i in want:
        assert_same(got[i], want[i], artifact[1])
    assert_pool_full(be)


def test_cancelling_mid_stream_frees_the_blocks(engine):
    be = BatchEngine(engine, max_batch=4, prefill_chunk=8)
    total = be.pool.n_blocks
    for round_ in range(3):
        # sequences leave after 1..4 steps, some in the middle of their prefill
        def leave(i, step, round_=round_):
            return step >= 1 + (i + round_) % 4

        got = run(be, [0, 0, 1, 1, 2, 3], [30] * 6, PROMPTS, leave=leave)
        assert len(got) == 6
        assert_pool_full(be)
    assert be.pool.n_blocks == total


def test_admission_waits_for_blocks_instead_of_failing(engine):
    be = BatchEngine(engine, max_batch=8)
    blocks = be.pool.n_blocks
    per = be.blocks_for(CONTEXT)
    # distinct prompts: a second copy of one would wait for the first's blocks instead
    held = [be.admit([i, *PROMPTS[1]], CONTEXT) for i in range(blocks // per)]
    assert all(held) and be.pool.available < per
    assert be.admit(PROMPTS[2], CONTEXT) is None  # waits: its blocks cannot all be promised
    be.release(held[0])
    assert be.admit(PROMPTS[2], CONTEXT) is not None
    for s in list(be.running):
        be.release(s)
    assert_pool_full(be)


def test_a_prefix_cache_hit_gives_what_a_miss_gives(engine, artifact):
    shared = PROMPTS[2]  # 40 tokens: two full blocks of 16 can be shared
    longer = [*shared, 5, 6, 7]
    miss = alone(engine, 0, [longer], [8])
    be = BatchEngine(engine, max_batch=4)
    run(be, [0], [4], [shared])
    assert be.pool.cached >= 2 and be.pool.hit_tokens == 0
    hit = run(be, [0], [8], [longer])[0]
    assert be.pool.hit_tokens == 32  # the freed blocks stayed cached and were found
    assert_same(hit, miss, artifact[1])
    # the same prompt twice at once (n choices): the second waits for the first's blocks,
    # then shares them
    be2 = BatchEngine(engine, max_batch=4)
    both = run(be2, [0, 0], [6, 6], [longer, longer])
    assert be2.pool.hit_tokens == 32
    assert_same(both[0], both[1], artifact[1])
    assert_same(both[1], alone(engine, 0, [longer], [6]), artifact[1])
    assert_pool_full(be2)


class _Overlapping:
    """The engine with its cpu backend given a GPU backend's asynchronous step (submit_step,
    collect): the inputs are copied at submit and the step runs at collect, as a device's
    result exists only then."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.backend = self
        self._queued = None

    def __getattr__(self, name):
        inner = self.__dict__["_engine"]
        return getattr(inner.backend if hasattr(inner.backend, name) else inner, name)

    def submit_step(self, ids, pos, seq, tables, out_rows, top=0):
        assert self._queued is None and top == 0
        self._queued = tuple(np.array(a) for a in (ids, pos, seq, tables, out_rows))

    def collect(self, copy=True):
        args, self._queued = self._queued, None
        return self._engine.backend.step(*args)


def test_overlapped_steps_give_the_lone_tokens_and_keep_blocks_until_collected(engine, artifact):
    """The next step is submitted before the last one's tokens are handled (runtime/server/
    batching.py's loop on a GPU): each sequence still gets its lone tokens, including one fed
    a token past its end (a stop string found after the next step started: a wasted row),
    and a sequence released while a step is in flight keeps its blocks until that step is
    collected, when they all come back."""
    be = BatchEngine(_Overlapping(engine), max_batch=4)
    got = run_overlapped(be, (0, 2, 4), NEW, PROMPTS, fed_past=(0,))
    for i in (0, 2, 4):
        assert_same(got[i], alone(engine, i), artifact[1])
    assert_pool_full(be)


def test_a_step_wider_than_the_context_prefills_several_prompts_at_once(tmp_path):
    """--prefill-chunk above --max-context: one step holds the prompts of several joining
    sequences (a served batch's clients arriving together), each as it is alone."""
    src = write_tiny_hf(tmp_path / "src", hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=32)  # fmt: skip
    out = tmp_path / "wide.hipc"
    compile_model(src, out, CompileOptions(max_context=32, max_tokens=96), verbose=False)
    eng = load_engine(out, target="cpu", threads=1, kv_pool_tokens=4 * 32)
    try:
        assert eng.backend.max_tokens == 96
        prompts = [[int(t) for t in RNG.integers(0, 97, 20)] for _ in range(4)]
        new = [6, 6, 6, 6]
        want = [
            run(BatchEngine(eng, max_batch=4), [0], [n], [p])[0]
            for p, n in zip(prompts, new, strict=True)
        ]
        be = BatchEngine(eng, max_batch=4)
        got = run(be, [0, 0, 0, 0], new, prompts)
        # the four prompts (80 rows) in the first step, then one decode step per token
        assert be.steps == max(new)
        for i, w in enumerate(want):
            g = got[i]
            assert g[0] == w[0]
            for a, b in zip(g[1], w[1], strict=True):
                np.testing.assert_array_equal(a, b)
        assert_pool_full(be)
    finally:
        eng.close()
