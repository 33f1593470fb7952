"""fuse on its own: which kernels a decoder layer becomes, and the reasons for refusals."""

from __future__ import annotations

import pytest

from hipc.compiler.ir import Graph, Node, TensorType
from hipc.compiler.ir.verify import verify
from hipc.compiler.passes.fuse import FusionError, fuse


@pytest.fixture(scope="module")
def fusion(repacked):
    return fuse(repacked)


def test_each_layer_is_five_kernels(fusion, layers):
    kinds = [g.kind for g in fusion.groups]
    # embedding, 5 per layer, the final norm + LM head
    assert len(kinds) == 1 + 5 * layers + 1
    assert kinds[0] == "embedding"
    assert kinds[1:6] == ["linear", "attention", "linear", "linear", "linear"]
    assert kinds[-1] == "linear"


def test_every_node_is_in_exactly_one_group(fusion, repacked):
    names = [n for g in fusion.groups for n in g.node_names]
    assert sorted(names) == sorted(n.name for n in repacked.nodes)


def _group(fusion, anchor):
    return next(g for g in fusion.groups if g.anchor.name == anchor)


def test_roles_of_a_layer(fusion, repacked):
    qkv = _group(fusion, repacked.producer("l0.q+k+v").name)
    assert [n.op for n in qkv.prologue] == ["RMSNormalization"]
    assert [n.op for n in qkv.epilogue] == ["Split"]
    up = _group(fusion, repacked.producer("l0.gate+up").name)
    assert [n.op for n in up.epilogue] == ["Split", "hipc::SiLU", "Mul"]
    att = next(g for g in fusion.groups if g.kind == "attention")
    assert {n.op for n in att.prologue} >= {"RotaryEmbedding", "Reshape"}
    o = fusion.groups[3]
    assert [n.op for n in o.epilogue] == ["Add"]  # the residual, in place


def test_refusals_carry_reasons(fusion):
    refused = [d for d in fusion.decisions if not d.accepted]
    assert refused and all(d.reason and d.reason != "legal" for d in refused)
    # the residual Add went to the Linear before the norm; the norm-side offer is refused
    assert any(d.role == "prologue:residual-add" for d in refused)
    taken = [d for d in fusion.decisions if d.accepted]
    assert all(d.score > 0 for d in taken)


def test_gate_and_up_left_apart_run_as_a_glu_kernel(canonical, fusion, layers):
    """Unmerged gate and up (repack merges only weights of one type) leave SiLU * Mul to the
    glu kind; merged, the Linear's GLU epilogue takes them and no glu group is left."""
    apart = fuse(canonical)
    glus = [g for g in apart.groups if g.kind == "glu"]
    assert len(glus) == layers
    for g in glus:
        assert g.anchor.op == "hipc::SiLU" and [n.op for n in g.epilogue] == ["Mul"]
        up = next(v for v in g.epilogue[0].inputs if v != g.anchor.outputs[0])
        gate = g.anchor.inputs[0]
        assert {canonical.producer(v).op for v in (gate, up)} == {"hipc::Linear"}
    assert not [g for g in fusion.groups if g.kind == "glu"]


def _norm_read_twice() -> Graph:
    """RMSNorm whose output two Linears read: the norm cannot be either one's prologue."""
    import numpy as np

    from hipc.compiler.ir import Constant

    g = Graph("twice")
    x = TensorType("float32", ("tokens", 8))
    g.add_input("x", x)
    g.add_initializer("s", Constant(np.ones(8, np.float32)), TensorType("float32", (8,)))
    for w in ("w1", "w2"):
        g.add_initializer(w, Constant(np.ones((4, 8), np.float32)), TensorType("float32", (4, 8)))
    g.add_node(
        Node("norm", "RMSNormalization", ("x", "s"), ("xn",), {"epsilon": 1e-5, "axis": -1}), [x]
    )
    y = TensorType("float32", ("tokens", 4))
    g.add_node(Node("a", "Linear", ("xn", "w1"), ("ya",), domain="hipc"), [y])
    g.add_node(Node("b", "Linear", ("xn", "w2"), ("yb",), domain="hipc"), [y])
    g.add_node(Node("sum", "Add", ("ya", "yb"), ("z",)), [y])
    g.outputs = ["z"]
    return verify(g)


def test_a_shared_norm_is_refused_with_its_readers():
    f = fuse(_norm_read_twice())
    prologue = [d for d in f.decisions if d.role == "prologue:rmsnorm"]
    assert prologue and not any(d.accepted for d in prologue)
    assert "also read by" in prologue[0].reason
    assert [g.kind for g in f.groups].count("rmsnorm") == 1


def test_an_op_no_kernel_covers_is_a_clear_error():
    g = Graph("lonely")
    t = TensorType("float32", ("tokens", 4))
    g.add_input("x", t)
    g.add_node(Node("sig", "Sigmoid", ("x",), ("y",)), [t])
    g.outputs = ["y"]
    with pytest.raises(FusionError, match="'sig' \\(Sigmoid\\)"):
        fuse(verify(g))


def test_a_new_kind_is_one_registration(monkeypatch):
    """fuse and select know kinds only through the registry: a kind added there anchors
    groups, proposes fusions, and selects, with no change to either pass."""
    from hipc.compiler import kernels
    from hipc.compiler.kernels.base import KernelKind, Params, SelectedKernel
    from hipc.compiler.passes.select import select_kernels

    class GateParams(Params):
        def tag(self) -> str:
            return "gate"

    class Gate(KernelKind):
        name = "gate"
        anchors = frozenset({"Sigmoid"})
        roles = frozenset({"epilogue:scale"})

        def propose(self, graph, n, p):
            user = p.only_user(n.outputs[0])
            if user is not None and user.op == "Mul":
                p.propose(n, user, "epilogue:scale", n.outputs[0])

        def select(self, graph, grp):
            refs = {"x": ("act", grp.anchor.inputs[0]), "y": ("act", grp.epilogue[-1].outputs[0])}
            return SelectedKernel(grp.name, grp.node_names, self, GateParams(), refs)

    kind = Gate()
    monkeypatch.setitem(kernels.BY_ANCHOR, "Sigmoid", kind)
    monkeypatch.setitem(kernels.BY_NAME, "gate", kind)
    g = Graph("gated")
    t = TensorType("float32", ("tokens", 4))
    g.add_input("x", t)
    g.add_node(Node("sig", "Sigmoid", ("x",), ("s",)), [t])
    g.add_node(Node("mul", "Mul", ("s", "x"), ("y",)), [t])
    g.outputs = ["y"]
    f = fuse(verify(g))
    assert [(grp.kind, grp.node_names) for grp in f.groups] == [("gate", ["sig", "mul"])]
    assert f.groups[0].roles == {"mul": "epilogue:scale"}
    (k,) = select_kernels(f)
    assert k.kind is kind and k.fn.startswith("gate_gate_") and k.refs["y"] == ("act", "y")
