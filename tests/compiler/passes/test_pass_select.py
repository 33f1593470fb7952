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
    per_layer = [lt.kernel.fn for lt in launches[1:-1]]
    assert len(per_layer) == 5 * layers
    assert per_layer[:5] == per_layer[5:10]  # equal shapes: one rendered function each
    assert len(set(per_layer[:5])) == 5


def test_bindings_name_graph_values(selected):
    graph, launches = selected
    for lt in launches:
        for name, (kind, ref) in lt.args.items():
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
    p = qkv.kernel.param_dict
    assert (p["N"], p["K"]) == tuple(graph.values[qkv.args["w"][1]].shape)
    assert p["norm_eps"] > 0 and p["epilogue"] == "none"
    assert o.kernel.param_dict["epilogue"] == "residual" and o.args["res"][0] == "act"
    assert up.kernel.param_dict["epilogue"] == "glu"
    assert att.args["k_cache"][0] == "state" and att.args["pos"] == ("input", "positions")


def test_weight_order_is_first_use(selected):
    _, launches = selected
    order = weight_order(launches)
    assert len(order) == len(set(order))
    seen = []
    for lt in launches:
        for kind, ref in lt.args.values():
            if kind == "weight" and ref not in seen:
                seen.append(ref)
    assert order == seen
