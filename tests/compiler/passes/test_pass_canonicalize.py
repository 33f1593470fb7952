"""canonicalize on its own: the forms it produces, checked against NumPy on small graphs."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from hipc.compiler.ir import Constant, Graph, Node, TensorType, WeightRef
from hipc.compiler.ir.verify import verify
from hipc.compiler.passes.canonicalize import canonicalize


def test_every_linear_reads_its_stored_weight(built, canonical):
    hist = canonical.op_histogram()
    for gone in ("MatMul", "Transpose", "Gather", "Sigmoid"):
        assert gone not in hist, gone
    # 7 projections per layer + the LM head, each on a weight exactly as the file has it
    assert hist["hipc::Linear"] == 7 * 2 + 1
    assert hist["hipc::Embedding"] == 1 and hist["hipc::SiLU"] == 2
    for n in canonical.nodes:
        if n.op == "hipc::Linear":
            assert isinstance(canonical.initializers[n.inputs[1]], WeightRef), n.name
    assert len(canonical) < len(built)


def _matmul_graph(tmp_path, w_dtype: str, bias: bool):
    """y = x @ Cast(W).T (+ b) spelled the way the builders spell it."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 8)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    stored = w.astype(np.float16) if w_dtype == "float16" else w
    save_file({"w": stored, "b": b.astype(np.float16)}, str(tmp_path / "w.safetensors"))
    path = str(tmp_path / "w.safetensors")
    g = Graph("mm")
    g.metadata["max_ctx"] = 4
    g.add_input("x", TensorType("float32", ("tokens", 8)))
    g.add_initializer(
        "W", WeightRef(path, "w", w_dtype, (6, 8), "safetensors"), TensorType(w_dtype, (6, 8))
    )
    g.add_initializer(
        "B", WeightRef(path, "b", "float16", (6,), "safetensors"), TensorType("float16", (6,))
    )
    w_in = "W"
    if w_dtype != "float32":
        g.add_node(
            Node("cw", "Cast", ("W",), ("Wf",), {"to": "float32"}), [TensorType("float32", (6, 8))]
        )
        w_in = "Wf"
    g.add_node(
        Node("t", "Transpose", (w_in,), ("Wt",), {"perm": [1, 0]}), [TensorType("float32", (8, 6))]
    )
    g.add_node(Node("mm", "MatMul", ("x", "Wt"), ("y",)), [TensorType("float32", ("tokens", 6))])
    out = "y"
    if bias:
        g.add_node(
            Node("cb", "Cast", ("B",), ("Bf",), {"to": "float32"}), [TensorType("float32", (6,))]
        )
        g.add_node(Node("add", "Add", ("y", "Bf"), ("z",)), [TensorType("float32", ("tokens", 6))])
        out = "z"
    g.outputs = [out]

    def expected(x):
        return x @ stored.astype(np.float32).T + (
            b.astype(np.float16).astype(np.float32) if bias else 0
        )

    return verify(g), expected


@pytest.mark.parametrize("w_dtype", ["float32", "float16"])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_of_transposed_weight_becomes_linear(tmp_path, w_dtype, bias):
    g, expected = _matmul_graph(tmp_path, w_dtype, bias)
    c = verify(canonicalize(g))
    assert [n.op for n in c.nodes] == ["hipc::Linear"]
    lin = c.nodes[0]
    assert lin.inputs[1] == "W" and c.values["W"].dtype == w_dtype  # the stored weight itself
    if bias:
        # a half-precision bias becomes a float32 constant: no Cast left at run time
        assert isinstance(c.initializers[lin.inputs[2]], Constant)
        assert c.initializers[lin.inputs[2]].array.dtype == np.float32
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    env = _run_with_input(c, x)
    np.testing.assert_allclose(env, expected(x), rtol=1e-5, atol=1e-5)


def _run_with_input(g: Graph, x: np.ndarray) -> np.ndarray:
    """Run a graph whose only input is x through the reference op implementations."""
    from hipc.compiler.reference.ops import IMPLS
    from hipc.compiler.source.reader import WeightReader

    reader = WeightReader()
    env = {k: reader.value(v) for k, v in g.initializers.items()}
    env["x"] = x
    for n in g.nodes:
        env.update(zip(n.outputs, IMPLS[n.op](n, [env[i] for i in n.inputs], None), strict=True))
    return env[g.outputs[0]]


@pytest.mark.parametrize("order", [("sx", "x"), ("x", "sx")])
def test_sigmoid_times_input_becomes_silu(order):
    g = Graph("silu")
    t = TensorType("float32", ("tokens", 5))
    g.add_input("x", t)
    g.add_node(Node("s", "Sigmoid", ("x",), ("sx",)), [t])
    g.add_node(Node("m", "Mul", order, ("y",)), [t])
    g.outputs = ["y"]
    c = verify(canonicalize(verify(g)))
    assert [n.op for n in c.nodes] == ["hipc::SiLU"]
    x = np.linspace(-6, 6, 10, dtype=np.float32).reshape(2, 5)
    np.testing.assert_allclose(_run_with_input(c, x), x / (1 + np.exp(-x)), rtol=1e-6)


def test_sigmoid_read_twice_stays():
    g = Graph("gate")
    t = TensorType("float32", ("tokens", 5))
    g.add_input("x", t)
    g.add_node(Node("s", "Sigmoid", ("x",), ("sx",)), [t])
    g.add_node(Node("m", "Mul", ("sx", "x"), ("y",)), [t])
    g.add_node(Node("a", "Add", ("sx", "y"), ("z",)), [t])
    g.outputs = ["z"]
    c = verify(canonicalize(verify(g)))
    assert "hipc::SiLU" not in c.op_histogram()
