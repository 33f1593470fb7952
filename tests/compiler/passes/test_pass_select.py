"""select_kernels on its own: specializations, sharing, and argument bindings."""

from __future__ import annotations

import pytest

from hipc.compiler.passes.fuse import fuse
from hipc.compiler.passes.select import select_kernels, weight_order


@pytest.fixture(scope="module")
def selected(repacked):
    return repacked, select_kernels(fuse(repacked))


def test_layers_share_their_kernels(selected, layers):
    _, launches = selected
    per_layer = [lt.fn for lt in launches[1:-1]]
    assert len(per_layer) == 5 * layers
    assert per_layer[:5] == per_layer[5:10]  # equal shapes: one rendered function each
    assert len(set(per_layer[:5])) == 5


def test_bindings_name_graph_values(selected):
    graph, launches = selected
    for lt in launches:
        for name, (kind, ref) in lt.refs.items():
            if kind == "weight":
                assert ref in graph.initializers, (lt.group, name)
            elif kind == "state":
                assert ref in graph.states, (lt.group, name)
            elif kind == "input":
                assert ref in graph.inputs, (lt.group, name)
            elif kind == "act":
                assert ref in graph.values and ref not in graph.initializers, (lt.group, name)
            else:
                assert kind == "none" and ref is None


def test_linear_specialization_follows_the_fusion(selected):
    graph, launches = selected
    qkv, att, o, up, _down = launches[1:6]
    p = qkv.params
    assert tuple(graph.values[qkv.refs["w"][1]].shape) == (p.N, p.K)
    assert p.norm_eps > 0 and p.epilogue == "none"
    assert o.params.epilogue == "residual" and o.refs["res"][0] == "act"
    assert up.params.epilogue == "glu" and up.params.n_out == up.params.N // 2
    assert att.refs["k_cache"][0] == "state" and att.refs["pos"] == ("input", "positions")
    assert att.params.NH == 4 and att.params.NKV == 2


def test_weight_order_is_first_use(selected):
    _, launches = selected
    order = weight_order(launches)
    assert len(order) == len(set(order))
    seen = []
    for lt in launches:
        for kind, ref in lt.refs.values():
            if kind == "weight" and ref not in seen:
                seen.append(ref)
    assert order == seen


def test_signatures_order_the_bindings():
    from hipc.compiler.kernels.base import Signature

    sig = Signature.parse("const float* __restrict__ x, int T,\nfloat* y")
    assert [a.name for a in sig.args] == ["x", "T", "y"]
    assert sig.render(4) == "const float* __restrict__ x, int T,\n    float* y"
    assert sig.args[0].pointer_type == "const float*"
    assert sig.order({"y": 3, "x": 1, "T": 2}, "k") == [1, 2, 3]
    with pytest.raises(ValueError, match="do not match"):
        sig.order({"x": 1, "T": 2}, "k")


def test_every_kind_is_registered_once():
    from hipc.compiler.kernels import BY_ANCHOR, KINDS

    assert len({k.name for k in KINDS}) == len(KINDS)
    assert sum(len(k.anchors) for k in KINDS) == len(BY_ANCHOR)
