"""The reference executor behind the generation-engine interface (`--reference`).

Models with recurrent states (linear attention's conv windows and delta-rule matrices)
reuse prefixes through snapshots: a prompt runs in pieces ending at multiples of
`snapshot_interval` positions, and a copy of the recurrent states is kept at each such
boundary (and at the prompt's end), keyed by the tokens before it. A new sequence starts
from the longest kept prefix of its prompt whose K/V positions the caches still hold
(the tokens there are the same), restores that copy and runs only the rest. Because the
pieces always end at the same absolute positions, a reused prompt runs exactly the
computations a fresh one does. KV caches need no copy: positions below the prefix are
what the same tokens wrote.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from hipc.base.errors import HipcError
from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import Model, build_graph

SNAPSHOT_INTERVAL = 64  # the delta rule's chunk: pieces of whole chunks
MAX_SNAPSHOTS = 16


class ReferenceEngine:
    def __init__(
        self,
        model: Model,
        max_ctx: int | None = None,
        dtype: str = "float32",
        kv_storage: str = "float32",
        quant: str | None = None,
        snapshot_interval: int = SNAPSHOT_INTERVAL,
        max_snapshots: int = MAX_SNAPSHOTS,
    ) -> None:
        from hipc.compiler.passes.quantize import quantize_weights

        self.model = model
        # --quant: the same quantized weights a compiled artifact holds (from the same store)
        self.graph = quantize_weights(build_graph(model, max_ctx), quant)
        self.executor = ReferenceExecutor(self.graph, dtype, kv_storage)
        self.max_context = self.executor.max_ctx
        self.vocab_size = model.config.vocab_size
        self._tokenizer = None
        self.executor.prepare()
        self.recurrent = bool(self.executor.recurrent_states)
        self.snapshot_interval = snapshot_interval
        self.max_snapshots = max_snapshots
        # prefix tokens -> (recurrent states after them, logits of their last token)
        self.snapshots: OrderedDict[tuple[int, ...], tuple[dict, np.ndarray]] = OrderedDict()
        self._kv_tokens: list[int] = []  # the tokens whose K/V the caches hold, from 0
        self._pos = 0  # where the recurrent states are
        self.reused = 0  # positions the last prompt took from a snapshot

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.model.source.tokenizer()
        return self._tokenizer

    def reset(self) -> None:
        if not self.recurrent:
            self.executor.reset()
            return
        # a KV cache is left as it is (attention reads only positions this sequence wrote,
        # and a reused prefix's are still valid); recurrent states start from zero
        self.executor.reset_recurrent()
        self._pos = 0

    def logits(self, tokens: Sequence[int], start: int) -> np.ndarray:
        if not self.recurrent:
            return self.executor.logits(list(tokens), start)
        self._seek(start)
        return self._run(list(tokens), start, keep_end=start == 0)

    def forward(self, tokens: Sequence[int], start: int) -> np.ndarray:
        tokens = list(tokens)
        if not self.recurrent:
            return self.executor.logits(tokens, start)[-1]
        if start == 0:
            reused = self._longest_prefix(tokens)
            if reused:
                states, last = self.snapshots[reused]
                self.snapshots.move_to_end(reused)
                self.executor.restore(states)
                self._pos = self.reused = len(reused)
                if len(reused) == len(tokens):
                    return last.copy()
                return self._run(tokens[len(reused) :], len(reused), keep_end=True)[-1]
            self.reused = 0
        self._seek(start)
        return self._run(tokens, start, keep_end=start == 0)[-1]

    # -- snapshots ---------------------------------------------------------------------

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
                self.executor.reset_recurrent()
            return
        key = tuple(self._kv_tokens[:start])
        if len(key) == start and key in self.snapshots:
            self.executor.restore(self.snapshots[key][0])
            self._pos = start
            return
        raise HipcError(
            f"recurrent state: cannot continue at position {start}; the sequence is at "
            f"position {self._pos} and no snapshot was kept at {start}"
        )

    def _run(self, tokens: list[int], start: int, keep_end: bool) -> np.ndarray:
        """tokens at start.., in pieces ending at multiples of the snapshot interval, with
        a snapshot at each such boundary (decoding crosses them too: a next turn's prompt
        starts with this one's answer) and, for a prompt, at its end."""
        if start + len(tokens) > self.max_context:
            raise HipcError(
                f"context overflow: {start + len(tokens)} positions > max context "
                f"{self.max_context}"
            )
        every = self.snapshot_interval
        out, pos, done = [], start, 0
        while done < len(tokens):
            end = min(start + len(tokens), (pos // every + 1) * every)
            piece = tokens[done : done + end - pos]
            rows = self.executor.logits(piece, pos)
            out.append(rows)
            self._kv_tokens[pos:] = piece
            done, pos = done + len(piece), end
            self._pos = pos
            if pos % every == 0 or (keep_end and done == len(tokens)):
                self._keep(tuple(self._kv_tokens[:pos]), rows[-1])
        return np.concatenate(out)

    def _keep(self, key: tuple[int, ...], last: np.ndarray) -> None:
        self.snapshots[key] = (self.executor.snapshot(), np.array(last, copy=True))
        self.snapshots.move_to_end(key)
        while len(self.snapshots) > self.max_snapshots:
            self.snapshots.popitem(last=False)
