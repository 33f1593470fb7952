"""The IR container, the verifier and the .onnx export."""

from __future__ import annotations

import json

import pytest

from hipc.compiler.ir import Graph, Node, TensorType
from hipc.compiler.ir.verify import VerifyError, verify
from hipc.graphs import build_graph, load_model

from support import require, write_tiny_hf


@pytest.fixture
def graph(tmp_path):
    return build_graph(load_model(write_tiny_hf(tmp_path / "m")), max_ctx=16)


def test_graph_is_topological_and_typed(graph):
    seen = set(graph.inputs) | set(graph.states) | set(graph.initializers)
    for node in graph.nodes:
        assert all(i in seen for i in node.inputs), node.name
        seen.update(node.outputs)
    assert graph.values["logits"] == TensorType("float32", ("tokens", 97))
    assert graph.values["l0.q.heads"] == TensorType("float32", ("tokens", 4, 8))


def test_weights_are_lazy_references(graph):
    refs = graph.weight_refs()
    assert refs["model.layers.0.mlp.up_proj.weight"].shape == (64, 32)
    assert all(r.path.endswith("model.safetensors") for r in refs.values())


def test_verifier_catches_a_broken_node(graph):
    bad = Graph("bad")
    bad.add_input("x", TensorType("float32", ("tokens", 8)))
    bad.add_input("w", TensorType("float32", (4, 3)))
    bad.add_node(Node("mm", "MatMul", ("x", "w"), ("y",)), [TensorType("float32", ("tokens", 3))])
    with pytest.raises(VerifyError, match="inner dims differ"):
        verify(bad)


def test_verifier_catches_a_mistyped_output():
    g = Graph("g")
    g.add_input("x", TensorType("float32", ("tokens", 8)))
    g.add_node(Node("s", "Sigmoid", ("x",), ("y",)), [TensorType("float16", ("tokens", 8))])
    with pytest.raises(VerifyError, match="rule gives"):
        verify(g)


def test_json_dump_names_every_node(graph):
    dumped = json.loads(graph.dumps())
    assert len(dumped["nodes"]) == len(graph)
    assert dumped["initializers"]["model.norm.weight"]["kind"] == "weight"


def test_onnx_export_checks(graph, tmp_path):
    onnx = require("onnx")
    from hipc.compiler.onnx_export import export_onnx

    path = export_onnx(graph, tmp_path / "g.onnx")
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    # every IR node is there under its own name; RoPE's layout wrappers are named after it
    names = {n.name for n in model.graph.node}
    ir_names = {n.name for n in graph.nodes}
    assert ir_names <= names
    assert all(x in ir_names or x.rsplit(".", 1)[0] in ir_names for x in names)
    assert {n.domain for n in model.graph.node} == {"", "hipc"}
