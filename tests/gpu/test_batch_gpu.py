"""Continuous batching on a real GPU: runtime/batch.py's BatchEngine over GpuBackend.step.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). Sequences with
different prompt lengths join and leave at different steps, prompts are prefilled in chunks
beside decode rows, batches of one row per sequence run the bucket graphs (with padding
rows), and each sequence must give what it gives alone (alone: the decode graph of one row
for every token after the prompt). A row's result does not depend on the other rows of its
step, but a decode row in a batch runs the GEMMs and the SIMT attention where alone it runs
the GEMVs and the split-K decode attention, which sum in another order:

- `--prefill-precision split` (float32-accurate GEMMs, the float32 attention): logits within
  2e-3 of the largest (tests/gpu/test_compiled_gpu.py's bar against the reference);
- the default policy (bf16 operands in the GEMMs and the flash attention of prefill chunks):
  within 0.1 (the bar test_compiled_gpu.py holds that policy to against the reference).

Greedy tokens are equal, except where alone's two likeliest are within the bar: there a
token may differ, and that sequence is compared no further.

Cancelling sequences mid-stream (in prefill and in decode) gives every block back.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.runtime.batch import BatchEngine
from hipc.runtime.engine import load_engine

from batch_runs import alone, assert_pool_full, run, run_overlapped, run_pipelined
from support import rel_err, write_tiny_hf

pytestmark = pytest.mark.gpu
TARGET = "sm_90"
STEP = 16  # tokens per step: longer prompts prefill in chunks
CONTEXT = 256
RNG = np.random.default_rng(11)
PROMPTS = [[int(t) for t in RNG.integers(0, 500, n)] for n in (3, 17, 40, 1, 33, 70, 5, 9, 2)]
NEW = [10, 7, 12, 5, 9, 6, 14, 8, 11]
BARS = {"split": 2e-3, "bf16": 0.1}


def compiled_model(root, policy: str):
    """The tiny dense model compiled at `policy` into root (docs/benchmarks/hybatch_check.sh
    builds its code objects ahead)."""
    # head dim 64: the flash prefill attention under the default policy
    folder = write_tiny_hf(
        root / "m",
        dtype="bfloat16",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        max_position_embeddings=CONTEXT,
    )
    out = root / "m.hipc"
    options = CompileOptions(
        targets=(TARGET,),
        max_context=CONTEXT,
        max_tokens=STEP,
        prefill_precision=policy,
    )
    compile_model(folder, out, options, verbose=False)
    return out


@pytest.fixture(scope="module", params=["split", "bf16"])
def engine(request, tmp_path_factory):
    from hipc.runtime.backends import cuda

    if cuda.probe()[0] is None:
        pytest.skip("no NVIDIA GPU")
    out = compiled_model(tmp_path_factory.mktemp("batch"), request.param)
    e = load_engine(out, target="cuda", kv_pool_tokens=60 * 16)
    yield e, request.param
    e.close()


def assert_like_alone(got, want, policy: str) -> None:
    bar = BARS[policy]
    for k, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
        assert rel_err(g, w) <= bar, (k, rel_err(g, w))
        if got[0][k] != want[0][k]:
            top2 = np.sort(w)[-2:]
            assert top2[1] - top2[0] <= bar * np.abs(w).max(), k
            return
    assert got[0] == want[0]


def test_every_sequence_of_a_batch_gives_what_it_gives_alone(engine):
    eng, policy = engine
    want = {i: alone(eng, i, PROMPTS, NEW) for i in range(len(PROMPTS))}
    be = BatchEngine(eng, max_batch=STEP, prefill_chunk=8)
    sizes = []
    step = be.step

    def counting():
        out = step()
        sizes.append(be.last_batch)
        return out

    be.step = counting
    got = run(be, [0, 0, 2, 3, 5, 5, 0, 1, 9], NEW, PROMPTS)
    for i in want:
        assert_like_alone(got[i], want[i], policy)
    assert_pool_full(be)
    # batches of several sizes ran, some padded up to their bucket
    graphs = {rows for kind, rows in eng.backend._graphs if kind == "batch"}
    assert len(graphs) >= 2 and max(sizes) >= 5, (graphs, sizes)


def test_the_next_step_in_flight_while_tokens_are_handled_changes_nothing(engine):
    """The server's order on a GPU (runtime/server/batching.py): a step's tokens fed, the
    next step submitted, then the ended sequences released while it runs (one of them fed
    past its end, as a stop string leaves it): each gives what it gives alone and every
    block comes back once the step in flight is collected."""
    eng, policy = engine
    picks = (0, 2, 5, 7)
    want = {i: alone(eng, i, PROMPTS, NEW) for i in picks}
    be = BatchEngine(eng, max_batch=4, prefill_chunk=8)
    got = run_overlapped(be, picks, NEW, PROMPTS, fed_past=(2,))
    for i in picks:
        assert_like_alone(got[i], want[i], policy)
    assert_pool_full(be)


def test_steps_ahead_fed_on_the_device_give_the_lone_tokens(engine):
    """The server's all-greedy order on a GPU: the next step queued before a step is
    collected, its decode rows' ids copied on the device from that step's top-1 picks
    (cuMemcpy2DAsync), two steps in flight on events. Each sequence's tokens are its lone
    greedy tokens (up to a near-tie of its lone logits), every block comes back."""
    eng, policy = engine
    picks = (0, 2, 5, 8)
    want = {i: alone(eng, i, PROMPTS, NEW) for i in picks}
    be = BatchEngine(eng, max_batch=4, prefill_chunk=8)
    assert be.pipelines
    got, ahead = run_pipelined(be, picks, NEW, PROMPTS)
    assert ahead >= max(NEW[i] for i in picks) - 2
    bar = BARS[policy]
    for i in picks:
        tokens, logits = want[i]
        for k, t in enumerate(got[i]):
            if t != tokens[k]:
                top2 = np.sort(logits[k])[-2:]
                assert top2[1] - top2[0] <= bar * np.abs(logits[k]).max(), (i, k)
                break
        else:
            assert got[i] == tokens
    assert_pool_full(be)


class _Letters:
    """Token ids as letters: Generation's detokenizer, no stop ids."""

    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


