"""embedding: out[t, :] = W[ids[t], :] as float32, rows dequantized on read.

Anchors on hipc::Embedding; fuses nothing. One kernel on every target, the same for
decode and prefill (templates/cpu/embedding.cpp.j2, templates/hip/embedding.hip.j2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hipc.compiler.codegen.environment import WEIGHT_SUFFIX
from hipc.compiler.ir import Graph
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
    from hipc.compiler.passes.fuse import FusedGroup


@dataclass(frozen=True)
class EmbeddingParams(Params):
    wtype: str  # the table's storage type
    K: int  # row width
    V: int  # rows (the vocabulary)

    def tag(self) -> str:
        return f"{self.wtype}_{self.K}"


CPU = Signature.parse("int T, const int64_t* ids, const void* w, float* out")
GPU = Signature.parse("const long long* __restrict__ ids, const void* __restrict__ W, float* out")
GPU_BLOCK = 256


class Embedding(KernelKind):
    name = "embedding"
    anchors = frozenset({"hipc::Embedding"})
    roles = frozenset()
    cpu_signature = CPU

    def select(self, g: Graph, grp: FusedGroup) -> SelectedKernel:
        emb = grp.anchor
        w, ids = emb.inputs
        V, K = (int(d) for d in g.values[w].shape)
        params = EmbeddingParams(wtype=g.values[w].dtype, K=K, V=V)
        refs = {"w": ("weight", w), "ids": ("input", ids), "out": ("act", emb.outputs[0])}
        return SelectedKernel(grp.name, grp.node_names, self, params, refs)

    def cpu_kernel(self, k: SelectedKernel, activations: str) -> tuple[str, dict[str, Any]]:
        ws = weight_suffix(k, "CPU")
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
