"""moe: a sparse layer's routed experts, reading only the experts its tokens chose.

Anchors on hipc::Experts. Takes its hipc::MoERouter as a prologue (the expert ids and
weights never leave the kernel) and a residual Add as its epilogue (the residual stream
updated in place). CPU: templates/cpu/moe.cpp.j2 over hipc_cpu_moe.h: routing as
torch.topk orders ties, tokens grouped by expert, three matmuls per routed expert over
its tokens (decode: k GEMVs of each; prefill: one GEMM per routed expert). No GPU kernel
yet: a GPU target stops with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hipc.compiler.codegen.environment import WEIGHT_SUFFIX
from hipc.compiler.ir import Graph, Node
from hipc.compiler.kernels.base import (
    CPU_INDENT,
    FusionError,
    KernelKind,
    Params,
    SelectedKernel,
    Signature,
)

if TYPE_CHECKING:
    from hipc.compiler.codegen.bindings import Binder
    from hipc.compiler.passes.fuse import FusedGroup, Proposals

# bytes of one row of `n` inputs per storage type (GGUF blocks of 32)
_BLOCK = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
_DENSE = {"float32": 4, "float16": 2, "bfloat16": 2}


def row_bytes(wtype: str, n: int) -> int:
    if wtype in _BLOCK:
        return n // 32 * _BLOCK[wtype]
    return n * _DENSE[wtype]


@dataclass(frozen=True)
class MoEParams(Params):
    wtype: str  # the experts' storage type (all three alike)
    E: int  # experts
    top_k: int  # experts per token
    H: int  # hidden width (the experts' input and output)
    F: int  # an expert's intermediate width
    normalize: bool  # renormalise the routed weights
    fused_gate_up: bool  # gate and up as one [2F, H] block per expert (HF transformers >= 5)
    residual: bool

    def tag(self) -> str:
        return f"{self.wtype}_e{self.E}k{self.top_k}_{self.H}x{self.F}"


CPU = Signature.parse("""
int T, const float* x, const float* logits, int ldl, const void* gate, const void* up,
const void* down, const float* res, float* y
""")


class MoE(KernelKind):
    name = "moe"
    anchors = frozenset({"hipc::Experts"})
    roles = frozenset({"prologue:router", "epilogue:residual"})
    cpu_signature = CPU

    def propose(self, graph: Graph, n: Node, p: Proposals) -> None:
        router = graph.producer(n.inputs[1])
        if router is not None and router.op == "hipc::MoERouter":
            others = [u.name for o in router.outputs for u in p.users(o) if u is not n]
            why = f"its routes are also read by {', '.join(others)}" if others else None
            p.propose(n, router, "prologue:router", router.outputs[1], why, side="prologue")
        user = p.only_user(n.outputs[0])
        if user is not None and user.op == "Add":
            p.propose(n, user, "epilogue:residual", n.outputs[0])
        elif user is not None:
            p.propose(
                n, user, "epilogue", n.outputs[0], f"no {user.op} epilogue in the moe kernels"
            )

    def select(self, g: Graph, grp: FusedGroup) -> SelectedKernel:
        ex = grp.anchor
        x, _, _, *ws = ex.inputs
        router = grp.node_with_role("prologue:router")
        if router is None:
            raise FusionError(
                f"{grp.name}: the experts kernel routes its tokens itself, "
                "but its MoERouter could not join it"
            )
        dtypes = {g.values[w].dtype for w in ws}
        if len(dtypes) != 1:
            raise FusionError(f"{grp.name}: expert weights in mixed types {sorted(dtypes)}")
        E, H, F = (int(d) for d in g.values[ws[-1]].shape)
        fused = len(ws) == 2
        refs: dict[str, Any] = {
            "x": ("act", x),
            "logits": ("act", router.inputs[0]),
            "gate": ("weight", ws[0]),
            "up": ("weight", ws[0] if fused else ws[1]),
            "down": ("weight", ws[-1]),
            "res": ("none", None),
        }
        y = ex.outputs[0]
        if (add := grp.node_with_role("epilogue:residual")) is not None:
            y = add.outputs[0]
            refs["res"] = ("act", next(i for i in add.inputs if i != ex.outputs[0]))
        refs["y"] = ("act", y)
        params = MoEParams(
            wtype=dtypes.pop(),
            E=E,
            top_k=int(router.attrs["top_k"]),
            H=H,
            F=F,
            normalize=bool(router.attrs.get("normalize")),
            fused_gate_up=fused,
            residual=add is not None,
        )
        return SelectedKernel(grp.name, grp.node_names, self, params, refs)

    def cpu_kernel(self, k: SelectedKernel, activations: str) -> tuple[str, dict[str, Any]]:
        p: MoEParams = k.params
        if p.wtype not in _BLOCK and p.wtype not in _DENSE:
            kinds = ", ".join([*_DENSE, *_BLOCK])
            raise FusionError(
                f"{k.refs['gate'][1]}: expert weight type {p.wtype} has no CPU MoE kernel "
                f"(supported: {kinds})"
            )
        ws = WEIGHT_SUFFIX[p.wtype]
        in_row = row_bytes(p.wtype, p.H)
        return "cpu/moe.cpp.j2", dict(
            mm=("a16_" if activations == "int16" else "") + ws,
            params=CPU.render(CPU_INDENT),
            in_row_bytes=in_row,
            gate_stride=(2 if p.fused_gate_up else 1) * p.F * in_row,
            down_stride=p.H * row_bytes(p.wtype, p.F),
        )

    def cpu_call(self, k: SelectedKernel, b: Binder) -> dict[str, Any]:
        p: MoEParams = k.params
        r = k.refs
        if b.ld(r["x"][1]) != p.H:
            raise FusionError(f"{k.group}: input rows are strided ({b.ld(r['x'][1])} != {p.H})")
        return {
            "T": b.int("T"),
            "x": b.act(r["x"][1]),
            "logits": b.act(r["logits"][1]),
            "ldl": b.int(b.ld(r["logits"][1])),
            "gate": b.ref(r["gate"]),
            "up": b.ref(r["up"]),
            "down": b.ref(r["down"]),
            "res": b.ref(r["res"]),
            "y": b.act(r["y"][1]),
        }


KIND = MoE()