def test_greedy_generation_with_steps_queued_on_the_device_picks(engine):
    """`hipc generate`'s greedy loop on a GPU: each decode step queued behind the one in
    flight (CompiledEngine.submit_next), its token that step's pick copied on the device.
    The tokens are a forward() loop's argmaxes of the same decode graph (the same inputs:
    equal, bit for bit); a stop token leaves a step queued past it, dropped, and the engine
    computes the same after."""
    from hipc.runtime.generate import Generation, GenerationRequest

    eng, _ = engine
    assert eng.can_submit_next
    prompt, n = PROMPTS[1], 12
    want, logits = [], eng.forward(prompt, 0)
    for i in range(n):
        want.append(int(np.argmax(logits)))
        logits = eng.forward([want[-1]], len(prompt) + i)
    queued = []
    real_next = eng.submit_next
    eng.submit_next = lambda start: queued.append(start) or real_next(start)
    try:
        gen = Generation(eng, _Letters(), GenerationRequest(tuple(prompt), n, ignore_eos=True))
        "".join(gen)
        assert gen.result.token_ids == want
        assert queued == list(range(len(prompt) + 1, len(prompt) + n - 1))
        # the first token not seen before stops the sequence there (a tiny model's greedy
        # tokens may repeat one id: then there is none, and nothing to stop on)
        for stop in (k for k in range(1, n) if want[k] not in want[:k]):
            req = GenerationRequest(tuple(prompt), n, ignore_eos=True, stop_token_ids=(want[stop],))
            gen = Generation(eng, _Letters(), req)
            "".join(gen)
            assert gen.result.token_ids == want[:stop] and gen.result.finish_reason == "stop"
            break
    finally:
        del eng.submit_next
    again = eng.forward(prompt, 0)
    assert int(np.argmax(again)) == want[0]


def test_sampled_generation_draws_its_tokens_on_the_device(engine):
    """A generation at a temperature alone on a GPU (`hipc generate --temperature`): each
    decode token drawn by the pick kernel (Decoding.draw: u from the sequence's generator),
    the next step queued ahead; its tokens are those the host sampler draws from the same
    seed over the same decode graph's logits (but where a u lies within float32 rounding of
    a boundary: none expected in 24 tokens), and differ from the greedy ones."""
    from hipc.runtime.generate import Generation, GenerationRequest
    from hipc.runtime.sampler import Sampler, SamplingParams

    eng, _ = engine
    assert eng.can_draw
    prompt, n = PROMPTS[2], 24
    sampling = SamplingParams(temperature=1.3, seed=11)
    queued = []
    real_next = eng.submit_next
    eng.submit_next = lambda start, **kw: queued.append(kw) or real_next(start, **kw)
    try:
        gen = Generation(eng, _Letters(), GenerationRequest(tuple(prompt), n, sampling,
                                                          ignore_eos=True))  # fmt: skip
        "".join(gen)
    finally:
        del eng.submit_next
    assert len(queued) == n - 2 and all(kw["draw"][0] > 0 for kw in queued)
    sampler, want = Sampler(sampling), []
    logits = eng.forward(prompt, 0)
    greedy = []
    for i in range(n):
        want.append(sampler(logits))
        greedy.append(int(np.argmax(logits)))
        logits = eng.forward([want[-1]], len(prompt) + i)
    assert gen.result.token_ids == want
    assert want != greedy


