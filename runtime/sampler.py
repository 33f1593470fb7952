"""Token sampling: logit bias and penalties, then temperature, top-k, top-p, min-p, then a draw.

temperature 0 is greedy (argmax after bias and penalties). Same seed + same inputs = same
tokens: every draw comes from the sampler's own numpy Generator. `token_logprobs` reports
what the model itself said about a token (log-softmax of the raw logits), whatever the
sampling settings.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hipc.base.errors import HipcError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt and output
    presence_penalty: float = 0.0  # OpenAI-style, over output
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    def __post_init__(self) -> None:
        checks = [
            ("temperature", self.temperature >= 0),
            ("top_k", self.top_k >= 0),
            ("top_p", 0 < self.top_p <= 1),
            ("min_p", 0 <= self.min_p <= 1),
            ("repetition_penalty", self.repetition_penalty > 0),
            ("presence_penalty", -2 <= self.presence_penalty <= 2),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2),
        ]
        for name, ok in checks:
            if not ok:
                raise HipcError(f"{name}={getattr(self, name)!r} is out of range")
        if self.seed is not None and self.seed < 0:
            raise HipcError(f"seed={self.seed!r} is out of range (a seed is non-negative)")
        if any(token < 0 for token, _ in self.logit_bias):
            raise HipcError("logit_bias: token ids are non-negative")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.moves_logits = bool(
            params.logit_bias
            or params.repetition_penalty != 1.0
            or params.presence_penalty
            or params.frequency_penalty
        )

    def penalize(
        self, logits: np.ndarray, prompt: Sequence[int], output: Sequence[int]
    ) -> np.ndarray:
        p = self.params
        if not self.moves_logits:
            return logits
        logits = logits.astype(np.float64, copy=True)
        if p.logit_bias:
            ids = np.fromiter((t for t, _ in p.logit_bias), dtype=np.int64)
            if ids.max() >= logits.size:
                raise HipcError(
                    f"logit_bias: token id {int(ids.max())} is out of vocabulary (size {logits.size})"
                )
            np.add.at(logits, ids, np.fromiter((b for _, b in p.logit_bias), dtype=np.float64))
        if p.repetition_penalty != 1.0 and (prompt or output):
            seen = np.unique(np.fromiter([*prompt, *output], dtype=np.int64))
            vals = logits[seen]
            with np.errstate(over="ignore"):
                logits[seen] = np.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
        if (p.presence_penalty or p.frequency_penalty) and output:
            counts = Counter(output)
            ids = np.fromiter(counts.keys(), dtype=np.int64)
            n = np.fromiter(counts.values(), dtype=np.float64)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * n
        return logits

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a draw is made from, after temperature and truncation."""
        p = self.params
        # NOTE: float32 logits stay float32 (exp over a 50k vocabulary is several times
        # faster); probabilities are relative to the top one, so float32's 24 bits move a
        # draw only when it lands within ~1e-7 of a boundary between two tokens
        if logits.dtype != np.float64:
            logits = logits.astype(np.float32, copy=False)
        with np.errstate(over="ignore"):
            z = logits / logits.dtype.type(max(p.temperature, 1e-6))
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z < kth, -np.inf, z)
        top = z.max()
        # NOTE: a tiny repetition_penalty can push logits past float64; the limit of
        # softmax is then uniform over the infinite ones (exp(inf - inf) would be NaN)
        probs = (z == top).astype(z.dtype) if np.isposinf(top) else np.exp(z - top)
        probs /= probs.sum()
        if p.top_p < 1.0:
            probs = np.where(nucleus(probs, p.top_p), probs, 0.0)
        if p.min_p > 0:
            probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        return probs / probs.sum()

    def __call__(
        self,
        logits: np.ndarray,
        prompt: Sequence[int] = (),
        output: Sequence[int] = (),
        allowed: np.ndarray | None = None,
    ) -> int:
        """A token id; `allowed` (a boolean mask, from a grammar) excludes every other
        token before anything else sees the logits."""
        p = self.params
        if allowed is not None:
            logits = np.where(allowed, logits, -np.inf)
        if p.greedy and not self.moves_logits:
            # nothing moves a logit: skip penalize's float64 copy (a tenth of a small
            # model's GPU decode step on the host)
            return int(np.argmax(logits))
        logits = self.penalize(logits, prompt, output)
        if allowed is not None and self.moves_logits:
            # a positive logit_bias must not bring a masked token back
            logits = np.where(allowed, logits, -np.inf)
        if p.greedy:
            return int(np.argmax(logits))
        if p.top_p < 1.0 or p.top_k:
            token = self._draw_truncated(logits)
            if token is not None:
                return token
        return self.draw(self.probabilities(logits))

    def _draw_truncated(self, logits: np.ndarray) -> int | None:
        """`draw(probabilities(logits))` for top-k / top-p, touching the whole
        vocabulary only in the passes the result depends on (scale, exp, and the float32
        sums whose rounding decides the cut and the draw): the truncation, the sort and the
        cumulative sum run over the few likely tokens. None where they cannot be found
        that way (a flat distribution, infinite logits): the caller takes the full path.

        The distribution is the full path's bit for bit; so is the token, but where the draw's
        uniform number lies within float64 rounding (~1e-16) of a boundary between two tokens:
        the compacted cumulative sum runs in one pass, the full vocabulary's in blocks
        (inverse_cdf). NOTE: at a 128k vocabulary this is ~0.3 ms a token against ~1.1 ms."""
        p = self.params
        if logits.dtype != np.float64:
            logits = logits.astype(np.float32, copy=False)
        with np.errstate(over="ignore"):
            z = logits / logits.dtype.type(max(p.temperature, 1e-6))
        n = z.size
        zmax = z.max()
        truncating_k = 0 < p.top_k < n
        if not np.isfinite(zmax) or not (truncating_k or p.top_p < 1.0):
            return None  # (a top_k of the whole vocabulary truncates nothing)
        if truncating_k:
            # the k-th largest is found among the tokens near the top (a superset of the k
            # largest gives the same k-th value); then e = exp(z - top) is zero below it
            for gap in (4, 8, 16, 32):
                near = np.flatnonzero(z >= zmax - gap)
                if near.size >= p.top_k:
                    break
            else:
                return None
            kth = np.partition(z[near], -p.top_k)[-p.top_k]
            cand = near[z[near] >= kth]
            e = np.zeros_like(z)
            e[cand] = np.exp(z[cand] - zmax)
            probs_sum = e.sum()
        else:
            e = z
            np.subtract(e, zmax, out=e)
            np.exp(e, out=e)
            probs_sum = e.sum()
            cand = None
        if p.top_p < 1.0:
            for thr in (1e-4, 1e-8):
                c = np.flatnonzero(e >= thr) if cand is None else cand[e[cand] >= thr]
                pc = e[c] / probs_sum
                order = c[np.lexsort((c, -pc))]
                cut = int(np.searchsorted(np.cumsum(e[order] / probs_sum), p.top_p)) + 1
                # the prefix ends before the smallest candidate value: every other token is
                # no more likely, so none of them (nor a tie) belongs in it
                if cut <= np.count_nonzero(pc > pc.min()):
                    break
            else:
                return None
            keep = np.sort(order[:cut])
        else:
            keep = cand
        vals = e[keep] / probs_sum
        if p.min_p > 0:
            vals = np.where(vals >= p.min_p * vals.max(), vals, vals.dtype.type(0))
        # the final normalisation's sum is over the whole masked vocabulary (float32 pairwise
        # sums round by position): rebuilt to round the same way
        full = np.zeros(n, vals.dtype)
        full[keep] = vals
        vals = vals / full.sum()
        return int(keep[inverse_cdf(vals, self.rng.random())])

    def draw(self, probs: np.ndarray) -> int:
        """One token from `probs`: what Generator.choice(n, p=probs) draws (the same one
        uniform number against the cumulative sum, inverse_cdf), without its validation
        passes over the vocabulary."""
        return inverse_cdf(probs, self.rng.random())


