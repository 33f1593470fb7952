"""The Gemma-2 and Gemma-3 text families as an IR graph.

Llama's decoder with five differences, each a switch of the config record:

  x = embed[input_ids] * sqrt(hidden)             (the multiplier in the model's dtype)
  per layer:  h = norm(x);  a = attention(h)       (scale query_pre_attn_scalar^-1/2, scores
                                                    soft-capped, sliding window on alternate
                                                    layers; Gemma-3: q/k norm, local RoPE base)
              x += norm(a Wo)                      (sandwich norms: after the sublayer too)
              h = norm(x);  x += norm(down(gelu_tanh(h Wgate) * h Wup))
  logits = cap * tanh((norm(x) Wembed) / cap)      (final soft-cap; tied embeddings)

Every norm scales by (1 + w) (blocks.rms_norm, config.norm_weight_offset).
"""

from __future__ import annotations

import numpy as np

from hipc.compiler.ir import Graph, TensorType
from hipc.graphs.blocks import gated_mlp, rms_norm, self_attention
from hipc.graphs.builder import GraphBuilder
from hipc.graphs.model import Model
from hipc.graphs.rope import cos_sin_tables


def build_gemma(model: Model, max_ctx: int) -> Graph:
    cfg = model.config
    g = Graph(model.name)
    g.metadata.update(family=cfg.family, max_ctx=max_ctx)
    b = GraphBuilder(g)
    H = cfg.hidden_size

    ids = g.add_input("input_ids", TensorType("int64", ("tokens",)))
    pos = g.add_input("positions", TensorType("int64", ("tokens",)))
    cos, sin = cos_sin_tables(cfg, max_ctx)
    rope = (b.constant("rope.cos", cos), b.constant("rope.sin", sin))
    local_rope = rope
    if cfg.rope_local_theta is not None:
        cos, sin = cos_sin_tables(cfg, max_ctx, local=True)
        local_rope = (b.constant("rope.local.cos", cos), b.constant("rope.local.sin", sin))
    embed = model.weight("embed", None, (cfg.vocab_size, H))
    x = b.op("Gather", [b.weight(embed), ids], "embed.rows", {"axis": 0})
    scale = b.constant("embed.multiplier", np.array(cfg.embedding_multiplier, dtype=np.float32))
    x = b.op("Mul", [x, scale], "embed")

    for i in range(cfg.num_layers):
        p = f"l{i}."
        h = rms_norm(b, model, x, "attn_norm", i, p + "attn_norm", H)
        a = self_attention(b, model, i, h, pos, local_rope if cfg.window(i) else rope)
        a = rms_norm(b, model, a, "post_attn_norm", i, p + "post_attn_norm", H)
        x = b.op("Add", [x, a], p + "attn.residual")
        h = rms_norm(b, model, x, "ffn_norm", i, p + "ffn_norm", H)
        m = rms_norm(
            b, model, gated_mlp(b, model, i, h), "post_ffn_norm", i, p + "post_ffn_norm", H
        )
        x = b.op("Add", [x, m], p + "ffn.residual")

    h = rms_norm(b, model, x, "norm", None, "final_norm", H)
    lm = embed if cfg.tie_word_embeddings else model.weight("lm_head", None, (cfg.vocab_size, H))
    logits = b.linear(h, lm, "logits" if not cfg.final_softcap else "logits.raw")
    if cfg.final_softcap:
        cap = b.constant("logits.softcap", np.array(cfg.final_softcap, dtype=np.float32))
        t = b.op("Tanh", [b.op("Div", [logits, cap], "logits.scaled")], "logits.tanh")
        logits = b.op("Mul", [t, cap], "logits")
    g.outputs.append(logits)
    return g
