"""Continuous batching of the hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on a real GPU:
runtime/batch.py's BatchEngine over GpuBackend.step with the recurrent states in per-sequence
slots (compiler/kernels/deltanet.py: row t's in slot seq[t]).

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found); the tiny models
come from HIPC_HYBRID_MODELS as in test_compiled_hybrid_gpu.py. Sequences with different
prompt lengths (shorter than the conv window, one block, across the 64-position snapshot
point) join and leave at different steps, prompts prefilled in chunks of 16 beside decode
rows (mixed steps: the batch list, the deltanet kernel stepping each sequence's run in its
slot), decode rows through the bucket graphs with padding rows, and each sequence must give
what it gives alone. Alone, a prompt's 64-token pieces run the chunked deltanet kernels, the
decode the GEMVs and the split-K decode attention; in a batch the serial kernel, the GEMMs and
the SIMT attention, which sum in another order: `--prefill-precision split` holds logits to
2e-3 of the largest (test_batch_gpu.py's bar), greedy tokens equal except where alone's two
likeliest are within the bar (that sequence is compared no further).

Cancelling sequences mid-stream gives back every block and every slot, and a later sequence
in a reused slot still gives what it gives alone; a prefix hit resumes from a snapshot
copied on the device and gives what a miss gives.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_compiled_hybrid_gpu import model

from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.runtime.batch import BatchEngine
from hipc.runtime.engine import load_engine

from batch_runs import assert_pool_full, run
from support import rel_err

pytestmark = pytest.mark.gpu
TARGET = "sm_90"
STEP = 64  # a step holds a whole 64-token piece: alone, the chunked deltanet kernels run it
CONTEXT = 192
RNG = np.random.default_rng(5)
PROMPTS = [[int(t) for t in RNG.integers(0, 100, n)] for n in (2, 17, 40, 1, 70, 9)]
NEW = [10, 7, 12, 5, 9, 6]


@pytest.fixture(scope="module", params=["qwen3_5-float32", "qwen3_5_moe", "qwen3_next-hf"])
def engine(request, tmp_path_factory):
    from hipc.runtime.backends import cuda

    if cuda.probe()[0] is None:
        pytest.skip("no NVIDIA GPU")
    root = tmp_path_factory.mktemp(request.param)
    src = model(request.param, root)
    out = root / "m.hipc"
    options = CompileOptions(
        targets=(TARGET,), max_context=CONTEXT, max_tokens=STEP, prefill_precision="split"
    )
    compile_model(src, out, options, verbose=False)
    e = load_engine(out, target="cuda", kv_pool_tokens=4 * CONTEXT)
    yield e
    e.close()


BAR = 2e-3


def assert_like_alone(got, want) -> None:
    """test_batch_gpu.py's rule: logits within BAR of the largest, greedy tokens equal but
    where alone's two likeliest are within the bar (compared no further)."""
    for k, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
        assert rel_err(g, w) <= BAR, (k, rel_err(g, w))
        if got[0][k] != want[0][k]:
            top2 = np.sort(w)[-2:]
            assert top2[1] - top2[0] <= BAR * np.abs(w).max(), k
            return
    assert got[0] == want[0]


def alone(engine, prompt, new):
    be = BatchEngine(engine, max_batch=4)
    got = run(be, [0], [new], [prompt])[0]
    be.drop_snapshots()
    return got


def test_every_sequence_of_a_batch_gives_what_it_gives_alone(engine):
    want = {i: alone(engine, p, NEW[i]) for i, p in enumerate(PROMPTS)}
    be = BatchEngine(engine, max_batch=4, prefill_chunk=16)
    b = engine.backend
    assert b.slots >= 4 and (b.slots, b.slots + 1) == (b.PAD, b.SOLO)
    kinds = []
    step = b.step

    def spy(ids, pos, seq, tables, out_rows):
        n = len(set(seq.tolist()))
        kinds.append("one" if n == 1 else "batch" if n == len(ids) else "mixed")
        return step(ids, pos, seq, tables, out_rows)

    b.step = spy
    try:
        got = run(be, [0, 0, 2, 3, 5, 5], NEW, PROMPTS)
    finally:
        del b.step
    for i in want:
        assert_like_alone(got[i], want[i])
    assert {"mixed", "batch"} <= set(kinds), kinds
    assert any(kind == "batch" for kind, _ in b._graphs)
    assert_pool_full(be)
    assert sorted(be._slots) == list(range(be.max_batch))
    be.drop_snapshots()


def test_cancelling_mid_stream_frees_blocks_and_slots(engine):
    before = alone(engine, PROMPTS[4], NEW[4])
    be = BatchEngine(engine, max_batch=4, prefill_chunk=16)
    for round_ in range(3):

        def leave(i, step, round_=round_):
            return step >= 1 + (i + round_) % 4

        got = run(be, [0, 0, 1, 1, 2, 3], [30] * len(PROMPTS), PROMPTS, leave=leave)
        assert len(got) == len(PROMPTS)
        assert_pool_full(be)
        assert sorted(be._slots) == list(range(be.max_batch))
    be.drop_snapshots()
    # a slot reused after cancellations starts from zeroed states
    after = alone(engine, PROMPTS[4], NEW[4])
    assert after[0] == before[0]
    assert rel_err(np.stack(after[1]), np.stack(before[1])) <= 1e-6


def test_a_prefix_hit_resumes_from_a_device_snapshot(engine):
    shared = PROMPTS[2]  # 40 tokens: its states are kept at 32, its last full block's end
    longer = [*shared, 5, 6, 7]
    miss = alone(engine, longer, 8)
    be = BatchEngine(engine, max_batch=4)
    run(be, [0], [4], [shared])
    hit = run(be, [0], [8], [longer])[0]
    assert be.pool.hit_tokens == 32  # two KV blocks and the states at 32
    assert_like_alone(hit, miss)
    assert_pool_full(be)
    be.drop_snapshots()
