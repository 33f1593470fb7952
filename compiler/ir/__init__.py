"""The IR: graph.py (values, weights, nodes, Graph), ops.py (type rules), verify.py.

It sits below graphs/ (the builders) and the pipeline, above hipc.base only, so a
graph builder and every pass share one definition; the graph's names are
re-exported here because every layer above spells them `hipc.compiler.ir.Graph`.
"""

from hipc.compiler.ir.graph import (
    DENSE_BYTES,
    QUANT_BLOCKS,
    QUANT_DTYPES,
    Constant,
    Dim,
    Graph,
    Initializer,
    Node,
    PackedWeight,
    StackedWeight,
    TensorType,
    WeightRef,
    initializer_type,
    quant_row_bytes,
    row_bytes,
)

__all__ = [
    "DENSE_BYTES",
    "QUANT_BLOCKS",
    "QUANT_DTYPES",
    "Constant",
    "Dim",
    "Graph",
    "Initializer",
    "Node",
    "PackedWeight",
    "StackedWeight",
    "TensorType",
    "WeightRef",
    "initializer_type",
    "quant_row_bytes",
    "row_bytes",
]