# NOTE: one running float64 sum over a 128k vocabulary costs ~1 ms a token (each add waits on
# the last): the draw sums blocks of this many weights first, then runs through one block
DRAW_BLOCK = 2048


def inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The first index whose cumulative weight, over the total, passes u (in [0, 1)): the
    draw of Generator.choice(n, p=weights / total), whose cumulative sum is float64. Past
    DRAW_BLOCK weights the sum comes in two levels (float64 sums of blocks, then the running
    sum inside the block u falls in), so the token is choice's but where u lies within
    float64 rounding (~1e-16) of a boundary between two tokens."""
    n = weights.size
    if n <= DRAW_BLOCK:
        cdf = np.cumsum(weights, dtype=np.float64)
        cdf /= cdf[-1]
        return int(np.searchsorted(cdf, u, side="right"))
    full = n // DRAW_BLOCK * DRAW_BLOCK
    sums = weights[:full].reshape(-1, DRAW_BLOCK).sum(axis=1, dtype=np.float64)
    if full < n:
        sums = np.append(sums, weights[full:].sum(dtype=np.float64))
    ends = np.cumsum(sums)
    total = ends[-1]
    b = int(np.searchsorted(ends / total, u, side="right"))  # < len(ends): the last is 1
    lo = b * DRAW_BLOCK
    block = weights[lo : lo + DRAW_BLOCK]
    cdf = np.cumsum(block, dtype=np.float64)
    if b:
        cdf += ends[b - 1]
    cdf /= total
    i = int(np.searchsorted(cdf, u, side="right"))
    if i == block.size:  # the block's running sum rounded below its pairwise sum
        i = int(np.flatnonzero(block)[-1])
    return lo + i


def nucleus(probs: np.ndarray, top_p: float, first: int = 256) -> np.ndarray:
    """The mask of the smallest prefix of tokens, most likely first (ties by id), whose mass
    reaches top_p (always at least one token).

    NOTE: sorting a 50k vocabulary costs ~4 ms a token; the prefix is nearly always among
    the few hundred likeliest, so those are partitioned out and sorted first. The prefix is
    decided inside them when it ends before their smallest probability (candidates tied
    with it may not be the lowest ids); else the whole vocabulary is sorted (a flat
    distribution: ~0.3 ms more than sorting at once)."""
    n = probs.size
    k = min(first, n)
    while True:
        if k >= n:
            order = np.argsort(-probs, kind="stable")
            cut = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
            break
        cand = np.argpartition(-probs, k - 1)[:k]
        pc = probs[cand]
        order = cand[np.lexsort((cand, -pc))]
        cut = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
        if cut <= np.count_nonzero(pc > pc.min()):
            break
        k = n  # a wider partition plus its sort costs about as much as the full sort
    mask = np.zeros(n, dtype=bool)
    mask[order[:cut]] = True
    return mask


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64, copy=False)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def token_logprobs(
    logits: np.ndarray, token: int, top_n: int = 0
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The model's log-probability of `token` and its `top_n` most likely tokens, best first."""
    lp = log_softmax(logits)
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        n = min(top_n, lp.size)
        best = np.argpartition(-lp, n - 1)[:n]
        best = best[np.argsort(-lp[best], kind="stable")]
        top = tuple((int(i), float(lp[i])) for i in best)
    return float(lp[token]), top
