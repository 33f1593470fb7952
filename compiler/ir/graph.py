"""The IR: an ONNX-style graph of nodes over typed values, stored on a networkx DiGraph.

Values have a dtype and a shape whose dims are ints or symbols:
  tokens  tokens processed in this step (1 for decode, the prompt length for prefill)
  ctx     KV-cache length (positions written so far), bounded by max_ctx
Weights are initializers that *reference* tensors in the source files; nothing is
loaded until a pass or an executor asks. Graphs are batchless (batch 1): activations
are [tokens, ...] where ONNX would write [batch, seq, ...].

Ops use ONNX names and semantics where ONNX has the op; the rest live in the `hipc`
domain (see compiler/ir/ops.py for the registry and shape rules).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

Dim = int | str

# GGUF block types: dtype -> (elements per block, bytes per block). Every target reads
# these sizes; which types a target has kernels for is the target's own table.
QUANT_BLOCKS = {
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q8_0": (32, 34),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "iq4_nl": (32, 18),
    "iq4_xs": (256, 136),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    "q8_k": (256, 292),
    "q2_k": (256, 84),
    "q3_k": (256, 110),
}
QUANT_DTYPES = tuple(QUANT_BLOCKS)


def quant_row_bytes(dtype: str, k: int) -> int:
    """Bytes of a row of `k` values stored in `dtype`'s GGUF blocks (k a whole number of them)."""
    elems, block_bytes = QUANT_BLOCKS[dtype]
    return k // elems * block_bytes


DENSE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def row_bytes(dtype: str, k: int) -> int:
    """Bytes of a row of `k` values stored as `dtype`: GGUF blocks or a dense type."""
    return quant_row_bytes(dtype, k) if dtype in QUANT_BLOCKS else k * DENSE_BYTES[dtype]


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)


@dataclass(frozen=True)
class WeightRef:
    """A tensor inside a model file, read lazily.

    `dtype` is the storage type in the file (float32, float16, bfloat16, q4_1, ...);
    `shape` is the logical numpy shape ([out, in] for a linear layer's weight).
    """

    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    format: str  # "safetensors" | "gguf"


@dataclass(frozen=True, eq=False)
class Constant:
    """A small tensor computed by the builder (RoPE tables, reshape targets)."""

    array: np.ndarray


