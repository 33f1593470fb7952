from __future__ import annotations

import numpy as np
import pytest

from hipc.base.errors import HipcError
from hipc.runtime.sampler import Sampler, SamplingParams

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 0.0, 2.9])


def test_greedy_is_argmax():
    assert Sampler(SamplingParams())(LOGITS) == 1


def test_same_seed_same_tokens():
    p = SamplingParams(temperature=1.0, seed=7)
    s1, s2 = Sampler(p), Sampler(p)
    assert [s1(LOGITS) for _ in range(50)] == [s2(LOGITS) for _ in range(50)]


def test_temperature_one_follows_softmax():
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    draws = np.bincount([s(LOGITS) for _ in range(20000)], minlength=6) / 20000
    want = np.exp(LOGITS - LOGITS.max())
    want /= want.sum()
    assert np.max(np.abs(draws - want)) < 0.015


def test_top_k_keeps_k_best():
    probs = Sampler(SamplingParams(temperature=1.0, top_k=2)).probabilities(LOGITS)
    assert set(np.flatnonzero(probs)) == {1, 5}


def test_top_p_keeps_smallest_prefix():
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.5))
    probs = s.probabilities(LOGITS)
    full = np.exp(LOGITS - LOGITS.max())
    full /= full.sum()
    kept = np.flatnonzero(probs)
    order = np.argsort(-full)
    # the kept set is a prefix of the sorted order, reaching 0.5 mass only at its end
    assert list(kept) == sorted(order[: len(kept)])
    assert full[order[: len(kept)]].sum() >= 0.5 > full[order[: len(kept) - 1]].sum()


def test_min_p_drops_unlikely():
    probs = Sampler(SamplingParams(temperature=1.0, min_p=0.5)).probabilities(LOGITS)
    assert set(np.flatnonzero(probs)) == {1, 2, 5}


def test_repetition_penalty_demotes_seen_tokens():
    s = Sampler(SamplingParams(repetition_penalty=2.0))
    assert s(LOGITS, prompt=[1], output=[]) == 5
    out = s.penalize(LOGITS, [3], [])
    assert out[3] == pytest.approx(-2.0)  # negative logits are multiplied


def test_presence_and_frequency_penalties():
    s = Sampler(SamplingParams(presence_penalty=0.2, frequency_penalty=0.3))
    out = s.penalize(LOGITS, [], [1, 1, 5])
    assert out[1] == pytest.approx(3.0 - 0.2 - 0.6)
    assert out[5] == pytest.approx(2.9 - 0.2 - 0.3)
    assert out[2] == LOGITS[2]


@pytest.mark.parametrize(
    "field,value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("min_p", 2), ("top_k", -3)]
)
def test_out_of_range_is_an_error(field, value):
    with pytest.raises(HipcError, match=field):
        SamplingParams(**{field: value})


def test_allowed_mask_excludes_every_other_token():
    """A grammar's mask: whatever the settings, only allowed tokens come out, and a
    positive logit_bias cannot bring a masked one back."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(300).astype(np.float32)
    allowed = np.zeros(300, dtype=bool)
    allowed[rng.choice(300, 7, replace=False)] = True
    best_masked = int(np.argmax(np.where(allowed, -np.inf, logits)))
    settings = [
        SamplingParams(),
        SamplingParams(logit_bias=((best_masked, 100.0),)),
        SamplingParams(temperature=1.5, top_k=3, seed=1),
        SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1.3, seed=2),
        SamplingParams(temperature=2.0, min_p=0.01, logit_bias=((best_masked, 100.0),), seed=3),
    ]
    for params in settings:
        s = Sampler(params)
        picks = {s(logits, [1, 2], [3], allowed) for _ in range(50)}
        assert picks <= set(np.flatnonzero(allowed).tolist()), params
    assert Sampler(SamplingParams())(logits, allowed=allowed) == int(
        np.flatnonzero(allowed)[np.argmax(logits[allowed])]
    )


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_draws_are_numpys_choice_for_the_same_seed(dtype):
    """The sampler's draw is Generator.choice's (one uniform against the cumulative sum):
    a seed gives the tokens numpy's own choice gives from the same distribution."""
    rng = np.random.default_rng(11)
    params = SamplingParams(temperature=0.7, top_k=500, min_p=0.001, seed=42)
    s = Sampler(params)
    reference = np.random.default_rng(42)
    for _ in range(200):
        logits = (3 * rng.standard_normal(4096)).astype(dtype)
        z = logits.astype(np.float64) / 0.7
        kth = np.partition(z, -500)[-500]
        want = np.where(z < kth, 0.0, np.exp(z - z.max()))
        want = np.where(want >= 0.001 * want.max(), want, 0.0)
        want /= want.sum()
        got = s(logits)
        assert got == reference.choice(want.size, p=want)


