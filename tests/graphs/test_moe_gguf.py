"""MoE GGUF files written with llama.cpp's names, read by hipc and checked against transformers.

Experts are stacked 3-D (`blk.N.ffn_{gate,up,down}_exps`), the router is
`ffn_gate_inp`, Qwen2-MoE's shared expert `ffn_*_shexp` with its gate
`ffn_gate_inp_shexp` stored [H]. Mixtral is llama.cpp's "llama" architecture with
experts (Q/K rows permuted for interleaved RoPE).

transformers reads qwen2moe/qwen3moe GGUF tensors (quantized ones dequantized by
gguf-py) but not their expert widths (it maps no expert_feed_forward_length), so it gets
the source model's config; it reads no MoE under "llama", no "olmoe" at all, and no dense
layers in a qwen2moe file (llama.cpp has none; hipc takes a layer without ffn_gate_inp as
dense), so those are checked against the transformers model the file was written from.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from test_moe import make_moe_model

from hipc.compiler.ir import StackedWeight
from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import build_graph, load_model

from gguf_writer import write_gguf
from support import require

pytestmark = pytest.mark.oracle

SHAPES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
# name -> (test_moe family, GGUF arch, tensor type, overrides, transformers reads the GGUF)
CASES = {
    "qwen3moe-f32": (
        "qwen3_moe-e7-k2-norm-mlp_only",
        "qwen3moe",
        "F32",
        dict(mlp_only_layers=[], moe_intermediate_size=32, head_dim=16),
        True,
    ),
    "qwen3moe-q8_0-k8": (
        "qwen3_moe-e9-k8-step2",
        "qwen3moe",
        "Q8_0",
        dict(decoder_sparse_step=1, moe_intermediate_size=32, norm_topk_prob=True),
        True,
    ),
    "qwen2moe-shared-f32": (
        "qwen2_moe-e5-k1-shared",
        "qwen2moe",
        "F32",
        dict(moe_intermediate_size=32, shared_expert_intermediate_size=64),
        True,
    ),
    "qwen2moe-dense-mixed-f32": (
        "qwen2_moe-e11-k3-shared-norm-step2",
        "qwen2moe",
        "F32",
        dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, intermediate_size=64),
        False,
    ),
    "mixtral-llama-f32": (
        "mixtral-e3-k2-sliding",
        "llama",
        "F32",
        dict(intermediate_size=32, sliding_window=None),
        False,
    ),
    "mixtral-llama-per-expert-f32": (
        "mixtral-e8-k1",
        "llama",
        "F32",
        dict(intermediate_size=32),
        False,
    ),
    "olmoe-clip-f32": (
        "olmoe-e5-k2-norm-clip",
        "olmoe",
        "F32",
        dict(intermediate_size=32),
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_gguf_matches_transformers(case, tmp_path):
    transformers = require("transformers")
    torch = require("torch")
    family, arch, qtype, overrides, tf_reads_gguf = CASES[case]
    src = make_moe_model(family, **SHAPES, **overrides)
    path = write_gguf(src, tmp_path / "m.gguf", arch, qtype, per_expert="per-expert" in case)
    if tf_reads_gguf:
        oracle = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file="m.gguf", config=src.config, dtype=torch.float32
        )
    else:
        oracle = src
    tokens = np.random.default_rng(2).integers(0, src.config.vocab_size, size=19).tolist()
    with torch.no_grad():
        want = oracle(torch.tensor([tokens])).logits[0].numpy()
    model = load_model(path)
    assert model.config.family == family.split("-")[0]
    assert model.config.num_experts == (
        getattr(src.config, "num_experts", None) or src.config.num_local_experts
    )
    stacked_here = isinstance(model.experts(model.config.moe_layers[0])["down"], StackedWeight)
    assert stacked_here == ("per-expert" in case)
    sparse = [i for i, layer in enumerate(src.model.layers) if hasattr(layer.mlp, "experts")]
    assert list(model.config.moe_layers) == sparse
    got = ReferenceExecutor(build_graph(model, max_ctx=32)).logits(tokens)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert err <= 1e-4, err


def test_random_moe_gguf_writer(tmp_path):
    """docs/benchmarks/write_moe_gguf.py (random Q8_0 blocks, no floats): a file hipc and
    transformers (through gguf-py) read the same way."""
    transformers = require("transformers")
    torch = require("torch")
    script = Path(__file__).parents[2] / "docs" / "benchmarks" / "write_moe_gguf.py"
    spec = importlib.util.spec_from_file_location("write_moe_gguf", script)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cfg = dict(tool.PRESETS["tiny"], layers=2, vocab=320)
    path = tool.write(tmp_path / "m.gguf", cfg, "q8_0", seed=3, scale=0.2)
    config = transformers.Qwen3MoeConfig(
        hidden_size=cfg["hidden"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        head_dim=cfg["head_dim"],
        num_experts=cfg["experts"],
        num_experts_per_tok=cfg["active"],
        moe_intermediate_size=cfg["expert_ffn"],
        intermediate_size=cfg["expert_ffn"],
        norm_topk_prob=True,
        vocab_size=cfg["vocab"],
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", config=config, dtype=torch.float32
    )
    tokens = np.random.default_rng(4).integers(0, cfg["vocab"], size=11).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].numpy()
    model = load_model(path)
    assert model.config.num_experts == 16 and model.config.experts_per_token == 4
    got = ReferenceExecutor(build_graph(model, max_ctx=32)).logits(tokens)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert err <= 1e-4, err
