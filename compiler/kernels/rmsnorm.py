"""rmsnorm: a norm no other kernel absorbed.

Anchors on RMSNormalization so that a norm is a group of its own until a Linear takes it as
a prologue (or attention as a per-head feeder). It proposes the residual Add before it and
refuses it (no kernel applies a residual-add prologue; the Add goes to the Linear before
it), and it has no kernel: a norm left alone is a FusionError naming it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from hipc.compiler.ir import Graph, Node
from hipc.compiler.kernels.base import KernelKind

if TYPE_CHECKING:
    from hipc.compiler.passes.fuse import Proposals


class RmsNorm(KernelKind):
    name = "rmsnorm"
    anchors = frozenset({"RMSNormalization"})
    roles = frozenset()
    refusals: ClassVar[dict[str, str]] = {
        "prologue:residual-add": (
            "the norm's kernel has no residual-add prologue; the Add goes to the Linear before it"
        )
    }

    def propose(self, graph: Graph, n: Node, p: Proposals) -> None:
        add = graph.producer(n.inputs[0])
        if add is not None and add.op == "Add":
            why = (
                None
                if p.only_user(add.outputs[0]) is not None
                else ("the residual stream is read again later")
            )
            p.propose(n, add, "prologue:residual-add", add.outputs[0], why, side="prologue")


KIND = RmsNorm()
