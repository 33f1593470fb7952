"""Continuous batching on the CPU target (runtime/batch.py over the paged KV pool).

Every sequence of a batch must produce what it produces alone: greedy tokens equal, and
logits bitwise equal for float weights, where every CPU kernel computes a row the same way
whatever the step's other rows. Quantized weights are within 1e-3 of the largest logit:
a decode step of one row runs the GEMV kernels, a step of several rows the row-lane GEMM,
which add the same exact integer block products in another order (measured: 1.1e-4 Q8_0,
2.8e-4 Q4_1, 2.0e-4 Q4_K_M on this model).
"""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.runtime.batch import BatchEngine
from hipc.runtime.engine import load_engine

import batch_driver
from batch_driver import assert_pool_full
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
    return batch_driver.alone(engine, i, prompts, new)


def run(be: BatchEngine, joins, new, prompts=PROMPTS, leave=None):
    return batch_driver.run(be, joins, new, prompts, leave)


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


def test_every_sequence_of_a_batch_produces_what_it_produces_alone(engine, artifact):
    want = {i: alone(engine, i) for i in range(len(PROMPTS))}
    # joining at different steps, prompts chunked by 8 among decode rows, leaving after
    # different numbers of tokens
    be = BatchEngine(engine, max_batch=4, prefill_chunk=8)
    got = run(be, [0, 0, 2, 3, 5, 5], NEW)
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

        got = run(be, [0, 0, 1, 1, 2, 3], [30] * 6, leave=leave)
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


def test_a_recurrent_state_runs_one_sequence_at_a_time(artifact, tmp_path):
    """The state-kind rule: a recurrent state is one sequence's, and is reused only from a
    snapshot (none is taken), so the batch holds one sequence and shares nothing."""
    path = tmp_path / "rec.hipc"
    shutil.copytree(artifact[0], path)
    plan = json.loads((path / "plan.json").read_text())
    plan["states"].append({"name": "l0.conv", "kind": "recurrent", "dtype": "float32",
                           "shape": [3, 8]})  # fmt: skip
    (path / "plan.json").write_text(json.dumps(plan))
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "plan.json").read_bytes()
    manifest["files"]["plan.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    engine = load_engine(path, target="cpu", threads=1, kv_pool_tokens=1024)
    try:
        be = BatchEngine(engine, max_batch=4)
        assert be.max_batch == 1 and not be.pool.caching
        first = be.admit(PROMPTS[2], 50)
        engine.backend.kv[-1].fill(1.0)
        assert be.admit(PROMPTS[2], 50) is None  # one at a time
        be.release(first)
        assert be.admit(PROMPTS[2], 50) is not None and be.pool.hit_tokens == 0
        assert not engine.backend.kv[-1].any()  # zeroed for the new sequence
    finally:
        engine.close()


def test_a_hybrid_model_batches_one_sequence_at_a_time(tmp_path):
    """Qwen3.5's Gated DeltaNet layers keep a recurrent state in place: the batch engine
    runs its sequences one after another (each starting from a zeroed state), shares no
    prefix, and gives each the greedy tokens of the one-sequence engine."""
    from support import make_hybrid_hf

    out = tmp_path / "hybrid.hipc"
    make_hybrid_hf("qwen3_5", tmp_path / "hf", seed=3)
    compile_model(tmp_path / "hf", out, CompileOptions(max_context=CONTEXT, max_tokens=STEP),
                  verbose=False)  # fmt: skip
    engine = load_engine(out, target="cpu", threads=1, kv_pool_tokens=4 * CONTEXT)
    try:
        prompts = [PROMPTS[2], PROMPTS[2], PROMPTS[4]]  # a repeated prompt: not shared
        want = []
        for p in prompts:
            engine.reset()
            logits, tokens = engine.forward(p, 0), []
            for k in range(6):
                tokens.append(int(np.argmax(logits)))
                logits = engine.forward([tokens[-1]], len(p) + k)
            want.append(tokens)
        be = BatchEngine(engine, max_batch=4, prefill_chunk=8)
        assert be.max_batch == 1 and not be.pool.caching
        got = run(be, [0, 0, 0], [6, 6, 6], prompts)
        assert [got[i][0] for i in range(3)] == want
        assert be.pool.hit_tokens == 0
        assert_pool_full(be)
    finally:
        engine.close()
