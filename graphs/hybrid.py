"""Hybrid linear/full attention: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (text).

The Llama decoder with (1 + w) RMSNorms, where layers typed "full_attention" use gated
attention (q/k norms, partial RoPE, output * sigmoid(gate): graphs/blocks.py) and
"linear_attention" layers a Gated DeltaNet:

  qkv, z, b, a = h Wqkv, h Wz, h Wb, h Wa       (Qwen3-Next packs them per key head)
  qkv = silu(causal_conv1d(qkv))                depthwise, K taps, state: K - 1 inputs
  q, k, v = split(qkv);  q, k = l2norm(q), l2norm(k)
  beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
  o = gated_delta_rule(q, k, v, g, beta)        state: [value heads, dk, dv]
  out = (rmsnorm(o) * w * silu(z)) Wout         per value head

Feed-forward: dense SwiGLU (Qwen3.5) or routed experts plus a sigmoid-gated shared
expert (graphs/moe.py). Each linear layer adds two recurrent states (the conv window and
the delta-rule matrix), each full layer its KV cache.
"""

from __future__ import annotations

from typing import Any

from hipc.compiler.ir import Graph, TensorType
from hipc.graphs.blocks import self_attention
from hipc.graphs.builder import GraphBuilder
from hipc.graphs.config import ModelConfig
from hipc.graphs.llama import build_llama, dense_mlp
from hipc.graphs.model import Model
from hipc.graphs.moe import moe_mlp

# transformers' chunk for the prefill form (torch_chunk_gated_delta_rule)
DELTA_CHUNK = 64
# transformers' l2norm epsilon (fixed, not rms_norm_eps)
L2_EPS = 1e-6


def mixer(b: GraphBuilder, model: Model, i: int, h: str, pos: str, rope: tuple[str, str]) -> str:
    if model.config.is_linear(i):
        return gated_delta_net(b, model, i, h)
    return self_attention(b, model, i, h, pos, rope)


def _split(b: GraphBuilder, x: str, sizes: list[int], name: str) -> list[str]:
    b.op("Split", [x], name, {"axis": -1, "split": sizes}, n_outputs=len(sizes))
    return [f"{name}.{j}" for j in range(len(sizes))]


def _silu(b: GraphBuilder, x: str, name: str) -> str:
    return b.op("Mul", [x, b.op("Sigmoid", [x], name + ".sigmoid")], name)


