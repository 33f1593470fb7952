"""Tensor names per file format, as templates keyed by role (gguf-py's habit).

The builder asks for a role ("q", layer 3[, expert 5]); the table for the source's
format gives the file's tensor name. One table per naming convention, not per family:
every family shares both conventions, except where a role lists alternatives (tried in
order; the first the file has wins): HF MoE checkpoints store experts one tensor each
(Mixtral under `block_sparse_moe.experts.E.w1/w3/w2`, the others under
`mlp.experts.E.{gate,up,down}_proj`), or fused as transformers >= 5 holds them in memory
(`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj` [E, H, F]). GGUF stores
them stacked, `blk.N.ffn_{gate,up,down}_exps` [E, F, H] / [E, H, F] (early Mixtral files: one
`blk.N.ffn_gate.E.weight` per expert).
Gemma-2/3 add sandwich norms and give HF's `post_attention_layernorm` another meaning
(the norm *after* attention, where Llama's is the one before the feed-forward), so they
have tables of their own (name_table picks a family's).
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
    "o_bias": "model.layers.{i}.self_attn.o_proj.bias",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "router": (
        "model.layers.{i}.mlp.gate.weight",
        "model.layers.{i}.block_sparse_moe.gate.weight",
    ),
    "gate_exp": (
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    ),
    "up_exp": (
        "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    ),
    "down_exp": (
        "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
    ),
    "gate_up_exps": "model.layers.{i}.mlp.experts.gate_up_proj",
    "down_exps": "model.layers.{i}.mlp.experts.down_proj",
    "shared_gate": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "shared_up": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "shared_down": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "shared_expert_gate": "model.layers.{i}.mlp.shared_expert_gate.weight",
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
    "o_bias": "blk.{i}.attn_output.bias",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
    "router": "blk.{i}.ffn_gate_inp.weight",
    "gate_exps": "blk.{i}.ffn_gate_exps.weight",
    "up_exps": "blk.{i}.ffn_up_exps.weight",
    "down_exps": "blk.{i}.ffn_down_exps.weight",
    # Mixtral GGUFs from before stacked experts (llama.cpp still reads them)
    "gate_exp": "blk.{i}.ffn_gate.{e}.weight",
    "up_exp": "blk.{i}.ffn_up.{e}.weight",
    "down_exp": "blk.{i}.ffn_down.{e}.weight",
    "shared_gate": "blk.{i}.ffn_gate_shexp.weight",
    "shared_up": "blk.{i}.ffn_up_shexp.weight",
    "shared_down": "blk.{i}.ffn_down_shexp.weight",
    "shared_expert_gate": "blk.{i}.ffn_gate_inp_shexp.weight",
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

_HF_LINEAR_ATTN = {
    "ssm_qkvz": "model.layers.{i}.linear_attn.in_proj_qkvz.weight",  # Qwen3-Next: per key head
    "ssm_ba": "model.layers.{i}.linear_attn.in_proj_ba.weight",
    "ssm_qkv": "model.layers.{i}.linear_attn.in_proj_qkv.weight",  # Qwen3.5: one tensor each
    "ssm_z": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "ssm_beta": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "ssm_alpha": "model.layers.{i}.linear_attn.in_proj_a.weight",
    "ssm_conv": "model.layers.{i}.linear_attn.conv1d.weight",
    "ssm_dt_bias": "model.layers.{i}.linear_attn.dt_bias",
    "ssm_a": "model.layers.{i}.linear_attn.A_log",
    "ssm_norm": "model.layers.{i}.linear_attn.norm.weight",
    "ssm_out": "model.layers.{i}.linear_attn.out_proj.weight",
}


def _with_language_model(table: dict) -> dict:
    """Each `model.` name also as a multimodal checkpoint spells it (`model.language_model.`,
    beside `model.visual.` which nothing reads)."""
    out = {}
    for role, names in table.items():
        names = (names,) if isinstance(names, str) else names
        mm = tuple(n.replace("model.", "model.language_model.", 1) for n in names)
        out[role] = names + tuple(n for n in mm if n not in names)
    return out


# Qwen3-Next / Qwen3.5 (text or the text part of the multimodal checkpoints)
HF_HYBRID = _with_language_model({**HF_LLAMA, **_HF_LINEAR_ATTN})

# gguf-py's MODEL_TENSOR names for QWEN3NEXT / QWEN35 / QWEN35MOE: the norm before the
# feed-forward is ATTN_POST_NORM there, and Qwen3-Next's in_proj_qkvz arrives split into
# attn_qkv (q, k, v each grouped) and attn_gate (z)
GGUF_HYBRID = {
    **GGUF_LLAMA,
    "ffn_norm": ("blk.{i}.post_attention_norm.weight", "blk.{i}.ffn_norm.weight"),
    "ssm_qkv": "blk.{i}.attn_qkv.weight",
    "ssm_z": "blk.{i}.attn_gate.weight",
    "ssm_ba": "blk.{i}.ssm_ba.weight",
    "ssm_beta": "blk.{i}.ssm_beta.weight",
    "ssm_alpha": "blk.{i}.ssm_alpha.weight",
    "ssm_conv": "blk.{i}.ssm_conv1d.weight",
    "ssm_dt_bias": "blk.{i}.ssm_dt.bias",
    "ssm_a": "blk.{i}.ssm_a",
    "ssm_norm": "blk.{i}.ssm_norm.weight",
    "ssm_out": "blk.{i}.ssm_out.weight",
    "gate_up_exps": "blk.{i}.ffn_gate_up_exps.weight",
}

NAME_TABLES = {"safetensors": HF_LLAMA, "gguf": GGUF_LLAMA}
FAMILY_NAME_TABLES = {
    "gemma2": {"safetensors": HF_GEMMA, "gguf": GGUF_GEMMA},
    "gemma3": {"safetensors": HF_GEMMA, "gguf": GGUF_GEMMA},
    "qwen3_next": {"safetensors": HF_HYBRID, "gguf": GGUF_HYBRID},
    "qwen3_5": {"safetensors": HF_HYBRID, "gguf": GGUF_HYBRID},
    "qwen3_5_moe": {"safetensors": HF_HYBRID, "gguf": GGUF_HYBRID},
}


def name_table(family: str, fmt: str) -> dict[str, str | tuple[str, ...]]:
    """role -> tensor-name template(s) for one family in one file format."""
    return FAMILY_NAME_TABLES.get(family, NAME_TABLES)[fmt]
