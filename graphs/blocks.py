"""Pieces every decoder family is built from: the norm, self-attention over the KV cache,
and the gated MLP. Each family's builder (llama.py, gemma.py) strings them together;
the config record's switches pick the variants (q/k norm, bias, activation, soft-cap).
"""

from __future__ import annotations

import numpy as np

from hipc.compiler.ir import TensorType
from hipc.graphs.builder import GraphBuilder
from hipc.graphs.model import Model


def rms_norm(
    b: GraphBuilder, model: Model, x: str, role: str, layer: int | None, name: str, dim: int
) -> str:
    """RMSNorm with the file's weight; Gemma's norms scale by (1 + w), spelled as an Add
    on the weight (a weight-only subgraph: executors and canonicalize fold it)."""
    cfg = model.config
    scale = b.weight(model.weight(role, layer, (dim,)))
    if cfg.norm_weight_offset:
        offset = b.constant("norm.offset", np.array(cfg.norm_weight_offset, dtype=np.float32))
        scale = b.op("Add", [scale, offset], f"{name}.scale")
    return b.op("RMSNormalization", [x, scale], name, {"epsilon": cfg.rms_norm_eps, "axis": -1})


def self_attention(
    b: GraphBuilder, model: Model, i: int, h: str, pos: str, rope: tuple[str, str]
) -> str:
    """q/k/v projections (+bias), [q/k norm], RoPE, cached attention, output projection.

    Adds layer i's KV cache as two graph states; `rope` names the cos/sin tables this
    layer rotates with. Returns the output projection's value.
    """
    cfg, g = model.config, b.g
    H, D, NH, NKV = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    p = f"l{i}."

    def w(role: str, *shape: int):
        return model.weight(role, i, tuple(shape))

    kc = g.add_state(f"kv.{i}.k", TensorType("float32", ("max_ctx", NKV, D)))
    vc = g.add_state(f"kv.{i}.v", TensorType("float32", ("max_ctx", NKV, D)))
    bias = cfg.attention_bias
    gate = None
    if cfg.attn_output_gate:
        # Qwen3-Next/3.5: each head's rows are its query then its output gate
        qg = b.linear(h, w("q", NH * 2 * D, H), p + "qg")
        qg = b.reshape(qg, [-1, NH, 2 * D], p + "qg.heads")
        q = b.op("Split", [qg], p + "qg.split", {"axis": -1, "split": [D, D]}, n_outputs=2)
        gate = b.reshape(f"{p}qg.split.1", [-1, NH * D], p + "attn.gate")
        q = b.reshape(q, [-1, NH * D], p + "q")
    else:
        q = b.linear(h, w("q", NH * D, H), p + "q", w("q_bias", NH * D) if bias else None)
    k = b.linear(h, w("k", NKV * D, H), p + "k", w("k_bias", NKV * D) if bias else None)
    v = b.linear(h, w("v", NKV * D, H), p + "v", w("v_bias", NKV * D) if bias else None)
    if cfg.qk_norm_full:  # OLMoE: one norm over all heads
        q = rms_norm(b, model, q, "q_norm", i, p + "q_norm", NH * D)
        k = rms_norm(b, model, k, "k_norm", i, p + "k_norm", NKV * D)
    if cfg.clip_qkv is not None:
        lo = b.constant("clip_qkv.min", np.array(-cfg.clip_qkv, dtype=np.float32))
        hi = b.constant("clip_qkv.max", np.array(cfg.clip_qkv, dtype=np.float32))
        q, k, v = (b.op("Clip", [t, lo, hi], f"{t}.clip") for t in (q, k, v))
    q = b.reshape(q, [-1, NH, D], p + "q.heads")
    k = b.reshape(k, [-1, NKV, D], p + "k.heads")
    v = b.reshape(v, [-1, NKV, D], p + "v.heads")
    if cfg.qk_norm and not cfg.qk_norm_full:
        q = rms_norm(b, model, q, "q_norm", i, p + "q_norm", D)
        k = rms_norm(b, model, k, "k_norm", i, p + "k_norm", D)
    cos, sin = rope
    rot = {"interleaved": int(cfg.rope_interleaved), "rotary_embedding_dim": cfg.rope_dim}
    q = b.op("RotaryEmbedding", [q, cos, sin, pos], p + "q.rope", rot)
    k = b.op("RotaryEmbedding", [k, cos, sin, pos], p + "k.rope", rot)
    attn = {"scale": cfg.attention_scale, "sliding_window": cfg.window(i), "layer": i}
    if cfg.attn_softcap:
        attn["softcap"] = cfg.attn_softcap
    a = b.op("CachedAttention", [q, k, v, pos, kc, vc], p + "attn", attn, domain="hipc")
    a = b.reshape(a, [-1, NH * D], p + "attn.flat")
    if gate is not None:
        a = b.op("Mul", [a, b.op("Sigmoid", [gate], p + "attn.gate.sigmoid")], p + "attn.gated")
    o_bias = w("o_bias", H) if model.has("o_bias", i) else None
    return b.linear(a, w("o", H, NH * D), p + "o", o_bias)


def gated_mlp(
    b: GraphBuilder,
    model: Model,
    i: int,
    h: str,
    roles: tuple[str, str, str] = ("gate", "up", "down"),
    width: int | None = None,
    p: str | None = None,
) -> str:
    """down(act(gate(h)) * up(h)) with act = SiLU (SwiGLU) or tanh-GELU (Gemma's GeGLU), the
    weights of `roles` (gate, up, down) in layer i; `width`: the intermediate size (MoE
    shared experts have their own), `p`: the node name prefix."""
    cfg = model.config
    H, F = cfg.hidden_size, width or cfg.intermediate_size
    p = f"l{i}." if p is None else p
    gate = b.linear(h, model.weight(roles[0], i, (F, H)), p + "gate")
    up = b.linear(h, model.weight(roles[1], i, (F, H)), p + "up")
    if cfg.hidden_act == "gelu_tanh":
        act = b.op("Gelu", [gate], p + "gate.gelu", {"approximate": "tanh"})
    else:
        act = b.op("Mul", [gate, b.op("Sigmoid", [gate], p + "gate.sigmoid")], p + "gate.silu")
    m = b.op("Mul", [act, up], p + "ffn.mul")
    return b.linear(m, model.weight(roles[2], i, (H, F)), p + "down")
