"""Prefill reuse follows the plan's state kinds (on the CPU target).

A position-indexed KV cache may keep a prompt for the next request with the same prompt; a
recurrent state may not (it holds only the state after the last token), so with one the
prefill runs again after reset() zeroes it. Either way every result equals a fresh engine's.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from hipc.runtime.engine import load_engine
from hipc.runtime.server.runner import EngineSlot

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11, 64, 8, 120, 33]
SHARED_PREFIX = [*PROMPT[:8], 77, 1, 300]
STEPS = 6


def greedy(engine_like, prompt: list[int]) -> tuple[list[np.ndarray], list[int]]:
    """Prefill, then STEPS greedy decode steps: every step's logits and the tokens."""
    logits = [np.array(engine_like.forward(prompt, 0), copy=True)]
    tokens = []
    for i in range(STEPS):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(np.array(engine_like.forward([tokens[-1]], len(prompt) + i), copy=True))
    return logits, tokens


def fresh(path, prompt):
    engine = load_engine(path, target="cpu", threads=1)
    try:
        return greedy(engine, prompt)
    finally:
        engine.close()


class Counting:
    """The engine, counting prefills (forward at position 0)."""

    def __init__(self, engine) -> None:
        self.engine, self.prefills = engine, 0
        self.vocab_size, self.max_context = engine.vocab_size, engine.max_context

    @property
    def prefix_reuse(self) -> bool:
        return self.engine.prefix_reuse

    def reset(self) -> None:
        self.engine.reset()

    def forward(self, tokens, start):
        self.prefills += start == 0
        return self.engine.forward(tokens, start)


def assert_same(run, want):
    (got_logits, got_tokens), (want_logits, want_tokens) = run, want
    assert got_tokens == want_tokens
    for g, w in zip(got_logits, want_logits, strict=True):
        np.testing.assert_array_equal(g, w)


def check_requests(path, expect_prefills: int):
    engine = Counting(load_engine(path, target="cpu", threads=1))
    slot = EngineSlot(engine, engine.max_context)
    try:
        first = greedy(slot, PROMPT)
        again = greedy(slot, PROMPT)  # the same prompt: reused where the states allow it
        shared = greedy(slot, SHARED_PREFIX)  # a shared prefix only: always prefilled
    finally:
        engine.engine.close()
    want = fresh(path, PROMPT)
    assert_same(first, want)
    assert_same(again, want)
    assert_same(shared, fresh(path, SHARED_PREFIX))
    assert engine.prefills == expect_prefills


def test_kv_states_reuse_an_identical_prompt(tiny_artifact):
    engine = load_engine(tiny_artifact, target="cpu", threads=1)
    assert engine.prefix_reuse and {s.kind for s in engine.artifact.states} == {"kv"}
    engine.close()
    check_requests(tiny_artifact, expect_prefills=2)


@pytest.fixture(scope="module")
def recurrent_artifact(tiny_artifact, tmp_path_factory):
    """The tiny artifact with one more state, a recurrent one (no kernel touches it: it shows
    the rules the runtime applies to the kind)."""
    path = tmp_path_factory.mktemp("recurrent") / "tiny.hipc"
    shutil.copytree(tiny_artifact, path)
    plan = json.loads((path / "plan.json").read_text())
    plan["states"].append({"name": "l0.conv", "kind": "recurrent", "dtype": "float32",
                           "shape": [3, 8]})  # fmt: skip
    (path / "plan.json").write_text(json.dumps(plan))
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "plan.json").read_bytes()
    manifest["files"]["plan.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_a_recurrent_state_is_never_reused_and_reset_zeroes_it(recurrent_artifact):
    engine = load_engine(recurrent_artifact, target="cpu", threads=1)
    try:
        assert not engine.prefix_reuse
        conv, kv = engine.backend.kv[-1], engine.backend.kv[0]
        assert conv.shape == (1, 3, 8)  # a slot per sequence the pool holds, not per position
        engine.forward(PROMPT, 0)
        conv.fill(1.0)
        kv_before = kv.copy()
        engine.reset()
        assert not conv.any()  # zeroed for the next sequence
        np.testing.assert_array_equal(kv, kv_before)  # positions are rewritten before reads
    finally:
        engine.close()
    check_requests(recurrent_artifact, expect_prefills=3)
