"""Token sampling: penalties, then temperature, top-k, top-p, min-p, then a draw.

temperature 0 is greedy (argmax after penalties). Same seed + same inputs = same
tokens: every draw comes from the sampler's own numpy Generator.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hipc.runtime.errors import HipcError


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def penalize(
        self, logits: np.ndarray, prompt: Sequence[int], output: Sequence[int]
    ) -> np.ndarray:
        p = self.params
        logits = logits.astype(np.float64, copy=True)
        if p.repetition_penalty != 1.0 and (prompt or output):
            seen = np.unique(np.fromiter([*prompt, *output], dtype=np.int64))
            vals = logits[seen]
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
        z = logits / max(p.temperature, 1e-6)
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z < kth, -np.inf, z)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one)
            cut = int(np.searchsorted(cum, p.top_p)) + 1
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[:cut]] = True
            probs = np.where(mask, probs, 0.0)
        if p.min_p > 0:
            probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        return probs / probs.sum()

    def __call__(
        self, logits: np.ndarray, prompt: Sequence[int] = (), output: Sequence[int] = ()
    ) -> int:
        logits = self.penalize(logits, prompt, output)
        if self.params.greedy:
            return int(np.argmax(logits))
        probs = self.probabilities(logits)
        return int(self.rng.choice(probs.size, p=probs))