@dataclass(frozen=True)
class PackedWeight:
    """Weights concatenated along `axis` by a repacking pass (merged QKV, gate/up).

    Still lazy: the parts are read and joined only when an executor or the artifact
    writer asks. All parts share one storage dtype, so quantized rows stay quantized.
    """

    parts: tuple[WeightRef, ...]
    axis: int = 0

    @property
    def dtype(self) -> str:
        return self.parts[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape
        total = sum(p.shape[self.axis] for p in self.parts)
        return (*first[: self.axis], total, *first[self.axis + 1 :])


@dataclass(frozen=True)
class StackedWeight:
    """Equal-shaped weights stacked on a new leading axis: one tensor per expert in the
    file (HF MoE checkpoints), seen as the [experts, out, in] tensor GGUF stores.

    Lazy like PackedWeight, so a kernel that reads only the routed experts never has
    the others read for it.
    """

    name: str
    parts: tuple[WeightRef, ...]

    @property
    def dtype(self) -> str:
        return self.parts[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)


Initializer = WeightRef | Constant | PackedWeight | StackedWeight


def initializer_type(init: Initializer) -> TensorType:
    if isinstance(init, Constant):
        return TensorType(str(init.array.dtype), tuple(init.array.shape))
    return TensorType(init.dtype, init.shape)


@dataclass(frozen=True, eq=False)
class Node:
    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    domain: str = ""  # "" is the ONNX default domain

    @property
    def op(self) -> str:
        return f"{self.domain}::{self.op_type}" if self.domain else self.op_type


class Graph:
    """Nodes in a networkx DiGraph (edges producer -> consumer), plus value types.

    Graph inputs are per-step values (input_ids, positions); states are persistent
    buffers a step reads and updates in place (the KV cache); initializers are weights.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.inputs: dict[str, TensorType] = {}
        self.outputs: list[str] = []
        self.values: dict[str, TensorType] = {}
        self.initializers: dict[str, Initializer] = {}
        self.states: dict[str, TensorType] = {}
        self.metadata: dict[str, Any] = {}
        self._g = nx.DiGraph()
        self._producer: dict[str, str] = {}

    # -- building ------------------------------------------------------------------

    def add_input(self, name: str, ttype: TensorType) -> str:
        self.inputs[name] = ttype
        self.values[name] = ttype
        return name

    def add_state(self, name: str, ttype: TensorType) -> str:
        self.states[name] = ttype
        self.values[name] = ttype
        return name

    def add_initializer(self, name: str, init: Initializer, ttype: TensorType) -> str:
        self.initializers[name] = init
        self.values[name] = ttype
        return name

    def add_node(self, node: Node, output_types: Iterable[TensorType]) -> Node:
        if node.name in self._g:
            raise ValueError(f"duplicate node name {node.name!r}")
        self._g.add_node(node.name, node=node)
        for out, ttype in zip(node.outputs, output_types, strict=True):
            if out in self.values:
                raise ValueError(f"value {out!r} defined twice")
            self.values[out] = ttype
            self._producer[out] = node.name
        for inp in node.inputs:
            if inp and inp in self._producer:
                self._g.add_edge(self._producer[inp], node.name, value=inp)
        return node

    # -- reading -------------------------------------------------------------------

    def node(self, name: str) -> Node:
        return self._g.nodes[name]["node"]

    @property
    def nodes(self) -> list[Node]:
        """Nodes in a deterministic topological order (insertion order breaks ties)."""
        order = {n: i for i, n in enumerate(self._g.nodes)}
        names = nx.lexicographical_topological_sort(self._g, key=order.__getitem__)
        return [self.node(n) for n in names]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return self._g.number_of_nodes()

    def producer(self, value: str) -> Node | None:
        name = self._producer.get(value)
        return self.node(name) if name else None

    def consumers(self, value: str) -> list[Node]:
        return [self.node(n) for n in self._g.nodes if value in self.node(n).inputs]

    def op_histogram(self) -> dict[str, int]:
        hist: dict[str, int] = {}
        for node in self._g.nodes.values():
            op = node["node"].op
            hist[op] = hist.get(op, 0) + 1
        return dict(sorted(hist.items()))

    def weight_refs(self) -> dict[str, WeightRef]:
        """Every source tensor the graph reads, packed ones included, by tensor name."""
        refs: dict[str, WeightRef] = {}
        for init in self.initializers.values():
            for ref in init.parts if isinstance(init, (PackedWeight, StackedWeight)) else (init,):
                if isinstance(ref, WeightRef):
                    refs[ref.name] = ref
        return refs

    def copy(self, name: str | None = None) -> Graph:
        """An empty graph with the same inputs, states, outputs and metadata (for passes)."""
        g = Graph(name or self.name)
        for k, t in self.inputs.items():
            g.add_input(k, t)
        for k, t in self.states.items():
            g.add_state(k, t)
        g.outputs = list(self.outputs)
        g.metadata = dict(self.metadata)
        return g

    # -- serialization ---------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        def init_json(init: Initializer) -> dict[str, Any]:
            if isinstance(init, WeightRef):
                return {
                    "kind": "weight",
                    "file": init.path,
                    "tensor": init.name,
                    "dtype": init.dtype,
                }
            if isinstance(init, PackedWeight):
                return {"kind": "packed", "axis": init.axis, "parts": [p.name for p in init.parts]}
            if isinstance(init, StackedWeight):
                return {"kind": "stacked", "parts": [p.name for p in init.parts]}
            arr = init.array
            return {"kind": "constant", "dtype": str(arr.dtype), "shape": list(arr.shape)}

        return {
            "name": self.name,
            "metadata": self.metadata,
            "inputs": {k: str(v) for k, v in self.inputs.items()},
            "states": {k: str(v) for k, v in self.states.items()},
            "outputs": self.outputs,
            "initializers": {
                k: {**init_json(v), "type": str(self.values[k])}
                for k, v in self.initializers.items()
            },
            "nodes": [
                {
                    "name": n.name,
                    "op": n.op,
                    "inputs": list(n.inputs),
                    "outputs": [f"{o}: {self.values[o]}" for o in n.outputs],
                    "attrs": {k: _jsonable(v) for k, v in n.attrs.items()},
                }
                for n in self.nodes
            ],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    if isinstance(v, Mapping):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v