def gated_delta_net(b: GraphBuilder, model: Model, i: int, h: str) -> str:
    cfg, g = model.config, b.g
    H, K = cfg.hidden_size, cfg.linear_conv_kernel
    nk, nv = cfg.linear_key_heads, cfg.linear_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = nv // nk
    key_dim, value_dim = nk * dk, nv * dv
    C = 2 * key_dim + value_dim
    p = f"l{i}.lin."

    def w(role: str, *shape: int):
        return model.weight(role, i, tuple(shape))

    if model.has("ssm_qkvz", i):
        # Qwen3-Next (HF): per key head [q dk | k dk | v r*dv | z r*dv]
        qkvz = b.linear(h, w("ssm_qkvz", nk * (2 * dk + 2 * r * dv), H), p + "qkvz")
        qkvz = b.reshape(qkvz, [-1, nk, 2 * dk + 2 * r * dv], p + "qkvz.heads")
        q, k, v, z = _split(b, qkvz, [dk, dk, r * dv, r * dv], p + "qkvz.split")
        parts = [
            b.reshape(q, [-1, key_dim], p + "q"),
            b.reshape(k, [-1, key_dim], p + "k"),
            b.reshape(v, [-1, value_dim], p + "v"),
        ]
        qkv = b.op("Concat", parts, p + "qkv", {"axis": -1})
    else:
        qkv = b.linear(h, w("ssm_qkv", C, H), p + "qkv")
        z = b.linear(h, w("ssm_z", value_dim, H), p + "z")
    if model.has("ssm_ba", i):
        # Qwen3-Next: per key head [b r | a r]
        ba = b.linear(h, w("ssm_ba", 2 * nv, H), p + "ba")
        ba = b.reshape(ba, [-1, nk, 2 * r], p + "ba.heads")
        beta_in, alpha = _split(b, ba, [r, r], p + "ba.split")
        beta_in = b.reshape(beta_in, [-1, nv], p + "b")
        alpha = b.reshape(alpha, [-1, nv], p + "a")
    else:
        beta_in = b.linear(h, w("ssm_beta", nv, H), p + "b")
        alpha = b.linear(h, w("ssm_alpha", nv, H), p + "a")
    z = b.reshape(z, [-1, nv, dv], p + "z.heads")

    # HF stores the conv weight [C, 1, K], llama.cpp [C, K]
    conv_ref = model.source.weight_ref(model.tensor_name("ssm_conv", i))
    conv_w = w("ssm_conv", *((C, 1, K) if len(conv_ref.shape) == 3 else (C, K)))
    conv_w = b.reshape(b.weight(conv_w), [C, K], f"{conv_w.name}.2d")
    conv_state = g.add_state(f"lin.{i}.conv", TensorType("float32", (K - 1, C)))
    conv = b.op("CausalConv1d", [qkv, conv_w, conv_state], p + "conv", domain="hipc")
    conv = _silu(b, conv, p + "conv.silu")
    q, k, v = _split(b, conv, [key_dim, key_dim, value_dim], p + "conv.split")
    norm = {"epsilon": L2_EPS}
    q = b.op(
        "L2Normalization", [b.reshape(q, [-1, nk, dk], p + "q.heads")], p + "q.l2", norm, "hipc"
    )
    k = b.op(
        "L2Normalization", [b.reshape(k, [-1, nk, dk], p + "k.heads")], p + "k.l2", norm, "hipc"
    )
    v = b.reshape(v, [-1, nv, dv], p + "v.heads")

    beta = b.op("Sigmoid", [beta_in], p + "beta")
    rate = b.weight(w("ssm_a", nv))
    if cfg.linear_a_log:  # -exp(A_log): a weight-only subgraph, folded
        rate = b.op("Neg", [b.op("Exp", [rate], p + "A.exp")], p + "A")
    dt = b.op("Add", [alpha, b.weight(w("ssm_dt_bias", nv))], p + "dt")
    decay = b.op("Mul", [b.op("Softplus", [dt], p + "dt.softplus"), rate], p + "g")

    state = g.add_state(f"lin.{i}.ssm", TensorType("float32", (nv, dk, dv)))
    attrs = {
        "scale": float(dk**-0.5),
        "v_tiled": int(cfg.linear_v_tiled),
        "chunk_size": DELTA_CHUNK,
        "layer": i,
    }
    o = b.op("GatedDeltaRule", [q, k, v, decay, beta, state], p + "delta", attrs, "hipc")

    # gated RMSNorm per value head: plain w (not 1 + w), then * silu(z)
    scale = b.weight(w("ssm_norm", dv))
    o = b.op("RMSNormalization", [o, scale], p + "norm", {"epsilon": cfg.rms_norm_eps, "axis": -1})
    o = b.op("Mul", [o, _silu(b, z, p + "z.silu")], p + "gated")
    o = b.reshape(o, [-1, value_dim], p + "flat")
    return b.linear(o, w("ssm_out", H, value_dim), p + "out")


def build_hybrid(model: Model, max_ctx: int) -> Graph:
    mlp = moe_mlp if model.config.is_moe else dense_mlp
    return build_llama(model, max_ctx, mlp=mlp, mixer=mixer)


def hybrid_summary(cfg: ModelConfig) -> dict[str, Any]:
    """What `hipc info` says about a hybrid: its layer mix, the per-sequence state, and
    what of the checkpoint is not read (a multimodal checkpoint's vision tower)."""
    linear = [i for i in range(cfg.num_layers) if cfg.is_linear(i)]
    K, C = cfg.linear_conv_kernel, 2 * cfg.linear_key_heads * cfg.linear_key_head_dim
    C += cfg.linear_value_heads * cfg.linear_value_head_dim
    per_layer = (K - 1) * C + cfg.linear_value_heads * cfg.linear_key_head_dim * (
        cfg.linear_value_head_dim
    )
    return {
        "linear_attention_layers": linear,
        "full_attention_layers": [i for i in range(cfg.num_layers) if i not in linear],
        "recurrent_state_floats_per_sequence": per_layer * len(linear),
        "vision_tower": cfg.extra.get("vision", "none in the checkpoint"),
    }
