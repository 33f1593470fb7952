"""The reference executor: runs the unfused IR graph op by op in NumPy.

It is the oracle every compiled target is checked against, and is itself checked
against transformers and llama.cpp. A weight's NumPy value is its exact real value:
quantized and bf16 tensors arrive dequantized/widened, so Dequantize and Cast only
pick the compute precision (float32 by default, float64 where a test asks).
Subgraphs that read only weights (casts, transposes) run once and are kept.
"""

from __future__ import annotations

import numpy as np

from hipc.base.errors import HipcError
from hipc.compiler.ir import Graph
from hipc.compiler.reference.ops import IMPLS
from hipc.compiler.source.reader import WeightReader


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32)


class ReferenceExecutor:
    def __init__(self, graph: Graph, dtype: str = "float32", kv_storage: str = "float32") -> None:
        self.graph = graph
        self.float_dtype = np.dtype(dtype)
        if kv_storage not in ("float32", "bfloat16"):
            raise HipcError(f"reference: unknown KV storage {kv_storage!r}")
        self.kv_storage = kv_storage
        self.max_ctx = int(graph.metadata["max_ctx"])
        self.reader = WeightReader()
        self._nodes = graph.nodes
        self._consts: dict[str, np.ndarray] | None = None
        self.states = {
            name: np.zeros(
                [self.max_ctx if d == "max_ctx" else d for d in t.shape], self.float_dtype
            )
            for name, t in graph.states.items()
        }

    def store_kv(self, x: np.ndarray) -> np.ndarray:
        """A value as the KV cache holds it: bfloat16 storage rounds to nearest even,
        as the GPU kernels do, so compiled artifacts are checked against the same cache."""
        return x if self.kv_storage == "float32" else round_bf16(x).astype(x.dtype)

    def reset(self) -> None:
        for s in self.states.values():
            s.fill(0)

    # -- per-sequence states by kind ---------------------------------------------------

    @property
    def recurrent_states(self) -> list[str]:
        """States not indexed by position (conv windows, delta-rule matrices): they hold only
        the sequence's latest step, so reuse needs a copy (a snapshot) taken at that step."""
        return [n for n, t in self.graph.states.items() if "max_ctx" not in t.shape]

    def reset_recurrent(self) -> None:
        for name in self.recurrent_states:
            self.states[name].fill(0)

    def snapshot(self) -> dict[str, np.ndarray]:
        return {name: self.states[name].copy() for name in self.recurrent_states}

    def restore(self, snapshot: dict[str, np.ndarray]) -> None:
        # in place: the arrays are the ones every run reads and writes
        for name, value in snapshot.items():
            np.copyto(self.states[name], value)

    # -- weights ---------------------------------------------------------------------

    def _fold_constants(self) -> dict[str, np.ndarray]:
        g = self.graph
        values: dict[str, np.ndarray] = {}
        for name, init in g.initializers.items():
            values[name] = self.reader.value(init)
        folded = set(values)
        runtime_nodes = []
        for node in self._nodes:
            if all(i in folded for i in node.inputs) and node.inputs:
                for out, val in zip(
                    node.outputs,
                    IMPLS[node.op](node, [values[i] for i in node.inputs], self),
                    strict=True,
                ):
                    values[out] = val
                    folded.add(out)
            else:
                runtime_nodes.append(node)
        self._nodes = runtime_nodes
        needed = {i for n in runtime_nodes for i in n.inputs}
        return {k: v for k, v in values.items() if k in needed}

    # -- running ---------------------------------------------------------------------

    def prepare(self) -> None:
        """Read the weights and fold weight-only subgraphs now rather than on the first run."""
        if self._consts is None:
            self._consts = self._fold_constants()

    def run(self, input_ids: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        self.prepare()
        input_ids = np.asarray(input_ids, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and int(positions.max()) >= self.max_ctx:
            raise HipcError(
                f"context overflow: position {int(positions.max())} >= max context {self.max_ctx}"
            )
        env: dict[str, np.ndarray] = dict(self._consts)
        env.update(self.states)
        env["input_ids"], env["positions"] = input_ids, positions
        for node in self._nodes:
            outs = IMPLS[node.op](node, [env[i] for i in node.inputs], self)
            env.update(zip(node.outputs, outs, strict=True))
        return {name: env[name] for name in self.graph.outputs}

    def logits(self, tokens: list[int] | np.ndarray, start: int = 0) -> np.ndarray:
        """Logits [len(tokens), vocab] for tokens at positions start.., extending the cache."""
        tokens = np.asarray(tokens, dtype=np.int64)
        out = self.run(tokens, np.arange(start, start + len(tokens)))
        return out[self.graph.outputs[0]]
