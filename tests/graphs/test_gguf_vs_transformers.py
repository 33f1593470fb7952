"""GGUF files written like llama.cpp's converter, read by hipc and by transformers.

Checks the GGUF conventions end to end: llama-architecture Q/K rows permuted for
interleaved RoPE, tied embeddings (no output.weight), Qwen2 biases, quantized types,
Gemma's norms stored as 1 + w and its soft-capping / sliding-window keys.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import build_graph, load_model

from gguf_writer import write_gguf
from support import require

pytestmark = pytest.mark.oracle

CASES = {
    "llama-f32": (
        "LlamaConfig",
        "llama",
        "F32",
        dict(num_attention_heads=8, num_key_value_heads=2),
    ),
    "llama-tied-q8_0": (
        "LlamaConfig",
        "llama",
        "Q8_0",
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    ),
    "llama-q4_0": (
        "LlamaConfig",
        "llama",
        "Q4_0",
        dict(num_attention_heads=2, num_key_value_heads=1),
    ),
    "llama-q4_1": (
        "LlamaConfig",
        "llama",
        "Q4_1",
        dict(num_attention_heads=4, num_key_value_heads=2),
    ),
    "qwen2-bias": (
        "Qwen2Config",
        "qwen2",
        "F32",
        dict(num_attention_heads=4, num_key_value_heads=2),
    ),
    # head_dim != hidden/heads; soft-caps small enough to bend
    "gemma2-f32": (
        "Gemma2Config",
        "gemma2",
        "F32",
        dict(
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=6,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
        ),
    ),
    "gemma2-q8_0": (
        "Gemma2Config",
        "gemma2",
        "Q8_0",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5),
    ),
    "gemma3-f32": (
        "Gemma3TextConfig",
        "gemma3",
        "F32",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=5,
            final_logit_softcapping=6.0,
            num_hidden_layers=6,  # llama.cpp's pattern: layers 0-4 sliding, 5 global
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_matches_transformers(case, tmp_path):
    transformers = require("transformers")
    torch = require("torch")
    cls, arch, qtype, extra = CASES[case]
    shape = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=320,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    config = getattr(transformers, cls)(**{**shape, **extra})
    torch.manual_seed(1)
    src = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in src.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
    path = write_gguf(src, tmp_path / "m.gguf", arch, qtype)

    overrides = {}
    if arch in ("gemma2", "gemma3"):
        # transformers reads neither soft-cap key and defaults query_pre_attn_scalar to 256,
        # where llama.cpp takes head_dim (these are not 27B models): hipc must find the
        # values in the file; transformers is told them.
        overrides = dict(
            query_pre_attn_scalar=config.head_dim,
            attn_logit_softcapping=config.attn_logit_softcapping,
            final_logit_softcapping=config.final_logit_softcapping,
        )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", torch_dtype=torch.float32, **overrides
    )
    tokens = np.random.default_rng(2).integers(0, 320, size=19).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].numpy()
    got = ReferenceExecutor(build_graph(load_model(path), max_ctx=32)).logits(tokens)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert err <= 1e-4, err
