"""A small helper for writing graph builders: one method call per node, types inferred.

Output types come from the op registry's rules, so a builder cannot produce a node
the verifier would reject.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hipc.compiler.ir import QUANT_DTYPES, Constant, Graph, Node, TensorType, WeightRef
from hipc.compiler.ir.ops import TYPE_RULES


class GraphBuilder:
    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self._weights: dict[str, str] = {}

    def op(
        self,
        op_type: str,
        inputs: list[str],
        name: str,
        attrs: dict[str, Any] | None = None,
        domain: str = "",
        n_outputs: int = 1,
    ) -> str:
        outputs = tuple([name] if n_outputs == 1 else [f"{name}.{i}" for i in range(n_outputs)])
        node = Node(name, op_type, tuple(inputs), outputs, attrs or {}, domain)
        types = TYPE_RULES[node.op](node, [self.g.values[i] for i in inputs], self.g)
        self.g.add_node(node, types)
        return outputs[0]

    def constant(self, name: str, array: np.ndarray) -> str:
        if name not in self.g.initializers:
            self.g.add_initializer(name, Constant(array), TensorType(str(array.dtype), array.shape))
        return name

    def weight(self, ref: WeightRef) -> str:
        """A float32 value holding the weight, via Cast or Dequantize from its storage type."""
        if ref.name in self._weights:
            return self._weights[ref.name]
        stored = self.g.add_initializer(ref.name, ref, TensorType(ref.dtype, ref.shape))
        if ref.dtype == "float32":
            value = stored
        elif ref.dtype in QUANT_DTYPES:
            value = self.op("Dequantize", [stored], f"{ref.name}.f32", domain="hipc")
        else:
            value = self.op("Cast", [stored], f"{ref.name}.f32", {"to": "float32"})
        self._weights[ref.name] = value
        return value

    def linear(self, x: str, w: WeightRef, name: str, bias: WeightRef | None = None) -> str:
        """x @ W^T (+ b): HF/GGUF store linear weights as [out, in]."""
        wt = self.op("Transpose", [self.weight(w)], f"{w.name}.T", {"perm": [1, 0]})
        y = self.op("MatMul", [x, wt], name if bias is None else f"{name}.mm")
        if bias is not None:
            y = self.op("Add", [y, self.weight(bias)], name)
        return y

    def reshape(self, x: str, shape: list[int], name: str) -> str:
        target = self.constant(f"shape{shape}".replace(" ", ""), np.array(shape, dtype=np.int64))
        return self.op("Reshape", [x, target], name)
