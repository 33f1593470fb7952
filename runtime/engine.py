"""A compiled artifact behind the generation-engine interface.

Prompts longer than the artifact's step size are prefilled in chunks; only the last
token's logits are computed unless all rows are asked for (`logits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hipc.runtime.artifact import Artifact, load_artifact
from hipc.runtime.errors import HipcError


class CompiledEngine:
    def __init__(self, artifact: Artifact, backend) -> None:
        self.artifact = artifact
        self.backend = backend
        self.max_context = artifact.plan["max_context"]
        self.vocab_size = artifact.plan["vocab_size"]
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.artifact.tokenizer()
        return self._tokenizer

    def reset(self) -> None:
        # NOTE: nothing to clear: attention reads only positions this sequence wrote.
        pass

    def _run(self, tokens: Sequence[int], start: int, all_logits: bool) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size == 0:
            raise HipcError("no tokens to run")
        if start + ids.size > self.max_context:
            raise HipcError(
                f"context overflow: {start + ids.size} positions, the artifact holds {self.max_context}"
            )
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise HipcError(f"token id out of vocabulary (size {self.vocab_size})")
        step = self.backend.max_tokens
        outs = []
        for i in range(0, ids.size, step):
            chunk = ids[i : i + step]
            last = i + step >= ids.size
            if all_logits or last:
                outs.append(self.backend.forward(chunk, start + i, all_logits))
            else:
                self.backend.forward(chunk, start + i, False)
        return np.concatenate(outs) if all_logits else outs[-1]

    def forward(self, tokens: Sequence[int], start: int) -> np.ndarray:
        """Logits of the last token [vocab]."""
        return self._run(tokens, start, False)[-1]

    def logits(self, tokens: Sequence[int], start: int = 0) -> np.ndarray:
        """Logits of every token [len(tokens), vocab]."""
        return self._run(tokens, start, True)

    def close(self) -> None:
        self.backend.close()


def load_engine(
    path: str | Path, target: str = "auto", threads: int | None = None
) -> CompiledEngine:
    artifact = load_artifact(path)
    from hipc.runtime.backends.cpu import CpuBackend

    if target not in ("auto", "cpu"):
        raise HipcError(f"--target {target}: this runtime runs cpu artifacts")
    return CompiledEngine(artifact, CpuBackend(artifact, threads))
