"""The Llama family as an IR graph: Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3 (and the
attention and dense layers of the MoE families, graphs/moe.py).

One decoder step over `tokens` new tokens at `positions`, reading and extending the
KV cache (a graph state per layer), producing logits for every token:

  x = embed[input_ids]
  per layer:  h = rmsnorm(x);  q,k,v = h Wq,Wk,Wv (+bias);  [q,k = rmsnorm per head]
              q,k = rope(q,k, positions);  a = attention(q, cache(k,v));  x += a Wo
              h = rmsnorm(x);  x += (silu(h Wgate) * h Wup) Wdown
  logits = rmsnorm(x) Wlm        (Wlm = embed when tied)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from hipc.compiler.ir import Graph, TensorType
from hipc.graphs.builder import GraphBuilder
from hipc.graphs.model import Model
from hipc.graphs.rope import cos_sin_tables

# (builder, model, layer, normed input) -> the MLP's output, added to the residual
MLPBuilder = Callable[[GraphBuilder, Model, int, str], str]


def swiglu(
    b: GraphBuilder, model: Model, i: int, h: str, roles: tuple[str, str, str], width: int, p: str
) -> str:
    """down(silu(h Wgate) * h Wup) with the weights of `roles` (gate, up, down) in layer i."""
    H = model.config.hidden_size
    gate = b.linear(h, model.weight(roles[0], i, (width, H)), p + "gate")
    up = b.linear(h, model.weight(roles[1], i, (width, H)), p + "up")
    act = b.op("Mul", [gate, b.op("Sigmoid", [gate], p + "gate.sigmoid")], p + "gate.silu")
    m = b.op("Mul", [act, up], p + "ffn.mul")
    return b.linear(m, model.weight(roles[2], i, (H, width)), p + "down")


def dense_mlp(b: GraphBuilder, model: Model, i: int, h: str) -> str:
    width = model.config.intermediate_size
    return swiglu(b, model, i, h, ("gate", "up", "down"), width, f"l{i}.")


def build_llama(model: Model, max_ctx: int, mlp: MLPBuilder = dense_mlp) -> Graph:
    """The decoder; `mlp` builds each layer's feed-forward block (MoE families swap it)."""
    cfg = model.config
    g = Graph(model.name)
    g.metadata.update(family=cfg.family, max_ctx=max_ctx)
    b = GraphBuilder(g)
    H, D, NH, NKV = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def w(role: str, layer: int | None, *shape: int):
        return model.weight(role, layer, tuple(shape))

    ids = g.add_input("input_ids", TensorType("int64", ("tokens",)))
    pos = g.add_input("positions", TensorType("int64", ("tokens",)))
    cos, sin = cos_sin_tables(cfg, max_ctx)
    cos = b.constant("rope.cos", cos)
    sin = b.constant("rope.sin", sin)
    embed = w("embed", None, cfg.vocab_size, H)
    x = b.op("Gather", [b.weight(embed), ids], "embed", {"axis": 0})

    def norm(v: str, role: str, layer: int | None, name: str, dim: int = H) -> str:
        return b.op(
            "RMSNormalization",
            [v, b.weight(w(role, layer, dim))],
            name,
            {"epsilon": cfg.rms_norm_eps, "axis": -1},
        )

    for i in range(cfg.num_layers):
        p = f"l{i}."
        kc = g.add_state(f"kv.{i}.k", TensorType("float32", ("max_ctx", NKV, D)))
        vc = g.add_state(f"kv.{i}.v", TensorType("float32", ("max_ctx", NKV, D)))
        h = norm(x, "attn_norm", i, p + "attn_norm")
        bias = cfg.attention_bias
        q = b.linear(h, w("q", i, NH * D, H), p + "q", w("q_bias", i, NH * D) if bias else None)
        k = b.linear(h, w("k", i, NKV * D, H), p + "k", w("k_bias", i, NKV * D) if bias else None)
        v = b.linear(h, w("v", i, NKV * D, H), p + "v", w("v_bias", i, NKV * D) if bias else None)
        if cfg.qk_norm_full:  # OLMoE: one norm over all heads
            q = norm(q, "q_norm", i, p + "q_norm", NH * D)
            k = norm(k, "k_norm", i, p + "k_norm", NKV * D)
        if cfg.clip_qkv is not None:
            lo = b.constant("clip_qkv.min", np.array(-cfg.clip_qkv, dtype=np.float32))
            hi = b.constant("clip_qkv.max", np.array(cfg.clip_qkv, dtype=np.float32))
            q, k, v = (b.op("Clip", [t, lo, hi], f"{t}.clip") for t in (q, k, v))
        q = b.reshape(q, [-1, NH, D], p + "q.heads")
        k = b.reshape(k, [-1, NKV, D], p + "k.heads")
        v = b.reshape(v, [-1, NKV, D], p + "v.heads")
        if cfg.qk_norm and not cfg.qk_norm_full:
            q = norm(q, "q_norm", i, p + "q_norm", D)
            k = norm(k, "k_norm", i, p + "k_norm", D)
        rope = {"interleaved": int(cfg.rope_interleaved), "rotary_embedding_dim": D}
        q = b.op("RotaryEmbedding", [q, cos, sin, pos], p + "q.rope", rope)
        k = b.op("RotaryEmbedding", [k, cos, sin, pos], p + "k.rope", rope)
        attn = {"scale": 1.0 / math.sqrt(D), "sliding_window": cfg.sliding_window or 0, "layer": i}
        a = b.op("CachedAttention", [q, k, v, pos, kc, vc], p + "attn", attn, domain="hipc")
        a = b.reshape(a, [-1, NH * D], p + "attn.flat")
        o_bias = w("o_bias", i, H) if model.has("o_bias", i) else None
        o = b.linear(a, w("o", i, H, NH * D), p + "o", o_bias)
        x = b.op("Add", [x, o], p + "attn.residual")
        h = norm(x, "ffn_norm", i, p + "ffn_norm")
        x = b.op("Add", [x, mlp(b, model, i, h)], p + "ffn.residual")

    h = norm(x, "norm", None, "final_norm")
    lm = embed if cfg.tie_word_embeddings else w("lm_head", None, cfg.vocab_size, H)
    logits = b.linear(h, lm, "logits")
    g.outputs.append(logits)
    return g
