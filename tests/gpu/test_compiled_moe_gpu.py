"""Compiled MoE artifacts on a real GPU against the reference executor (sm_90).

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). The tiny
random-init families of tests/graphs/test_moe.py (odd expert counts, top-k of 1, 2 and 8,
renormalisation on and off, dense layers mixed in, Qwen2-MoE's gated shared expert,
Mixtral's sliding window, OLMoE's q/k norm over the whole projection and its clip_qkv), from Hugging Face folders in float32 and bf16 and from
GGUF files with llama.cpp's stacked expert tensors in Q8_0 / Q4_0 / Q4_1 and Q4_K_M's Q4_K /
Q6_K pair: relative logit
error <= 2e-3 over a prefill in chunks and token-by-token decode, greedy tokens equal
(test_compiled_gpu.check).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_compiled_gpu import check

from gguf_writer import q3_k_m_type, q4_k_m_type, requantize_gguf, write_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))  # the MoE families
from test_moe import KQUANT_WIDTHS, make_moe_model, sharp_router_moe

pytestmark = pytest.mark.gpu

FAMILIES = [
    "qwen2_moe-e5-k1-shared",  # the sigmoid-gated shared expert
    "qwen2_moe-e11-k3-shared-norm-step2",
    "qwen3_moe-e7-k2-norm-mlp_only",
    "qwen3_moe-e9-k8-step2",
    "mixtral-e3-k2-sliding",
    "mixtral-e8-k1",
    "olmoe-e13-k8",
    "olmoe-e5-k2-norm-clip",  # clip_qkv: q, k, v clamped as the attention kernels read them
]


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_family_on_gpu(family, tmp_path):
    make_moe_model(family).save_pretrained(tmp_path / "m")
    check(tmp_path / "m", tmp_path, ctx=48)


def test_bf16_experts_on_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    make_moe_model("mixtral-e8-k1").to(torch.bfloat16).save_pretrained(tmp_path / "m")
    check(tmp_path / "m", tmp_path, ctx=48)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_experts_on_gpu(qtype, tmp_path):
    """Routers scaled by 0.1 for every type. Through routers far from uniform, the int16
    activations of the quantized GEMVs alone move these tiny models' stepwise decode by
    ~2e-3 (the NumPy model of that rounding in tests/graphs/test_moe_rounding_model.py:
    2.1e-3 for Q8_0's, where the H200 measured 2.28e-3 with them unscaled; 2e-4 scaled);
    gentler routers keep the comparison about the kernels."""
    pytest.importorskip("torch")
    src = sharp_router_moe(0.1)
    path = write_gguf(src, tmp_path / "m.gguf", "qwen3moe", qtype, tokenizer=False)
    check(path, tmp_path, ctx=48)


@pytest.mark.parametrize("mix", ["q4_k_m", "q3_k_m"])
def test_k_quant_gguf_experts_on_gpu(mix, tmp_path):
    """llama-quantize's Q4_K_M experts (gate and up Q4_K, down Q6_K; widths of 256: the
    super-blocks) and its Q3_K_M ones (Q3_K and Q4_K), quantized by hipc's own quantizers; the
    routers scaled as above."""
    pytest.importorskip("torch")
    src = sharp_router_moe(0.1, **KQUANT_WIDTHS)
    f32 = write_gguf(src, tmp_path / "f.gguf", "qwen3moe", "F32", tokenizer=False)
    type_of = q4_k_m_type if mix == "q4_k_m" else q3_k_m_type
    check(requantize_gguf(f32, tmp_path / "m.gguf", type_of), tmp_path, ctx=48)
