"""glu: act(gate) * up where no Linear could take it as its epilogue.

A gated MLP's gate and up projections merge into one Linear whose GLU epilogue writes only
the product (passes/repack.py), but only when both weights are stored in one type: a kernel
reads one block format. A file whose quantization recipe gave them different types (gate
Q4_K beside up Q5_K, say) leaves two Linears, the activation and the Mul; this kind is those
two ops as one elementwise kernel. It anchors on the activation (SiLU, or Gelu with the tanh
approximation) and takes the Mul of its output by another Linear's output as its epilogue.
templates/cpu/glu.cpp.j2 on the CPU, templates/hip/glu.hip.j2 on GPUs (a block per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hipc.compiler.ir import Graph, Node
from hipc.compiler.kernels.base import (
    CPU_INDENT,
    FusionError,
    GpuKernel,
    KernelKind,
    Params,
    SelectedKernel,
    Signature,
)
from hipc.compiler.kernels.linear import GLU_ACTIVATIONS, glu_activation

if TYPE_CHECKING:
    from hipc.compiler.codegen.bindings import Binder
    from hipc.compiler.codegen.hip import GpuProgramBuilder
    from hipc.compiler.passes.fuse import FusedGroup, Proposals


@dataclass(frozen=True)
class GluParams(Params):
    F: int  # row width
    act: str  # "silu" | "gelu_tanh"

    def tag(self) -> str:
        return f"{self.act}_{self.F}"


CPU = Signature.parse("int T, const float* g, int ldg, const float* u, int ldu, float* y, int ldy")
GPU = Signature.parse(
    "const float* __restrict__ g, int ldg, const float* __restrict__ u, int ldu, float* y, int ldy"
)


class Glu(KernelKind):
    name = "glu"
    anchors = frozenset(GLU_ACTIVATIONS)
    roles = frozenset({"epilogue:mul"})
    cpu_signature = CPU

    def propose(self, graph: Graph, n: Node, p: Proposals) -> None:
        mul = p.only_user(n.outputs[0])
        if mul is None or mul.op != "Mul":
            return
        up = next((i for i in mul.inputs if i != n.outputs[0]), None)
        why = None
        if glu_activation(n) is None:
            why = f"no GLU kernel with {n.op} {dict(n.attrs)}"
        elif up is None or any(
            (src := graph.producer(v)) is None or src.op != "hipc::Linear"
            for v in (n.inputs[0], up)
        ):
            why = "only act(gate) * up of two Linears' rows fuses as a GLU"
        elif graph.values[up].shape != graph.values[n.outputs[0]].shape:
            why = "gate and up rows differ in width"
        p.propose(n, mul, "epilogue:mul", n.outputs[0], why)

    def select(self, g: Graph, grp: FusedGroup) -> SelectedKernel:
        n = grp.anchor
        mul = grp.node_with_role("epilogue:mul")
        act = glu_activation(n)
        if mul is None or act is None:
            raise FusionError(f"no kernel for a lone {n.op} ({grp.name})")
        up = next(i for i in mul.inputs if i != n.outputs[0])
        params = GluParams(F=int(g.values[up].shape[-1]), act=act)
        refs: dict[str, Any] = {
            "g": ("act", n.inputs[0]),
            "u": ("act", up),
            "y": ("act", mul.outputs[0]),
        }
        return SelectedKernel(grp.name, grp.node_names, self, params, refs)

    def _bindings(self, k: SelectedKernel, b: Binder) -> dict[str, Any]:
        out = {}
        for name in ("g", "u", "y"):
            value = k.refs[name][1]
            out[name], out[f"ld{name}"] = b.act(value), b.int(b.ld(value))
        return out

    def cpu_kernel(self, k: SelectedKernel, activations: str) -> tuple[str, dict[str, Any]]:
        return "cpu/glu.cpp.j2", dict(params=CPU.render(CPU_INDENT))

    def cpu_call(self, k: SelectedKernel, b: Binder) -> dict[str, Any]:
        return {"T": b.int("T"), **self._bindings(k, b)}

    def gpu(self, k: SelectedKernel, b: Binder, g: GpuProgramBuilder) -> None:
        ctx = dict(nodes=k.nodes, params=GPU.render(0), **k.params.context())
        fn = g.kernel(GpuKernel(k.fn, "glu", ctx, [], 256))
        args = self._bindings(k, b)
        for step in ("decode", "prefill"):
            g.launch(step, k.group, fn, ["T"], [256], GPU, args, overlap=step == "decode")


KIND = Glu()
