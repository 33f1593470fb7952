"""The reference executor behind the generation-engine interface (`--reference`).

Models with recurrent states (linear attention) run through runtime.recurrent's
RecurrentSequence: pieces ending at multiples of 64 positions, snapshots of the recurrent
states for prefix reuse.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import Model, build_graph
from hipc.runtime.recurrent import MAX_SNAPSHOTS, SNAPSHOT_INTERVAL, RecurrentSequence


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
        self.sequence = None
        if self.executor.recurrent_states:
            self.sequence = RecurrentSequence(
                self._step, self.executor, self.max_context, snapshot_interval, max_snapshots
            )

    def _step(self, tokens: list[int], start: int, all_rows: bool) -> np.ndarray:
        rows = self.executor.logits(tokens, start)
        return rows if all_rows else rows[-1:]

    @property
    def reused(self) -> int:
        """Positions the last prompt took from a snapshot (0 without recurrent states)."""
        return self.sequence.reused if self.sequence else 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.model.source.tokenizer()
        return self._tokenizer

    def reset(self) -> None:
        if self.sequence:
            self.sequence.reset()
        else:
            self.executor.reset()

    def logits(self, tokens: Sequence[int], start: int) -> np.ndarray:
        if self.sequence:
            return self.sequence.logits(list(tokens), start)
        return self.executor.logits(list(tokens), start)

    def forward(self, tokens: Sequence[int], start: int) -> np.ndarray:
        if self.sequence:
            return self.sequence.forward(list(tokens), start)
        return self.logits(tokens, start)[-1]
