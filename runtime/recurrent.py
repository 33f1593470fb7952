"""Sequences over recurrent states (linear attention's conv windows and delta-rule matrices),
with prefix reuse through snapshots.

A recurrent state holds only the step the sequence is at, so a prefix is reusable only
from a copy taken at its end. A sequence runs in pieces ending at multiples of `interval`
positions and a copy of the recurrent states is kept at each such boundary (decoding crosses
them too: a next turn's prompt starts with this one's answer) and at a prompt's end, keyed
by the tokens before it, with that position's logits. A new prompt starts from the longest
kept prefix whose K/V positions the caches still hold (the same tokens are there),
restores that copy and runs only the rest. The pieces always end at the same absolute
positions, so a reused prompt runs the computations a fresh one does. KV caches need no
copy: positions below the prefix hold what those tokens wrote.

Used by the reference engine and by compiled engines whose backend can copy its states
(the CPU's arrays; a GPU's device-to-device into device buffers, its interval a whole step).
A backend's `snapshot()` may return None (no memory for a copy: none is kept there), and a
dropped snapshot is handed to its `release()` where it has one (a GPU reuses the buffer).
A step that continues the sequence and ends short of the next boundary needs no copy: the
engine may run it asynchronously (`continues`, then `ran`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from hipc.base.errors import HipcError

SNAPSHOT_INTERVAL = 64  # the delta rule's chunk: pieces of whole chunks
MAX_SNAPSHOTS = 16

# (tokens, start, all rows) -> logits [len(tokens) or 1, vocab]
Step = Callable[[list[int], int, bool], np.ndarray]


class RecurrentStates(Protocol):
    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> None: ...

    def reset_recurrent(self) -> None: ...


def release_snapshot(states: RecurrentStates, snapshot: Any) -> None:
    release = getattr(states, "release", None)
    if release is not None:
        release(snapshot)


class RecurrentSequence:
    def __init__(
        self,
        step: Step,
        states: RecurrentStates,
        max_context: int,
        interval: int = SNAPSHOT_INTERVAL,
        max_snapshots: int = MAX_SNAPSHOTS,
    ) -> None:
        self.step, self.states, self.max_context = step, states, max_context
        self.interval, self.max_snapshots = interval, max_snapshots
        # prefix tokens -> (recurrent states after them, logits of their last token)
        self.snapshots: OrderedDict[tuple[int, ...], tuple[Any, np.ndarray]] = OrderedDict()
        self._kv_tokens: list[int] = []  # the tokens whose K/V the caches hold, from 0
        self._pos = 0  # where the recurrent states are
        self.reused = 0  # positions the last prompt took from a snapshot

    def reset(self) -> None:
        # a KV cache is left as it is (attention reads only positions this sequence wrote,
        # and a reused prefix's are still valid); recurrent states start from zero
        self.states.reset_recurrent()
        self._pos = 0

    def forward(self, tokens: list[int], start: int) -> np.ndarray:
        """The last token's logits [vocab]."""
        if start == 0:
            reused = self._longest_prefix(tokens)
            if reused:
                states, last = self.snapshots[reused]
                self.snapshots.move_to_end(reused)
                self.states.restore(states)
                self._pos = self.reused = len(reused)
                if len(reused) == len(tokens):
                    return last.copy()
                return self._run(tokens[len(reused) :], len(reused), True, False)[-1]
            self.reused = 0
        self._seek(start)
        return self._run(tokens, start, start == 0, False)[-1]

    def logits(self, tokens: list[int], start: int) -> np.ndarray:
        """Every token's logits [len(tokens), vocab] (always computed: no reuse)."""
        self._seek(start)
        return self._run(tokens, start, start == 0, True)

    def continues(self, tokens: list[int], start: int) -> bool:
        """Whether a step of `tokens` at `start` just continues the sequence: the states are
        there, and it ends before the next snapshot boundary (nothing to copy around it)."""
        end = start + len(tokens)
        return 0 < start == self._pos and end // self.interval == start // self.interval

    def ran(self, tokens: list[int], start: int) -> None:
        """The step `continues` allowed ran (outside `forward`)."""
        self._kv_tokens[start:] = tokens
        self._pos = start + len(tokens)

    def _longest_prefix(self, tokens: list[int]) -> tuple[int, ...] | None:
        best = None
        for key in self.snapshots:
            n = len(key)
            if (
                n <= len(tokens)
                and (best is None or n > len(best))
                and list(key) == tokens[:n]
                and self._kv_tokens[:n] == tokens[:n]
            ):
                best = key
        return best

    def _seek(self, start: int) -> None:
        """Put the recurrent states at `start`: they are there, or a snapshot is."""
        if start == self._pos:
            if start == 0:
                self.states.reset_recurrent()
            return
        key = tuple(self._kv_tokens[:start])
        if len(key) == start and key in self.snapshots:
            self.states.restore(self.snapshots[key][0])
            self._pos = start
            return
        raise HipcError(
            f"recurrent state: cannot continue at position {start}; the sequence is at "
            f"position {self._pos} and no snapshot was kept at {start}"
        )

    def _run(self, tokens: list[int], start: int, keep_end: bool, all_rows: bool) -> np.ndarray:
        if start + len(tokens) > self.max_context:
            raise HipcError(
                f"context overflow: {start + len(tokens)} positions > max context "
                f"{self.max_context}"
            )
        every = self.interval
        out, pos, done = [], start, 0
        while done < len(tokens):
            end = min(start + len(tokens), (pos // every + 1) * every)
            piece = tokens[done : done + end - pos]
            rows = self.step(piece, pos, all_rows)
            out.append(rows)
            self._kv_tokens[pos:] = piece
            done, pos = done + len(piece), end
            self._pos = pos
            if pos % every == 0 or (keep_end and done == len(tokens)):
                self._keep(tuple(self._kv_tokens[:pos]), rows[-1])
        return np.concatenate(out) if all_rows else out[-1]

    def _keep(self, key: tuple[int, ...], last: np.ndarray) -> None:
        if self.max_snapshots <= 0:
            return
        snapshot = self.states.snapshot()
        if snapshot is None:
            return
        old = self.snapshots.pop(key, None)
        if old is not None:
            release_snapshot(self.states, old[0])
        self.snapshots[key] = (snapshot, np.array(last, copy=True))
        while len(self.snapshots) > self.max_snapshots:
            release_snapshot(self.states, self.snapshots.popitem(last=False)[1][0])
