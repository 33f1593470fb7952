"""Gemma config normalization against transformers' own config classes: keys a config.json
leaves out take transformers' defaults, and the embedding multiplier is rounded the way
torch casts it to the model's dtype."""

from __future__ import annotations

import math

import pytest

from hipc.graphs.config import from_hf, in_dtype

from support import require

pytestmark = pytest.mark.oracle


@pytest.mark.parametrize("cls, arch", [("Gemma2Config", "gemma2"), ("Gemma3TextConfig", "gemma3")])
def test_missing_keys_take_transformers_defaults(cls, arch):
    transformers = require("transformers")
    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    hf = getattr(transformers, cls)(num_hidden_layers=7, **shape)
    # a minimal config.json: the shape only, every Gemma switch left to the defaults
    raw = {
        "model_type": hf.model_type,
        "vocab_size": hf.vocab_size,
        "intermediate_size": hf.intermediate_size,
        "num_hidden_layers": 7,
        "hidden_activation": "gelu_pytorch_tanh",
        **shape,
    }
    cfg = from_hf(raw)
    assert cfg.family == arch
    assert cfg.attn_softcap == hf.attn_logit_softcapping
    assert cfg.final_softcap == hf.final_logit_softcapping
    assert cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert cfg.sliding_window == hf.sliding_window
    assert list(cfg.layer_types) == list(hf.layer_types)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    if arch == "gemma3":
        rope = hf.rope_parameters
        assert cfg.rope_theta == rope["full_attention"]["rope_theta"]
        assert cfg.rope_local_theta == rope["sliding_attention"]["rope_theta"]
    else:
        assert cfg.rope_theta == hf.rope_parameters["rope_theta"]


def test_legacy_gemma3_rope_keys():
    # configs written before transformers 5: rope_theta, rope_local_base_freq, rope_scaling
    transformers = require("transformers")
    hf = transformers.Gemma3TextConfig(
        rope_theta=1e6,
        rope_local_base_freq=5000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "head_dim": 16,
        "rope_theta": 1e6,
        "rope_local_base_freq": 5000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    cfg = from_hf(raw)
    assert cfg.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert cfg.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert cfg.rope_scaling["factor"] == hf.rope_parameters["full_attention"]["factor"]


@pytest.mark.parametrize("hidden", [2304, 3584, 4608, 1152, 640])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_embedding_multiplier_in_model_dtype(hidden, dtype):
    torch = require("torch")
    want = torch.tensor(hidden**0.5).to(getattr(torch, dtype)).item()
    assert in_dtype(math.sqrt(hidden), dtype) == want
