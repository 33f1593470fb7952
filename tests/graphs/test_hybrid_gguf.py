"""Hybrid GGUF files with llama.cpp's names and conventions (qwen3next, qwen35, qwen35moe),
read by hipc and checked against the same model read from safetensors and against
transformers (which reads none of these architectures from GGUF).

What the converter changes and hipc must undo by configuration, not by rewriting tensors:
norms stored as 1 + w (the gated norm not), -exp(A_log) stored, the conv weight squeezed,
Qwen3-Next's in_proj_qkvz split into attn_qkv/attn_gate (its in_proj_ba kept), Qwen3.5's
value heads in the tiled order, the layer pattern (read from which layers hold ssm_a).
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import build_graph, load_model

from gguf_writer import hybrid_tensors, write_hybrid_gguf
from support import HYBRID_FAMILIES, make_hybrid_hf, rel_err, require

pytestmark = pytest.mark.oracle

ARCH = {"qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}
SAME = (
    "layer_types",
    "linear_conv_kernel",
    "linear_key_heads",
    "linear_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "rotary_dim",
    "moe_layers",
    "num_experts",
    "experts_per_token",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
)


def _logits(model, tokens):
    return ReferenceExecutor(build_graph(model, max_ctx=128)).logits(tokens)


@pytest.mark.parametrize("family", sorted(HYBRID_FAMILIES))
def test_gguf_matches_safetensors_and_transformers(family, tmp_path):
    torch = require("torch")
    hf = make_hybrid_hf(family, tmp_path / "hf", seed=7)
    path = write_hybrid_gguf(hf, tmp_path / "m.gguf", ARCH[family])
    from_gguf, from_hf = load_model(path), load_model(tmp_path / "hf")
    for field in SAME:
        assert getattr(from_gguf.config, field) == getattr(from_hf.config, field), field
    assert from_gguf.config.linear_v_tiled == (family != "qwen3_next")
    tokens = np.random.default_rng(4).integers(0, hf.config.vocab_size, size=70).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].numpy()
    got = _logits(from_gguf, tokens)
    assert rel_err(got, _logits(from_hf, tokens)) <= 1e-5
    assert rel_err(got, want) <= 1e-4


def test_q8_0_gguf_stays_quantized(tmp_path):
    """Rows that fit 32-element blocks stored as Q8_0 and read as stored: the same logits as
    a float32 file holding gguf-py's dequantization of those blocks (these random models
    are too sensitive for a bound against the unrounded weights to mean much: one tensor's
    Q8_0 rounding alone moves their logits by 0.4-10%)."""
    import gguf

    require("torch")
    hf = make_hybrid_hf(
        "qwen3_5_moe", tmp_path / "hf", hidden_size=64, linear_value_head_dim=16, seed=8
    )
    q8 = load_model(write_hybrid_gguf(hf, tmp_path / "q8.gguf", "qwen35moe", "Q8_0"))
    graph = build_graph(q8, max_ctx=64)
    types = {ref.name: ref.dtype for ref in graph.weight_refs().values()}
    assert types["blk.0.attn_qkv.weight"] == "q8_0" and types["blk.0.ssm_out.weight"] == "q8_0"
    assert types["blk.0.ffn_gate_exps.weight"] == "q8_0"
    assert types["blk.0.ssm_conv1d.weight"] == "float32"

    Q8 = gguf.GGMLQuantizationType.Q8_0
    rounded = {}
    for name, arr in hybrid_tensors(hf, "qwen35moe").items():
        quantized = types.get(name) == "q8_0"
        rounded[name] = (
            gguf.quants.dequantize(gguf.quants.quantize(arr, Q8), Q8) if quantized else arr
        )
    path = write_hybrid_gguf(hf, tmp_path / "f32.gguf", "qwen35moe", tensors=rounded)
    tokens = np.random.default_rng(5).integers(0, hf.config.vocab_size, size=40).tolist()
    want = _logits(load_model(path), tokens)
    assert rel_err(ReferenceExecutor(graph).logits(tokens), want) <= 1e-5
