"""The k largest logits of each row, as a backend's step_top returns them.

GPU backends compute them on the device (templates/hip/topk.hip.j2) so that a step copies
back rows x k values instead of rows x vocab logits; `top_of_logits` is the same selection on
the host, for backends and artifacts without that kernel (and the tests' reference).

A backend's `step_top(ids, pos, seq, tables, out_rows, k, logsumexp=False)` returns
(ids, logits) of TopK, or all three with logsumexp; its `max_top_k` is the largest k it picks
on the device (0: none, the caller asks step() for logits instead).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class TopK(NamedTuple):
    """Per wanted row of a step: the k largest logits, largest first."""

    ids: (
        np.ndarray
    )  # [rows, k] int32 token ids; of equal values the lower id first; -1 past the row
    logits: np.ndarray  # [rows, k] float32; -inf past a row shorter than k
    logsumexp: np.ndarray  # [rows] float32: log(sum(exp(row))); a logprob is logit - logsumexp


def logsumexp(m: np.ndarray, s: np.ndarray) -> np.ndarray:
    """log(sum exp) from a row's max m and sum of exp(v - m) (what the kernel returns)."""
    return (m.astype(np.float64) + np.log(s.astype(np.float64))).astype(np.float32)


def top_of_logits(logits: np.ndarray, k: int) -> TopK:
    """The k largest of each row of `logits` [rows, vocab], in the device kernel's order."""
    logits = np.asarray(logits, np.float32)
    rows, vocab = logits.shape
    kk = min(k, vocab)
    values = np.full((rows, k), -np.inf, np.float32)
    ids = np.full((rows, k), -1, np.int32)
    kth = np.partition(logits, vocab - kk, axis=1)[:, vocab - kk]
    for r in range(rows):
        row = logits[r]
        above = np.flatnonzero(row > kth[r])
        ties = np.flatnonzero(row == kth[r])[: kk - len(above)]
        pick = np.concatenate([above, ties])
        pick = pick[np.lexsort((pick, -row[pick]))]  # by value descending, then id
        values[r, :kk], ids[r, :kk] = row[pick], pick
    m = logits.max(axis=1)
    s = np.exp(logits.astype(np.float64) - m[:, None]).sum(axis=1)
    return TopK(ids, values, logsumexp(m, s))
