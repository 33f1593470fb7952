"""repack: merge linear layers that read the same input into one wider one.

q, k, v (and gate, up) each read the same normalized activations; one Linear over
their weights concatenated by rows reads those activations once, is one kernel
instead of three, and a Split names the parts again. Rows of quantized weights are
independent, so concatenating them keeps the blocks as they are.
"""

from __future__ import annotations

import numpy as np

from hipc.compiler.ir import Constant, Graph, Node, PackedWeight, WeightRef
from hipc.compiler.passes.rewrite import Rewriter
from hipc.compiler.source.reader import WeightReader


def merge_parallel_linears(graph: Graph, reader: WeightReader | None = None) -> Graph:
    reader = reader or WeightReader()
    groups: dict[tuple[str, str, bool], list[Node]] = {}
    for n in graph.nodes:
        if n.op == "hipc::Linear" and isinstance(graph.initializers.get(n.inputs[1]), WeightRef):
            key = (n.inputs[0], graph.values[n.inputs[1]].dtype, len(n.inputs) > 2)
            groups.setdefault(key, []).append(n)
    merged = {g[0].name: g for g in groups.values() if len(g) > 1}
    skip = {n.name for g in merged.values() for n in g[1:]}

    rw = Rewriter(graph)
    for node in graph.nodes:
        if node.name in skip:
            continue
        if node.name not in merged:
            rw.copy(node)
            continue
        parts = merged[node.name]
        name = _merged_name([p.outputs[0] for p in parts])
        refs = tuple(graph.initializers[p.inputs[1]] for p in parts)
        inputs = [parts[0].inputs[0], rw.keep_initializer(f"{name}.weight", PackedWeight(refs))]
        if len(parts[0].inputs) > 2:
            biases = [
                reader.value(graph.initializers[p.inputs[2]])
                if p.inputs[2] in graph.initializers
                else None
                for p in parts
            ]
            if any(b is None for b in biases):
                # NOTE: a bias computed by the graph cannot be packed at compile time
                for p in parts:
                    rw.copy(p)
                continue
            inputs.append(
                rw.keep_initializer(
                    f"{name}.bias", Constant(np.concatenate(biases).astype(np.float32))
                )
            )
        wide = rw.emit("Linear", inputs, [name], name, domain="hipc").outputs[0]
        sizes = [graph.values[p.inputs[1]].shape[0] for p in parts]
        rw.emit(
            "Split",
            [wide],
            [p.outputs[0] for p in parts],
            f"{name}.split",
            {"axis": -1, "split": sizes},
        )
    return rw.finish()


def _merged_name(names: list[str]) -> str:
    """l0.q, l0.k, l0.v -> l0.q+k+v"""
    prefix = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
    if all(n.startswith(prefix) for n in names):
        return prefix + "+".join(n[len(prefix) :] for n in names)
    return "+".join(names)


# Quantized types whose blocks GPU kernels read split: each block's fields as (offset,
# bytes), in the order of the regions they are gathered into. GGUF interleaves them
# ({d, quants} per 32 weights; Q6_K: {ql, qh, scales, d} per 256).
SPLIT_BLOCKS = {
    "q4_0": ((2, 16), (0, 2)),
    "q4_1": ((4, 16), (0, 4)),
    "q8_0": ((2, 32), (0, 2)),
    "q6_k": ((0, 192), (192, 16), (208, 2)),
    "q5_0": ((6, 16), (2, 4), (0, 2)),
    "q5_1": ((8, 16), (4, 4), (0, 4)),
    "q4_k": ((16, 128), (4, 12), (0, 4)),
    "q5_k": ((16, 160), (4, 12), (0, 4)),
}


def split_quant_blocks(stored: np.ndarray, dtype: str) -> np.ndarray:
    """GGUF blocks [rows, row bytes] -> one region per block field (quants of every block
    in order, then scales, ...: templates/hip/prelude.h, hipc_qmat). Same bytes and shape."""
    fields = SPLIT_BLOCKS[dtype]
    blocks = np.ascontiguousarray(stored).reshape(-1, sum(n for _, n in fields))
    out = np.concatenate([blocks[:, o : o + n].reshape(-1) for o, n in fields])
    return out.reshape(stored.shape)
