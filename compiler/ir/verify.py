"""The verifier: recompute every node's output types and check the graph is well formed.

Run between passes so a pass that breaks an invariant fails at that pass, with the
node named, instead of as wrong numbers three stages later.
"""

from __future__ import annotations

from hipc.compiler.ir.graph import Graph
from hipc.compiler.ir.ops import TYPE_RULES, TypeError_


class VerifyError(ValueError):
    pass


def verify(graph: Graph) -> Graph:
    defined = set(graph.inputs) | set(graph.states) | set(graph.initializers)
    for node in graph.nodes:
        rule = TYPE_RULES.get(node.op)
        if rule is None:
            raise VerifyError(f"node {node.name!r}: unknown op {node.op}")
        missing = [i for i in node.inputs if i not in defined]
        if missing:
            raise VerifyError(f"node {node.name!r}: inputs {missing} are not defined before use")
        try:
            expected = rule(node, [graph.values[i] for i in node.inputs], graph)
        except TypeError_ as e:
            raise VerifyError(str(e)) from None
        actual = [graph.values[o] for o in node.outputs]
        if expected != actual:
            raise VerifyError(
                f"node {node.name!r} ({node.op}): outputs typed {list(map(str, actual))}, "
                f"rule gives {list(map(str, expected))}"
            )
        defined.update(node.outputs)
    for out in graph.outputs:
        if out not in defined:
            raise VerifyError(f"graph output {out!r} is never produced")
    return graph
