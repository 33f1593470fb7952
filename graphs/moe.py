"""Mixture-of-Experts families as IR graphs: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE.

The Llama decoder (attention unchanged, OLMoE's whole-projection q/k norm and q/k/v
clamp are config switches there) with the feed-forward block of the sparse layers
replaced by:

  logits = h Wrouter                                   (ordinary Linear, [tokens, E])
  ids, w = MoERouter(logits)                           softmax, top-k, [renormalise]
  y      = Experts(h, ids, w, Wgate, Wup, Wdown)       sum_j w_j down_j(silu(gate_j h) * up_j h)
  y     += sigmoid(h Wsg) * down_s(silu(gate_s h) * up_s h)    (Qwen2-MoE's shared expert)

Layers outside `moe_layers` (Qwen's mlp_only_layers / decoder_sparse_step) keep the
dense MLP. Expert weights are 3-D [E, out, in], stacked lazily from HF's per-expert
tensors or read as GGUF stores them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hipc.compiler.ir import Graph
from hipc.graphs.blocks import gated_mlp
from hipc.graphs.builder import GraphBuilder
from hipc.graphs.config import ModelConfig
from hipc.graphs.llama import build_llama, dense_mlp
from hipc.graphs.model import Model


def moe_mlp(b: GraphBuilder, model: Model, i: int, h: str) -> str:
    cfg = model.config
    if i not in cfg.moe_layers:
        return dense_mlp(b, model, i, h)
    p = f"l{i}."
    H, E = cfg.hidden_size, cfg.num_experts
    logits = b.linear(h, model.weight("router", i, (E, H)), p + "router")
    route = {"top_k": cfg.experts_per_token, "normalize": int(cfg.norm_topk_prob)}
    ids = b.op("MoERouter", [logits], p + "moe.route", route, domain="hipc", n_outputs=2)
    weights = f"{p}moe.route.1"
    experts = model.experts(i)
    roles = ("gate", "up", "down") if "gate" in experts else ("gate_up", "down")
    stacked = [b.weight(experts[r]) for r in roles]
    y = b.op("Experts", [h, ids, weights, *stacked], p + "moe", domain="hipc")
    if cfg.shared_expert_intermediate_size and model.has("shared_gate", i):
        width = cfg.shared_expert_intermediate_size
        roles3 = ("shared_gate", "shared_up", "shared_down")
        shared = gated_mlp(b, model, i, h, roles3, width, p + "shared.")
        y = b.op("Add", [y, _shared_gate(b, model, i, h, shared)], p + "moe.shared")
    return y


def _shared_gate(b: GraphBuilder, model: Model, i: int, h: str, shared: str) -> str:
    """sigmoid(h . w) * shared, w stored [1, H] (HF) or [H] (GGUF converters), read as the
    one row it is (a WeightRef of shape [1, H]), so it merges with the router's rows."""
    H = model.config.hidden_size
    p = f"l{i}.shared."
    name = model.tensor_name("shared_expert_gate", i)
    stored = model.source.entry(name)[1] if model.source.has(name) else (1, H)
    ref = model.weight("shared_expert_gate", i, stored if stored == (H,) else (1, H))
    w = b.weight(dataclasses.replace(ref, shape=(1, H)))
    wt = b.op("Transpose", [w], f"{ref.name}.T", {"perm": [1, 0]})
    gate = b.op("MatMul", [h, wt], p + "expert_gate")  # [tokens, 1]
    return b.op("Mul", [b.op("Sigmoid", [gate], p + "expert_gate.sigmoid"), shared], p + "scaled")


def build_moe(model: Model, max_ctx: int) -> Graph:
    return build_llama(model, max_ctx, mlp=moe_mlp)


def moe_summary(cfg: ModelConfig, parameters: int) -> dict[str, Any]:
    """Experts and the parameters one token reads (`parameters` counts every weight once)."""
    per_expert = 3 * cfg.expert_intermediate_size * cfg.hidden_size
    idle = len(cfg.moe_layers) * (cfg.num_experts - cfg.experts_per_token) * per_expert
    return {
        "experts": cfg.num_experts,
        "active_experts": cfg.experts_per_token,
        "sparse_layers": len(cfg.moe_layers),
        "shared_expert": cfg.shared_expert_intermediate_size > 0,
        "active_parameters": parameters - idle,
    }
