"""Export the IR graph as an .onnx file for viewing (Netron), when the onnx package is present.

Weights are not embedded (they stay in the model files): each initializer becomes a
graph input carrying its type, so the file is small and opens instantly. Symbolic
dims become ONNX dim_params; hipc-domain ops keep their domain.

Where the IR keeps an ONNX op's operand as an attribute or in its own layout, the
export writes what the ONNX standard says, so every file passes ``onnx.checker``
(shape inference included): Split's sizes become its second input (an input since
opset 13), and RotaryEmbedding on the IR's ``[tokens, heads, head_dim]`` is wrapped
into the standard's ``[batch, heads, seq, head_dim]`` by Unsqueeze/Transpose nodes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hipc.compiler.ir import Constant, Graph, TensorType

_ELEM = {
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "float16": "FLOAT16",
    "bfloat16": "BFLOAT16",
    "int64": "INT64",
    "int32": "INT32",
}


def onnx_available() -> bool:
    try:
        import onnx  # noqa: F401
    except ImportError:
        return False
    return True


def to_onnx(graph: Graph):
    import onnx
    from onnx import helper

    def value_info(name: str, t: TensorType):
        # quantized storage types have no ONNX element type; show them as UINT8 blocks
        elem = getattr(onnx.TensorProto, _ELEM.get(t.dtype, "UINT8"))
        return helper.make_tensor_value_info(name, elem, list(t.shape))

    inputs = [value_info(n, t) for n, t in graph.inputs.items()]
    inputs += [value_info(n, t) for n, t in graph.states.items()]
    initializers = []
    for name, init in graph.initializers.items():
        if isinstance(init, Constant):
            initializers.append(onnx.numpy_helper.from_array(np.asarray(init.array), name))
        else:
            inputs.append(value_info(name, graph.values[name]))
    nodes = []
    for n in graph.nodes:
        attrs = {k: v for k, v in n.attrs.items() if v is not None}
        node_inputs = list(n.inputs)
        if n.op_type == "Split" and not n.domain and "split" in attrs:
            sizes = f"{n.name}.sizes"
            initializers.append(
                onnx.numpy_helper.from_array(np.asarray(attrs.pop("split"), np.int64), sizes)
            )
            node_inputs.append(sizes)
        elif n.op_type == "RotaryEmbedding" and not n.domain:
            nodes += _standard_rope(n, node_inputs, attrs, initializers)
            continue
        nodes.append(
            helper.make_node(
                n.op_type, node_inputs, list(n.outputs), n.name, domain=n.domain, **attrs
            )
        )
    outputs = [value_info(o, graph.values[o]) for o in graph.outputs]
    g = helper.make_graph(nodes, graph.name, inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("hipc", 1)]
    return helper.make_model(g, opset_imports=opsets, producer_name="hipc")


def _standard_rope(n, inputs: list[str], attrs: dict, initializers: list) -> list:
    """The IR's per-token RotaryEmbedding as the standard's batched 4-D one."""
    import onnx
    from onnx import helper

    x, cos, sin, pos = inputs
    zero = f"{n.name}.axis0"
    initializers.append(onnx.numpy_helper.from_array(np.asarray([0], np.int64), zero))
    p = n.name
    out = n.outputs[0]
    return [
        helper.make_node("Unsqueeze", [x, zero], [f"{p}.x4"], f"{p}.unsqueeze_x"),
        helper.make_node(
            "Transpose", [f"{p}.x4"], [f"{p}.bhsd"], f"{p}.to_bhsd", perm=[0, 2, 1, 3]
        ),
        helper.make_node("Unsqueeze", [pos, zero], [f"{p}.pos2"], f"{p}.unsqueeze_pos"),
        helper.make_node(
            "RotaryEmbedding", [f"{p}.bhsd", cos, sin, f"{p}.pos2"], [f"{p}.rot"], p, **attrs
        ),
        helper.make_node(
            "Transpose", [f"{p}.rot"], [f"{p}.bshd"], f"{p}.to_bshd", perm=[0, 2, 1, 3]
        ),
        helper.make_node("Squeeze", [f"{p}.bshd", zero], [out], f"{p}.squeeze"),
    ]


def export_onnx(graph: Graph, path: str | Path) -> Path:
    import onnx

    path = Path(path)
    onnx.save(to_onnx(graph), str(path))
    return path
