"""The reference executor against transformers on the CPU, random-init small models.

Every family, with shapes chosen to catch assumptions: odd head counts, head_dim !=
hidden/heads, GQA ratios 1/2/4, vocab not a power of two, non-default norm weights,
each RoPE scaling type. Prefill and token-by-token decode both, float32.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import build_graph, load_model

from support import require

# name -> (transformers config class, kwargs)
FAMILIES = {
    "llama-gqa1-llama3rope": (
        "LlamaConfig",
        dict(
            hidden_size=40,
            num_attention_heads=5,
            num_key_value_heads=5,
            intermediate_size=72,
            vocab_size=301,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            rope_theta=500000.0,
        ),
    ),
    "llama-gqa2-linear": (
        "LlamaConfig",
        dict(
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=10,
            intermediate_size=80,
            vocab_size=257,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "llama-mqa-dynamic-tied": (
        "LlamaConfig",
        dict(
            hidden_size=36,
            num_attention_heads=3,
            num_key_value_heads=1,
            intermediate_size=50,
            vocab_size=199,
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        ),
    ),
    "mistral-sliding": (
        "MistralConfig",
        dict(
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=12,
            intermediate_size=64,
            vocab_size=333,
            sliding_window=5,
        ),
    ),
    "qwen2-bias-gqa4-tied": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=96,
            vocab_size=383,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-qknorm-gqa4": (
        "Qwen3Config",
        dict(
            hidden_size=40,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=12,
            intermediate_size=88,
            vocab_size=211,
        ),
    ),
    # soft-caps small enough that tanh bends; head_dim != hidden/heads; window < prompt
    "gemma2-softcap-window-tied": (
        "Gemma2Config",
        dict(
            hidden_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            intermediate_size=72,
            vocab_size=263,
            sliding_window=5,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=2.5,
            final_logit_softcapping=4.0,
        ),
    ),
    "gemma2-mqa-untied-nocap": (
        "Gemma2Config",
        dict(
            hidden_size=36,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=10,
            intermediate_size=50,
            vocab_size=199,
            sliding_window=7,
            query_pre_attn_scalar=10,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            tie_word_embeddings=False,
        ),
    ),
    "gemma3-qknorm-localrope": (
        "Gemma3TextConfig",
        dict(
            hidden_size=40,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            intermediate_size=64,
            vocab_size=227,
            sliding_window=4,
            query_pre_attn_scalar=16,
            final_logit_softcapping=6.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        ),
    ),
}
COMMON = dict(num_hidden_layers=3, max_position_embeddings=64, rms_norm_eps=1e-5)


def make_hf_model(family: str, folder):
    transformers = require("transformers")
    torch = require("torch")
    cls_name, kwargs = FAMILIES[family]
    config = getattr(transformers, cls_name)(**COMMON, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(hash(family) % 2**31)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-default norm weights catch a missing scale
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:  # larger than the default init so attention patterns are not uniform
                p.copy_(0.15 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(folder)
    return model


def hf_logits_incremental(model, tokens, n_prefill):
    torch = require("torch")
    with torch.no_grad():
        ids = torch.tensor([tokens])
        out = model(ids[:, :n_prefill], use_cache=True)
        steps = [out.logits[0].numpy()]
        past = out.past_key_values
        for t in range(n_prefill, len(tokens)):
            out = model(ids[:, t : t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            steps.append(out.logits[0].numpy())
    return np.concatenate(steps)


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.oracle
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_matches_transformers(family, tmp_path):
    torch = require("torch")
    hf = make_hf_model(family, tmp_path)
    rng = np.random.default_rng(0)
    vocab = hf.config.vocab_size
    tokens = rng.integers(0, vocab, size=23).tolist()

    with torch.no_grad():
        want_full = hf(torch.tensor([tokens])).logits[0].numpy()
    want_inc = hf_logits_incremental(hf, tokens, 9)

    graph = build_graph(load_model(tmp_path), max_ctx=32)
    ex = ReferenceExecutor(graph)
    got_full = ex.logits(tokens)
    assert rel_err(got_full, want_full) <= 1e-4

    ex.reset()
    got_inc = np.concatenate(
        [ex.logits(tokens[:9])] + [ex.logits([t], i) for i, t in enumerate(tokens) if i >= 9]
    )
    assert rel_err(got_inc, want_inc) <= 1e-4