@pytest.mark.parametrize("n", [1, 7, 2048, 2049, 50_000, 128_256])
def test_inverse_cdf_is_numpys_choice(n):
    """inverse_cdf (the draw; in blocks past DRAW_BLOCK weights) picks what Generator.choice
    picks for the same uniform number: peaked, flat and sparse weights (whole blocks of
    zeros, zeros at both ends), float32 and float64. u = 0 picks the first token with
    weight, u just below 1 one with weight."""
    from hipc.runtime.sampler import inverse_cdf

    rng = np.random.default_rng(n)
    for trial in range(40):
        w = np.exp(rng.uniform(0.1, 8) * rng.standard_normal(n))
        if trial % 4 == 1:
            w[rng.random(n) < 0.95] = 0.0
        elif trial % 4 == 2:
            w[: n // 3] = 0.0
            w[-(n // 3) :] = 0.0
        if not w.any():
            w[rng.integers(n)] = 1.0
        w = w.astype(np.float32 if trial % 2 else np.float64)
        seed = int(rng.integers(1 << 31))
        want = np.random.default_rng(seed).choice(n, p=w / w.sum(dtype=np.float64))
        assert inverse_cdf(w, np.random.default_rng(seed).random()) == want, f"trial {trial}"
        assert inverse_cdf(w, 0.0) == np.flatnonzero(w)[0]
        # (where choice's running sum and the blocks' round apart, a token with weight all the same)
        assert w[inverse_cdf(w, np.nextafter(1.0, 0.0))] > 0


def test_nucleus_is_the_sorted_prefix():
    """top_p's mask against a full stable sort: peaked and flat distributions, ties at the
    cut (equal probabilities on both sides of the candidate boundary), top_p near 1."""
    from hipc.runtime.sampler import nucleus

    rng = np.random.default_rng(5)
    cases = []
    for scale in (0.5, 3.0, 8.0):
        cases.append(np.exp(scale * rng.standard_normal(49152)))
    tied = np.full(5000, 1.0)
    tied[:10] = 50.0
    cases.append(tied)  # the cut falls inside thousands of equal probabilities
    cases.append(np.r_[np.zeros(300), np.full(300, 2.0), np.ones(1000)])
    for probs in cases:
        probs = (probs / probs.sum()).astype(np.float32)
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        for top_p in (0.01, 0.3, 0.9, 0.999, 0.99999):
            want = np.zeros(probs.size, bool)
            want[order[: int(np.searchsorted(cum, top_p)) + 1]] = True
            np.testing.assert_array_equal(nucleus(probs, top_p), want, err_msg=f"top_p={top_p}")


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.8, top_p=0.95),
        dict(temperature=1.3, top_p=0.5, min_p=0.05),
        dict(temperature=0.7, top_k=40),
        dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.01),
        dict(temperature=0.7, top_k=2**31 - 2),  # past the vocabulary: no truncation at all
    ],
    ids=["top_p", "top_p+min_p", "top_k", "all", "top_k-past-vocab"],
)
def test_truncated_draws_over_a_large_vocabulary_are_numpys_choice(params):
    """top-k / top-p at a 32k vocabulary (the sampler draws from the likely tokens only,
    runtime/sampler.py's _draw_truncated): each token is what the full-vocabulary path
    (probabilities() then draw()) draws, for peaked, flat and tied logits (the two differ only
    where the uniform number lies within float64 rounding of a boundary); for
    the peaked ones (a trained model's) also what numpy's choice draws, for the same seed,
    from the distribution computed here in float64 over the whole vocabulary. (Over a flat
    or tied nucleus of thousands of tokens float32's running sums put a boundary ~1e-6
    away from float64's, and a draw now and then lands in between.)"""
    rng = np.random.default_rng(3)
    v = 32768
    s = Sampler(SamplingParams(seed=9, **params))
    full = Sampler(SamplingParams(seed=9, **params))
    reference = np.random.default_rng(9)
    for i in range(60):
        logits = rng.standard_normal(v)
        if i % 3 == 0:
            logits[rng.integers(0, v, 8)] += 12  # peaked, as a trained model's
        elif i % 3 == 1:
            logits = np.round(2 * logits)  # ties at every cut
        logits = logits.astype(np.float32)
        z = logits.astype(np.float64) / params["temperature"]
        want = np.exp(z - z.max())
        if params.get("top_k", 0) < v and params.get("top_k"):
            kth = np.partition(z, -params["top_k"])[-params["top_k"]]
            want[z < kth] = 0.0
        want /= want.sum()
        if params.get("top_p", 1.0) < 1.0:
            order = np.argsort(-want, kind="stable")
            cut = int(np.searchsorted(np.cumsum(want[order]), params["top_p"])) + 1
            mask = np.zeros(v, bool)
            mask[order[:cut]] = True
            want = np.where(mask, want, 0.0)
        if params.get("min_p"):
            want = np.where(want >= params["min_p"] * want.max(), want, 0.0)
        want /= want.sum()
        got = s(logits)
        assert got == full.draw(full.probabilities(logits)), f"draw {i}"
        if i % 3 == 0:
            assert got == reference.choice(v, p=want), f"draw {i}"
        else:
            reference.random()  # the same stream: one uniform number a draw
