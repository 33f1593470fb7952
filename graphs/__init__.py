"""Model-family builders: a loaded model's config -> IR graph."""

from __future__ import annotations

from collections.abc import Callable

from hipc.compiler.ir import Graph
from hipc.compiler.ir.verify import verify
from hipc.graphs.gemma import build_gemma
from hipc.graphs.hybrid import build_hybrid
from hipc.graphs.llama import build_llama
from hipc.graphs.model import Model, load_model
from hipc.graphs.moe import build_moe
from hipc.graphs.rope import max_context

BUILDERS: dict[str, Callable[[Model, int], Graph]] = {
    "llama": build_llama,
    "mistral": build_llama,
    "qwen2": build_llama,
    "qwen3": build_llama,
    "gemma2": build_gemma,
    "gemma3": build_gemma,
    "qwen3_moe": build_moe,
    "qwen2_moe": build_moe,
    "mixtral": build_moe,
    "olmoe": build_moe,
    "qwen3_next": build_hybrid,
    "qwen3_5": build_hybrid,
    "qwen3_5_moe": build_hybrid,
}


def build_graph(model: Model, max_ctx: int | None = None) -> Graph:
    """The verified IR graph of one decoder step for `model`, with a KV cache of max_ctx."""
    graph = BUILDERS[model.config.family](model, max_context(model.config, max_ctx))
    return verify(graph)


__all__ = ["Model", "build_graph", "load_model"]
