"""canonicalize: rewrite the builder's spelled-out ONNX patterns into the forms kernels take.

  MatMul(x, Transpose(Dequantize|Cast(W))) [+ Add(b)]  ->  hipc::Linear(x, W[, b])
  Gather(Dequantize|Cast(W), ids)                       ->  hipc::Embedding(W, ids)
  Mul(x, Sigmoid(x))                                    ->  hipc::SiLU(x)
  Mul(Tanh(Div(x, c)), c)                               ->  hipc::SoftCap(x, cap=c)
  hipc::Experts(x, ids, w, Dequantize|Cast(W)...)       ->  hipc::Experts(x, ids, w, W...)
  Cast(w) of a 1-D weight (norm scales, biases)         ->  float32 constant
  Add/Mul of 1-D weights and constants (Gemma's 1 + w)  ->  float32 constant
  Exp/Neg of 1-D weights (linear attention's -exp(A_log)) -> float32 constant
  hipc::CausalConv1d(x, Reshape(Cast(W)), s)            ->  hipc::CausalConv1d(x, W, s)

Kernels then read weights in their storage type (quantized blocks stay quantized),
and the dequantize/transposed float copies of the unfused graph never exist.
"""

from __future__ import annotations

import numpy as np

from hipc.compiler.ir import Constant, Graph, Node, StackedWeight, WeightRef
from hipc.compiler.passes.rewrite import Rewriter
from hipc.compiler.source.reader import WeightReader

_VIEWS = ("Cast", "hipc::Dequantize")
_FOLDABLE = {"Add": np.add, "Mul": np.multiply, "Exp": np.exp, "Neg": np.negative}


def canonicalize(graph: Graph, reader: WeightReader | None = None) -> Graph:
    reader = reader or WeightReader()
    rw = Rewriter(graph)
    storage: dict[str, str] = {}  # float view of a weight -> the stored initializer
    transposed: dict[str, str] = {}  # Transpose of such a view -> the stored initializer
    sigmoid_of: dict[str, str] = {}  # Sigmoid output -> its input
    bias_add = _bias_adds(graph)
    softcaps, softcap_parts = _softcaps(graph)
    vectors: dict[str, np.ndarray] = {}  # weight-only values of <= 1 dims, as float32

    def vector(value: str) -> np.ndarray | None:
        init = graph.initializers.get(value)
        if value not in vectors and init is not None and len(graph.values[value].shape) <= 1:
            vectors[value] = reader.value(init).astype(np.float32)
        return vectors.get(value)

    for name, init in graph.initializers.items():
        if isinstance(init, (WeightRef, StackedWeight)) and init.dtype == "float32":
            storage[name] = name

    def weight(value: str) -> str | None:
        return storage.get(value)

    # Views of weights first: a bias view may come after the MatMul that adds it.
    for node in graph.nodes:
        if node.op in _VIEWS and node.inputs[0] in graph.initializers:
            storage[node.outputs[0]] = node.inputs[0]
            if len(graph.values[node.inputs[0]].shape) == 1:
                # small vectors become float32 constants: no Cast at run time
                vectors[node.outputs[0]] = vector(node.inputs[0])
                rw.keep_initializer(node.outputs[0], Constant(vectors[node.outputs[0]]))
        elif (
            node.op in _FOLDABLE
            and len(graph.values[node.outputs[0]].shape) == 1
            and all(vector(i) is not None for i in node.inputs)
        ):
            vectors[node.outputs[0]] = _FOLDABLE[node.op](*(vectors[i] for i in node.inputs))
            rw.keep_initializer(node.outputs[0], Constant(vectors[node.outputs[0]]))

    for node in graph.nodes:
        op, ins = node.op, node.inputs
        if (op in _VIEWS and ins[0] in graph.initializers) or node.outputs[0] in vectors:
            continue
        if node.name in softcaps:
            mul, cap = softcaps[node.name]
            rw.emit("SoftCap", [ins[0]], mul.outputs, mul.name, {"cap": cap}, domain="hipc")
            continue
        if node.name in softcap_parts:
            continue
        if op == "Transpose" and weight(ins[0]) and list(node.attrs.get("perm", [1, 0])) == [1, 0]:
            transposed[node.outputs[0]] = weight(ins[0])
            continue
        if op == "MatMul" and ins[1] in transposed:
            bias = bias_add.get(node.outputs[0])
            if bias is not None:
                add, b = bias
                rw.emit(
                    "Linear", [ins[0], transposed[ins[1]], b], add.outputs, node.name, domain="hipc"
                )
            else:
                rw.emit(
                    "Linear", [ins[0], transposed[ins[1]]], node.outputs, node.name, domain="hipc"
                )
            continue
        if op == "Add" and any(node is a for a, _ in bias_add.values()):
            continue
        if op == "hipc::Experts" and all(weight(i) for i in ins[3:]):
            stored = [weight(i) for i in ins[3:]]
            rw.emit("Experts", [*ins[:3], *stored], node.outputs, node.name, domain="hipc")
            continue
        if (
            op == "Reshape"
            and _stored_through_reshapes(graph, node.outputs[0])
            and all(u.op == "hipc::CausalConv1d" for u in graph.consumers(node.outputs[0]))
        ):
            continue  # the conv reads the stored weight itself (below)
        if op == "hipc::CausalConv1d" and (stored := _stored_through_reshapes(graph, ins[1])):
            rw.emit(
                "CausalConv1d", [ins[0], stored, ins[2]], node.outputs, node.name, domain="hipc"
            )
            continue
        if op == "Gather" and weight(ins[0]):
            rw.emit("Embedding", [weight(ins[0]), ins[1]], node.outputs, node.name, domain="hipc")
            continue
        if op == "Sigmoid" and rw.uses[node.outputs[0]] == 1:
            (user,) = graph.consumers(node.outputs[0])
            # only x * sigmoid(x) becomes SiLU; a gate (sigmoid(g) * y) stays as it is
            if user.op == "Mul" and ins[0] in user.inputs:
                sigmoid_of[node.outputs[0]] = ins[0]
                continue
        if op == "Mul" and _is_silu(ins, sigmoid_of):
            x = ins[0] if sigmoid_of.get(ins[1]) == ins[0] else ins[1]
            rw.emit("SiLU", [x], node.outputs, node.name, domain="hipc")
            continue
        rw.copy(node)
    return rw.finish()


