"""A tiny helper for Graph -> Graph passes: copy nodes across, replacing some.

Passes walk the old graph in order and emit into a new one; output types always come
from the op's type rule, so a pass cannot emit a node the verifier would reject.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hipc.compiler.ir import Graph, Initializer, Node, initializer_type
from hipc.compiler.ir.ops import TYPE_RULES


class Rewriter:
    def __init__(self, old: Graph) -> None:
        self.old = old
        self.new = old.copy()
        self.uses = Counter(i for n in old.nodes for i in n.inputs) + Counter(old.outputs)

    def keep_initializer(self, name: str, init: Initializer | None = None) -> str:
        """Carry an initializer into the new graph (or add a new one under `name`)."""
        if name not in self.new.initializers:
            init = self.old.initializers[name] if init is None else init
            self.new.add_initializer(name, init, initializer_type(init))
        return name

    def emit(
        self,
        op_type: str,
        inputs: list[str] | tuple[str, ...],
        outputs: list[str] | tuple[str, ...],
        name: str,
        attrs: dict[str, Any] | None = None,
        domain: str = "",
    ) -> Node:
        for i in inputs:
            if i in self.old.initializers:
                self.keep_initializer(i)
        node = Node(name, op_type, tuple(inputs), tuple(outputs), dict(attrs or {}), domain)
        types = TYPE_RULES[node.op](node, [self.new.values[i] for i in inputs], self.new)
        return self.new.add_node(node, types)

    def copy(self, node: Node) -> Node:
        return self.emit(
            node.op_type, node.inputs, node.outputs, node.name, dict(node.attrs), node.domain
        )

    def finish(self) -> Graph:
        """Drop nodes whose outputs nobody reads (repeatedly), and unused initializers."""
        g = self.new
        while True:
            used = {i for n in g.nodes for i in n.inputs} | set(g.outputs)
            dead = [n for n in g.nodes if not any(o in used for o in n.outputs)]
            if not dead:
                break
            g = _without(g, {n.name for n in dead})
        used = {i for n in g.nodes for i in n.inputs}
        for name in [k for k in g.initializers if k not in used]:
            del g.initializers[name]
            del g.values[name]
        return g


def _without(g: Graph, drop: set[str]) -> Graph:
    out = g.copy()
    for k, v in g.initializers.items():
        out.add_initializer(k, v, g.values[k])
    for n in g.nodes:
        if n.name not in drop:
            out.add_node(n, [g.values[o] for o in n.outputs])
    return out
