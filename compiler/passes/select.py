"""select_kernels: each fused group -> its kernel kind's parameters and argument bindings.

The kind that anchored the group (compiler/kernels) reads the roles fuse recorded and
returns a SelectedKernel: typed parameters (what the templates specialize on; equal ones
share one rendered function) and the logical bindings of its arguments to graph values
(activations, weights, states, step inputs), which the renderers resolve against the
memory plan.
"""

from __future__ import annotations

from hipc.compiler.kernels import BY_NAME
from hipc.compiler.kernels.base import SelectedKernel
from hipc.compiler.passes.fuse import Fusion, FusionError

__all__ = ["SelectedKernel", "select_kernels", "weight_order"]


def select_kernels(fusion: Fusion) -> list[SelectedKernel]:
    selected = []
    for grp in fusion.groups:
        try:
            selected.append(BY_NAME[grp.kind].select(fusion.graph, grp))
        except FusionError as e:
            # a group left without a kernel is usually a fusion refused upstream: say which
            why = [
                f"{d.group}: {d.reason}"
                for d in fusion.decisions
                if d.node == grp.name and not d.accepted
            ]
            if not why:
                raise
            raise FusionError(f"{e}; it could not fuse into {'; '.join(why)}") from None
    return selected


def weight_order(kernels: list[SelectedKernel]) -> list[str]:
    """Every weight the kernels read, in order of first use: the W[] order of all targets."""
    order: dict[str, None] = {}
    for k in kernels:
        for kind, ref in k.refs.values():
            if kind == "weight":
                order.setdefault(ref)
    return list(order)