def _stored_through_reshapes(graph: Graph, value: str) -> str | None:
    """The stored weight behind Reshapes and a Cast/Dequantize (a reshape keeps the row-major
    layout, so the kernel reads the file's tensor as it is)."""
    while value not in graph.initializers:
        producer = graph.producer(value)
        if producer is None or producer.op not in ("Reshape", *_VIEWS):
            return None
        value = producer.inputs[0]
    return value


def _softcaps(graph: Graph) -> tuple[dict[str, tuple[Node, float]], set[str]]:
    """Div(x, c) -> Tanh -> Mul(., c) chains, c one scalar constant: the Div's name ->
    (the Mul, c), and the names of the Tanh and Mul nodes the SoftCap replaces."""
    found: dict[str, tuple[Node, float]] = {}
    parts: set[str] = set()
    for div in graph.nodes:
        if div.op != "Div" or (cap := _scalar(graph, div.inputs[1])) is None:
            continue
        tanh = _only_user(graph, div.outputs[0], "Tanh")
        mul = tanh and _only_user(graph, tanh.outputs[0], "Mul")
        if mul and cap > 0 and any(_scalar(graph, i) == cap for i in mul.inputs):
            found[div.name] = (mul, cap)
            parts |= {tanh.name, mul.name}
    return found, parts


def _scalar(graph: Graph, value: str) -> float | None:
    init = graph.initializers.get(value)
    if isinstance(init, Constant) and init.array.size == 1:
        return float(init.array.reshape(()))
    return None


def _only_user(graph: Graph, value: str, op: str) -> Node | None:
    users = graph.consumers(value)
    if len(users) == 1 and users[0].op == op and value not in graph.outputs:
        return users[0]
    return None


def _is_silu(ins: tuple[str, ...], sigmoid_of: dict[str, str]) -> bool:
    a, b = ins
    return sigmoid_of.get(b) == a or sigmoid_of.get(a) == b


def _bias_adds(graph: Graph) -> dict[str, tuple[Node, str]]:
    """MatMul output -> (the Add that adds a 1-D weight to it, the view of that weight)."""
    found: dict[str, tuple[Node, str]] = {}
    consumers: dict[str, list[Node]] = {}
    for n in graph.nodes:
        for i in n.inputs:
            consumers.setdefault(i, []).append(n)
    for n in graph.nodes:
        if n.op != "MatMul":
            continue
        users = consumers.get(n.outputs[0], [])
        if len(users) != 1 or users[0].op != "Add":
            continue
        other = [i for i in users[0].inputs if i != n.outputs[0]]
        if (
            len(other) == 1
            and len(graph.values[other[0]].shape) == 1
            and _is_weight_view(graph, other[0])
        ):
            found[n.outputs[0]] = (users[0], other[0])
    return found


def _is_weight_view(graph: Graph, value: str) -> bool:
    if value in graph.initializers:
        return True
    producer = graph.producer(value)
    return (
        producer is not None and producer.op in _VIEWS and producer.inputs[0] in graph.initializers
    )
