"""The reference executor behind the generation-engine interface (`--reference`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import Model, build_graph


class ReferenceEngine:
    def __init__(
        self,
        model: Model,
        max_ctx: int | None = None,
        dtype: str = "float32",
        kv_storage: str = "float32",
        quant: str | None = None,
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

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.model.source.tokenizer()
        return self._tokenizer

    def reset(self) -> None:
        self.executor.reset()

    def logits(self, tokens: Sequence[int], start: int) -> np.ndarray:
        return self.executor.logits(list(tokens), start)

    def forward(self, tokens: Sequence[int], start: int) -> np.ndarray:
        return self.logits(tokens, start)[-1]
