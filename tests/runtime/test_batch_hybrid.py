"""Continuous batching of hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on the CPU target:
recurrent states in per-sequence slots, prefix reuse only from a snapshot (runtime/batch.py).

Every sequence of a batch gives what it gives alone. Qwen3.5 bitwise: the deltanet kernel
computes a token the same way whatever its step holds (its one-token and several-token forms
add the same products in the same order), and the float32 linear and attention kernels
compute a row the same way whatever the step's other rows. The MoE hybrids within 1e-3 of
the largest logit, greedy tokens equal: the moe kernel multiplies an expert's tokens
together, so a row's sums depend on which other rows chose that expert (measured: 1.3e-6
at most, Qwen3.5-MoE). The batched logits are also checked against the reference executor
(itself checked against transformers in tests/graphs).
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.base.errors import HipcError
from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.compiler.reference.engine import ReferenceEngine
from hipc.graphs import load_model
from hipc.runtime.batch import BatchEngine
from hipc.runtime.engine import load_engine
from hipc.runtime.kv_pool import block_hashes

from batch_runs import assert_pool_full, run
from support import make_hybrid_hf, rel_err

STEP = 16
CONTEXT = 256
RNG = np.random.default_rng(11)
# shorter than the conv window, one block, across the 64-position snapshot point, ...
PROMPTS = [[int(t) for t in RNG.integers(0, 131, n)] for n in (2, 17, 40, 1, 70, 16)]
NEW = [10, 7, 12, 5, 9, 6]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def hybrid(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    make_hybrid_hf(request.param, root / "hf", seed=3)
    out = root / "m.hipc"
    options = CompileOptions(max_context=CONTEXT, max_tokens=STEP)
    compile_model(root / "hf", out, options, verbose=False)
    engine = load_engine(out, target="cpu", threads=1, kv_pool_tokens=5 * CONTEXT)
    yield engine, root / "hf", request.param == "qwen3_5"
    engine.close()


def alone(engine, prompt, new, chunk=None):
    return run(BatchEngine(engine, max_batch=4, prefill_chunk=chunk), [0], [new], [prompt])[0]


def assert_same(got, want, exact=True):
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1], strict=True):
        if exact:
            np.testing.assert_array_equal(g, w)
        else:
            assert np.abs(g - w).max() <= 1e-3 * np.abs(w).max()


def test_every_sequence_of_a_batch_produces_what_it_produces_alone(hybrid):
    engine, src, exact = hybrid
    want = {i: alone(engine, p, NEW[i]) for i, p in enumerate(PROMPTS)}
    # joining at different steps, prompts cut into chunks of 8 among other sequences' rows,
    # leaving after different numbers of tokens (slots reused by later sequences)
    be = BatchEngine(engine, max_batch=4, prefill_chunk=8)
    got = run(be, [0, 0, 2, 3, 5, 5], NEW, PROMPTS)
    assert be.steps < sum(len(p) // 8 + n for p, n in zip(PROMPTS, NEW, strict=True))
    for i in want:
        assert_same(got[i], want[i], exact)
    assert_pool_full(be)
    assert sorted(be._slots) == list(range(be.max_batch))
    # and the batched logits are the model's: the reference executor on each sequence
    for i in (1, 4):
        ref = ReferenceEngine(load_model(src), CONTEXT)
        ref.reset()
        logits = [ref.forward(PROMPTS[i], 0)]
        for k, t in enumerate(got[i][0][:-1]):
            logits.append(ref.forward([t], len(PROMPTS[i]) + k))
        assert rel_err(np.stack(got[i][1]), np.stack(logits)) <= 1e-3


def test_alone_in_the_batch_engine_is_the_one_sequence_engine(hybrid):
    """The one-sequence engine (runtime/recurrent.py's pieces, chunks of STEP) agrees."""
    engine, _, exact = hybrid
    p, n = PROMPTS[4], NEW[4]
    engine.reset()
    logits, tokens = [engine.forward(p, 0)], []
    for k in range(n):
        tokens.append(int(np.argmax(logits[-1])))
        if k + 1 < n:
            logits.append(engine.forward([tokens[-1]], len(p) + k))
    assert_same(alone(engine, p, n), (tokens, logits), exact)


def test_a_prefix_hit_resumes_from_a_snapshot_and_gives_what_a_miss_gives(hybrid):
    engine, _, exact = hybrid
    shared = PROMPTS[2]  # 40 tokens: its states are kept at 32, its last full block's end
    longer = [*shared, 5, 6, 7]
    miss = alone(engine, longer, 8)
    be = BatchEngine(engine, max_batch=4)
    run(be, [0], [4], [shared])
    assert be.pool.hit_tokens == 0 and len(be.snapshots) == 1
    hit = run(be, [0], [8], [longer])[0]
    assert be.pool.hit_tokens == 32  # two KV blocks and the states at 32
    assert_same(hit, miss, exact)
    # a long prompt crosses the 64-position snapshot point: a prompt sharing 70 tokens
    # resumes there and recomputes the rest
    run(be, [0], [3], [PROMPTS[4]])
    before = be.pool.hit_tokens
    again = [*PROMPTS[4], 9]
    assert_same(run(be, [0], [5], [again])[0], alone(engine, again, 5), exact)
    assert be.pool.hit_tokens - before == 64
    assert_pool_full(be)


def test_the_same_prompt_twice_at_once_shares_its_states(hybrid):
    engine, _, exact = hybrid
    longer = [*PROMPTS[2], 5, 6, 7]
    be = BatchEngine(engine, max_batch=4)
    both = run(be, [0, 0], [6, 6], [longer, longer])
    assert be.pool.hit_tokens == 32  # the second waited for the first's snapshot at 32
    assert_same(both[0], both[1], exact)
    assert_same(both[1], alone(engine, longer, 6), exact)
    assert_pool_full(be)


def test_kv_blocks_without_a_snapshot_are_recomputed(hybrid):
    """The state-kind rule: shared KV blocks alone are not a prefix for a recurrent model."""
    engine, _, exact = hybrid
    first = PROMPTS[4][:50]  # states kept at 48 only
    second = [*first[:40], 1, 2, 3, 4, 5]  # shares two blocks (to 32): no states there
    be = BatchEngine(engine, max_batch=4)
    run(be, [0], [2], [first])
    assert len(be.pool.lookup(block_hashes(second, be.block)[:2])) == 2  # the KV is there
    got = run(be, [0], [6], [second])[0]
    assert be.pool.hit_tokens == 0
    assert_same(got, alone(engine, second, 6), exact)


def test_cancelling_frees_slots_and_blocks_and_a_reused_slot_starts_clean(hybrid):
    engine, _, exact = hybrid
    want = {i: alone(engine, PROMPTS[i], NEW[i]) for i in (1, 4)}
    be = BatchEngine(engine, max_batch=4, prefill_chunk=8)
    for round_ in range(2):
        # sequences leave after 1..4 steps, some in the middle of their prefill
        def leave(i, step, round_=round_):
            return step >= 1 + (i + round_) % 4

        run(be, [0, 0, 1, 1, 2, 3], [30] * 6, PROMPTS, leave=leave)
        assert_pool_full(be)
        assert sorted(be._slots) == list(range(be.max_batch))
    # the slots the cancelled sequences left mid-prompt are zeroed for the next ones
    be.snapshots.clear()
    got = run(be, [None, 0, None, None, 0, None], NEW, PROMPTS)
    for i in (1, 4):
        assert_same(got[i], want[i], exact)
    assert_pool_full(be)


def test_the_backend_refuses_rows_of_a_sequence_split_in_a_step(hybrid):
    """The deltanet kernel steps each sequence's rows as one run in its slot: interleaved
    rows, or a slot past the pool, are refused in one line before the kernels run."""
    backend = hybrid[0].backend
    tables = np.zeros((2, backend.kv_table), np.int32)
    tables[1] = 1
    ids = np.array([5, 6, 7], np.int64)
    pos = np.array([0, 0, 1], np.int32)
    rows = np.array([2], np.int32)
    with pytest.raises(HipcError, match="runs of one sequence"):
        backend.step(ids, pos, np.array([0, 1, 0], np.int32), tables, rows)
    with pytest.raises(HipcError, match="runs of one sequence"):
        backend.step(ids, pos, np.array([0, 0, backend.slots], np.int32),
                     np.zeros((backend.slots + 1, backend.kv_table), np.int32), rows)  # fmt: skip
