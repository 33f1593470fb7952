"""embedding: out[t, :] = W[ids[t], :] [* scale] as float32, rows dequantized on read.

Anchors on hipc::Embedding; fuses a Mul by a constant scalar after it (Gemma's sqrt(hidden)). One kernel on every target, the same for
decode and prefill (templates/cpu/embedding.cpp.j2, templates/hip/embedding.hip.j2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hipc.compiler.codegen.environment import WEIGHT_SUFFIX
from hipc.compiler.ir import Constant, Graph, Node
from hipc.compiler.kernels.base import (
    GpuKernel,
    KernelKind,
    Params,
    SelectedKernel,
    Signature,
    weight_suffix,
)

if TYPE_CHECKING:
    from hipc.compiler.codegen.bindings import Binder
    from hipc.compiler.codegen.hip import GpuProgramBuilder
    from hipc.compiler.passes.fuse import FusedGroup, Proposals


@dataclass(frozen=True)
class EmbeddingParams(Params):
    wtype: str  # the table's storage type
    K: int  # row width
    V: int  # rows (the vocabulary)
    scale: float = 1.0  # the rows' multiplier (a switch: left out of the name at 1.0)
    layout: str = "gguf"  # the table's blocks: as in the file, or "lanes" (passes/lanes.py)

    def tag(self) -> str:
        return f"{self.wtype}_{self.K}" + ("_lanes" if self.layout == "lanes" else "")


CPU = Signature.parse("int T, const int64_t* ids, const void* w, float* out")
GPU = Signature.parse("const long long* __restrict__ ids, const void* __restrict__ W, float* out")
GPU_BLOCK = 256


class Embedding(KernelKind):
    name = "embedding"
    anchors = frozenset({"hipc::Embedding"})
    roles = frozenset({"epilogue:scale"})
    cpu_signature = CPU
    gpu_lacks = frozenset({"scale"})

    def propose(self, graph: Graph, n: Node, p: Proposals) -> None:
        user = p.only_user(n.outputs[0])
        if user is not None and user.op == "Mul":
            other = [i for i in user.inputs if i != n.outputs[0]]
            scalar = len(other) == 1 and graph.values[other[0]].shape == ()
            constant = scalar and isinstance(graph.initializers.get(other[0]), Constant)
            why = None if constant else "not a constant scalar"
            p.propose(n, user, "epilogue:scale", n.outputs[0], why)

    def select(self, g: Graph, grp: FusedGroup) -> SelectedKernel:
        emb = grp.anchor
        w, ids = emb.inputs
        V, K = (int(d) for d in g.values[w].shape)
        scale, out = 1.0, emb.outputs[0]
        if (mul := grp.node_with_role("epilogue:scale")) is not None:
            factor = next(i for i in mul.inputs if i != out)
            scale, out = float(g.initializers[factor].array.reshape(())), mul.outputs[0]
        params = EmbeddingParams(wtype=g.values[w].dtype, K=K, V=V, scale=scale)
        refs = {"w": ("weight", w), "ids": ("input", ids), "out": ("act", out)}
        return SelectedKernel(grp.name, grp.node_names, self, params, refs)

    def cpu_kernel(self, k: SelectedKernel, activations: str) -> tuple[str, dict[str, Any]]:
        ws = ("lanes_" if k.params.layout == "lanes" else "") + weight_suffix(k, "CPU")
        return "cpu/embedding.cpp.j2", dict(wsuffix=ws, mm=ws, params=CPU.render(0))

    def cpu_call(self, k: SelectedKernel, b: Binder) -> dict[str, Any]:
        r = k.refs
        return {"T": b.int("T"), "ids": b.ref(r["ids"]), "w": b.ref(r["w"]), "out": b.ref(r["out"])}

    def gpu(self, k: SelectedKernel, b: Binder, g: GpuProgramBuilder) -> None:
        weight_suffix(k, "HIP")
        fn = g.kernel(gpu_kernel(f"{k.fn}_embed", k.params, g.target.wave, k.nodes))
        args = {"ids": b.ref(k.refs["ids"]), "W": b.ref(k.refs["w"]), "out": b.ref(k.refs["out"])}
        for step in ("decode", "prefill"):
            g.launch(step, k.group, fn, ["T"], [GPU_BLOCK], GPU, args, overlap=step == "decode")


def gpu_kernel(fn: str, p: EmbeddingParams, wave: int, nodes: list[str]) -> GpuKernel:
    ctx = dict(nodes=nodes, wave=wave, wsuffix=WEIGHT_SUFFIX[p.wtype], params=GPU.render(0),
               **p.to_json())  # fmt: skip
    return GpuKernel(fn, "embedding", ctx, [], GPU_BLOCK)


KIND = Embedding()
