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

from collections.abc import Callable

from hipc.compiler.ir import Graph, TensorType
from hipc.graphs.blocks import gated_mlp, rms_norm, self_attention
from hipc.graphs.builder import GraphBuilder
from hipc.graphs.model import Model
from hipc.graphs.rope import cos_sin_tables

# (builder, model, layer, normed input) -> the MLP's output, added to the residual
MLPBuilder = Callable[[GraphBuilder, Model, int, str], str]
# (builder, model, layer, normed input, positions, rope tables) -> the token mixer's output
MixerBuilder = Callable[[GraphBuilder, Model, int, str, str, tuple[str, str]], str]


def dense_mlp(b: GraphBuilder, model: Model, i: int, h: str) -> str:
    return gated_mlp(b, model, i, h)


def build_llama(
    model: Model,
    max_ctx: int,
    mlp: MLPBuilder = dense_mlp,
    mixer: MixerBuilder = self_attention,
) -> Graph:
    """The decoder; `mlp` builds each layer's feed-forward block (MoE families swap it),
    `mixer` its attention (hybrids put linear attention in some layers)."""
    cfg = model.config
    g = Graph(model.name)
    g.metadata.update(family=cfg.family, max_ctx=max_ctx)
    b = GraphBuilder(g)
    H = cfg.hidden_size

    ids = g.add_input("input_ids", TensorType("int64", ("tokens",)))
    pos = g.add_input("positions", TensorType("int64", ("tokens",)))
    cos, sin = cos_sin_tables(cfg, max_ctx)
    rope = (b.constant("rope.cos", cos), b.constant("rope.sin", sin))
    embed = model.weight("embed", None, (cfg.vocab_size, H))
    x = b.op("Gather", [b.weight(embed), ids], "embed", {"axis": 0})

    for i in range(cfg.num_layers):
        p = f"l{i}."
        h = rms_norm(b, model, x, "attn_norm", i, p + "attn_norm", H)
        x = b.op("Add", [x, mixer(b, model, i, h, pos, rope)], p + "attn.residual")
        h = rms_norm(b, model, x, "ffn_norm", i, p + "ffn_norm", H)
        x = b.op("Add", [x, mlp(b, model, i, h)], p + "ffn.residual")

    h = rms_norm(b, model, x, "norm", None, "final_norm", H)
    lm = embed if cfg.tie_word_embeddings else model.weight("lm_head", None, (cfg.vocab_size, H))
    logits = b.linear(h, lm, "logits")
    g.outputs.append(logits)
    return g