def test_many_decode_rows_pad_up_to_the_bucket(engine):
    """12 sequences decoding together: the 16-row bucket graph with 4 padding rows."""
    eng, policy = engine
    prompts = [[7 + i, 100 + 3 * i, 200 - i] for i in range(12)]
    new = [6] * 12
    want = {i: alone(eng, i, prompts, new) for i in (0, 5, 11)}
    be = BatchEngine(eng, max_batch=STEP)
    got = run(be, [0] * 12, new, prompts)
    for i in want:
        assert_like_alone(got[i], want[i], policy)
    assert ("batch", 16) in eng.backend._graphs
    assert_pool_full(be)


def test_cancelling_mid_stream_frees_the_blocks(engine):
    eng, _ = engine
    before = alone(eng, 2, PROMPTS, NEW)
    be = BatchEngine(eng, max_batch=8, prefill_chunk=8)
    total = be.pool.n_blocks
    for round_ in range(3):

        def leave(i, step, round_=round_):
            return step >= 1 + (i + round_) % 4

        got = run(be, [0, 0, 1, 1, 2, 3, 0, 0, 1], [30] * len(PROMPTS), PROMPTS, leave=leave)
        assert len(got) == len(PROMPTS)
        assert_pool_full(be)
    assert be.pool.n_blocks == total
    # the engine still computes what it did before the cancellations (the same kernels)
    after = alone(eng, 2, PROMPTS, NEW)
    assert after[0] == before[0]
    assert rel_err(np.stack(after[1]), np.stack(before[1])) <= 1e-6


def test_a_prefix_cache_hit_gives_what_a_miss_gives(engine):
    """The second run of a prompt takes its full blocks from the first's (prefix caching) and
    computes only the rest: the same chunks of the same rows, so the same logits."""
    eng, _ = engine
    be = BatchEngine(eng, max_batch=4)
    prompt = PROMPTS[5]  # 70 tokens: 4 full blocks to share
    miss = run(be, [0], [8], [prompt])[0]
    hits = be.pool.hit_tokens
    hit = run(be, [0], [8], [prompt])[0]
    assert be.pool.hit_tokens - hits == 64
    assert hit[0] == miss[0]
    assert rel_err(np.stack(hit[1]), np.stack(miss[1])) <= 1e-6
    assert_pool_full(be)


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_step_top_picks_what_the_logits_rank_first(engine, rows):
    """step_top on the device (the plan's top-k kernel) against the same step's logits: the
    wanted rows' 5 largest ids and values, and each row's log-sum-exp, as NumPy ranks them
    (runtime/topk.py's order); k = 1 (greedy) too. A batch step (one row per sequence) and a
    decode step of one row."""
    from hipc.runtime.topk import top_of_logits

    eng, _ = engine
    b = eng.backend
    assert b.max_top_k == 64
    per = b.kv_table
    tables = (np.arange(rows * per, dtype=np.int32).reshape(rows, per)) % b.kv_blocks
    ids = (np.arange(rows) * 37 + 11) % 512
    pos = 3 + np.arange(rows, dtype=np.int32)
    seq = np.arange(rows, dtype=np.int32)
    out_rows = np.arange(rows)
    logits = b.step(ids, pos, seq, tables, out_rows).copy()
    for k in (1, 5):
        want = top_of_logits(logits, k)
        got_ids, got_logits, lse = b.step_top(ids, pos, seq, tables, out_rows, k, logsumexp=True)
        np.testing.assert_array_equal(got_ids, want.ids)
        np.testing.assert_array_equal(got_logits, want.logits)
        np.testing.assert_allclose(lse, want.logsumexp, rtol=1e-5)
