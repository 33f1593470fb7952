"""rmsnorm: a norm no other kernel absorbed.

Anchors on RMSNormalization so that a norm is a group of its own until a Linear takes it as
a prologue (or attention as a per-head feeder). It proposes the residual Add before it and
refuses it (no kernel applies a residual-add prologue; the Add goes to the Linear before
it). A norm left alone (its output read by several kernels: a MoE layer's router, experts
and shared expert) is its own kernel: templates/cpu/rmsnorm.cpp.j2 on the CPU,
templates/hip/rmsnorm.hip.j2 on GPUs (a block per token, decode and prefill alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from hipc.compiler.ir import Graph, Node
from hipc.compiler.kernels.base import (
    CPU_INDENT,
    GpuKernel,
    KernelKind,
    Params,
    SelectedKernel,
    Signature,
)

if TYPE_CHECKING:
    from hipc.compiler.codegen.bindings import Binder
    from hipc.compiler.codegen.hip import GpuProgramBuilder
    from hipc.compiler.passes.fuse import FusedGroup, Proposals


@dataclass(frozen=True)
class RmsNormParams(Params):
    H: int  # row width
    eps: float

    def tag(self) -> str:
        return str(self.H)


CPU = Signature.parse("int T, const float* x, int ldx, const float* w, float* y, int ldy")
GPU = Signature.parse("const float* x, int ldx, const float* __restrict__ w, float* y, int ldy")


class RmsNorm(KernelKind):
    name = "rmsnorm"
    anchors = frozenset({"RMSNormalization"})
    roles = frozenset()
    cpu_signature = CPU
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

    def select(self, g: Graph, grp: FusedGroup) -> SelectedKernel:
        n = grp.anchor
        x, w = n.inputs[0], n.inputs[1]
        params = RmsNormParams(H=int(g.values[x].shape[-1]), eps=float(n.attrs["epsilon"]))
        refs: dict[str, Any] = {"x": ("act", x), "w": ("weight", w), "y": ("act", n.outputs[0])}
        return SelectedKernel(grp.name, grp.node_names, self, params, refs)

    def cpu_kernel(self, k: SelectedKernel, activations: str) -> tuple[str, dict[str, Any]]:
        return "cpu/rmsnorm.cpp.j2", dict(params=CPU.render(CPU_INDENT))

    def cpu_call(self, k: SelectedKernel, b: Binder) -> dict[str, Any]:
        r = k.refs
        return {
            "T": b.int("T"),
            "x": b.act(r["x"][1]),
            "ldx": b.int(b.ld(r["x"][1])),
            "w": b.ref(r["w"]),
            "y": b.act(r["y"][1]),
            "ldy": b.int(b.ld(r["y"][1])),
        }

    def gpu(self, k: SelectedKernel, b: Binder, g: GpuProgramBuilder) -> None:
        r = k.refs
        ctx = dict(nodes=k.nodes, params=GPU.render(0), **k.params.context())
        fn = g.kernel(GpuKernel(k.fn, "rmsnorm", ctx, [], 256))
        args = {
            "x": b.act(r["x"][1]),
            "ldx": b.int(b.ld(r["x"][1])),
            "w": b.ref(r["w"]),
            "y": b.act(r["y"][1]),
            "ldy": b.int(b.ld(r["y"][1])),
        }
        for step in ("decode", "prefill"):
            g.launch(step, k.group, fn, ["T"], [256], GPU, args, overlap=step == "decode")


KIND = RmsNorm()
