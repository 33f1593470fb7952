"""Export the IR graph as an .onnx file for viewing (Netron), when the onnx package is present.

Weights are not embedded (they stay in the model files): each initializer becomes a
graph input carrying its type, so the file is small and opens instantly. Symbolic
dims become ONNX dim_params; hipc-domain ops keep their domain.
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
        nodes.append(
            helper.make_node(
                n.op_type, list(n.inputs), list(n.outputs), n.name, domain=n.domain, **attrs
            )
        )
    outputs = [value_info(o, graph.values[o]) for o in graph.outputs]
    g = helper.make_graph(nodes, graph.name, inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("hipc", 1)]
    return helper.make_model(g, opset_imports=opsets, producer_name="hipc")


def export_onnx(graph: Graph, path: str | Path) -> Path:
    import onnx

    path = Path(path)
    onnx.save(to_onnx(graph), str(path))
    return path
