"""Tensor names per file format, as templates keyed by role (gguf-py's habit).

The builder asks for a role ("q", layer 3); the table for the source's format gives
the file's tensor name. One table per naming convention, not per family: Llama,
Mistral, SmolLM2, Qwen2 and Qwen3 share both conventions. Gemma-2/3 add sandwich norms
and give HF's `post_attention_layernorm` another meaning (the norm *after* attention,
where Llama's is the one before the feed-forward), so they have tables of their own.
"""

HF_LLAMA = {
    "embed": "model.embed_tokens.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}

GGUF_LLAMA = {
    "embed": "token_embd.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "o": "blk.{i}.attn_output.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
}

HF_GEMMA = {
    **HF_LLAMA,
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_ffn_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}

# gguf-py's MODEL_TENSOR names for MODEL_ARCH.GEMMA2 / GEMMA3
GGUF_GEMMA = {
    **GGUF_LLAMA,
    "post_attn_norm": "blk.{i}.post_attention_norm.weight",
    "post_ffn_norm": "blk.{i}.post_ffw_norm.weight",
}

NAME_TABLES = {"safetensors": HF_LLAMA, "gguf": GGUF_LLAMA}
FAMILY_NAME_TABLES = {
    "gemma2": {"safetensors": HF_GEMMA, "gguf": GGUF_GEMMA},
    "gemma3": {"safetensors": HF_GEMMA, "gguf": GGUF_GEMMA},
}


def name_table(family: str, fmt: str) -> dict[str, str]:
    """role -> tensor-name template for one family in one file format."""
    return FAMILY_NAME_TABLES.get(family, NAME_TABLES)[fmt]
