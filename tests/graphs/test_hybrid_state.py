"""Per-sequence state of the hybrids in the reference engine: recurrent states (conv window,
delta-rule matrix) reset per sequence and reused only from snapshots, KV caches by prefix.

Each sequence runs on one engine that keeps snapshots and is compared with a fresh engine
that never reuses anything: the same prompt twice, a prompt sharing a prefix, a next turn
that starts with the previous prompt and its answer (a snapshot taken while decoding), an
unrelated prompt after all of them.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.base.errors import HipcError
from hipc.compiler.reference.engine import ReferenceEngine
from hipc.graphs import load_model

from support import make_hybrid_hf, rel_err

N = 12  # greedy tokens per sequence


def _run(engine, prompt, n=N):
    """(greedy tokens, the logits each step saw) from a new sequence."""
    engine.reset()
    logits = [engine.forward(prompt, 0)]
    out = []
    for i in range(n):
        out.append(int(logits[-1].argmax()))
        logits.append(engine.forward([out[-1]], len(prompt) + i))
    return out, np.stack(logits)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def engines(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_hybrid_hf(request.param, folder, seed=3)
    model = load_model(folder)
    return ReferenceEngine(model, 256), ReferenceEngine(model, 256, max_snapshots=0)


@pytest.mark.oracle
def test_prefix_reuse_equals_fresh_runs(engines):
    engine, fresh = engines
    rng = np.random.default_rng(0)
    vocab = engine.vocab_size
    a = rng.integers(0, vocab, 120).tolist()

    first = _run(engine, a)
    assert engine.reused == 0
    want = _run(fresh, a)
    assert first[0] == want[0] and np.array_equal(first[1], want[1])

    # the same prompt again: from the snapshot at its end, not re-run
    again = _run(engine, a)
    assert engine.reused == len(a)
    assert again[0] == want[0] and np.array_equal(again[1], want[1])

    # sharing 100 tokens: from the snapshot at position 64, the same pieces as a fresh run
    b = a[:100] + rng.integers(0, vocab, 30).tolist()
    got, want = _run(engine, b), _run(fresh, b)
    assert engine.reused == 64
    assert got[0] == want[0] and np.array_equal(got[1], want[1])

    # a next turn: the prompt, its answer and more; decoding crossed position 128, where a
    # snapshot was taken (its K/V came from decode steps: equal up to float rounding)
    engine_answer = _run(engine, a, n=N)[0]
    c = a + engine_answer + rng.integers(0, vocab, 9).tolist()
    got, want = _run(engine, c), _run(fresh, c)
    assert engine.reused == 128
    assert got[0] == want[0] and rel_err(got[1], want[1]) <= 1e-5

    # nothing shared: reset zeroed the recurrent states, nothing is reused
    d = rng.integers(0, vocab, 70).tolist()
    while d[0] in (a[0], c[0]):
        d[0] = int(rng.integers(0, vocab))
    got, want = _run(engine, d), _run(fresh, d)
    assert engine.reused == 0
    assert got[0] == want[0] and np.array_equal(got[1], want[1])


@pytest.mark.oracle
def test_recurrent_state_cannot_jump(engines):
    """A recurrent state holds one position: continuing elsewhere, where no snapshot was
    kept, is refused in one line instead of computing from the wrong state."""
    engine, _ = engines
    prompt = np.random.default_rng(1).integers(0, engine.vocab_size, 20).tolist()
    engine.reset()
    engine.forward(prompt, 0)
    with pytest.raises(HipcError, match="cannot continue at position 10"):
        engine.forward([1], 10)
    # where a snapshot was kept (the prompt's end) it can: as a decode step would
    engine.forward([1], 20)
    assert engine.forward([2], 20).shape == (engine.vocab_size,)
