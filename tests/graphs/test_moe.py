"""Mixture-of-Experts families against transformers on the CPU, random-init small models.

Shapes chosen to catch assumptions: odd expert counts, top-k of 1, 2 and 8 (and k = E
- 1), the shared expert on and off, renormalisation on and off, dense layers mixed with
sparse ones, OLMoE's q/k/v clamp, and routers with exact ties. Prefill and token-by-token
decode both, float32, relative error <= 1e-4 as for the dense families.
"""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from test_vs_transformers import hf_logits_incremental, rel_err

from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.compiler.reference.topk import topk_torch_cpu
from hipc.graphs import build_graph, load_model

from support import require

ATTN = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, vocab_size=211)
# name -> (config class, kwargs); layers 4 unless given
FAMILIES = {
    "qwen3_moe-e7-k2-norm-mlp_only": (
        "Qwen3MoeConfig",
        dict(
            num_experts=7,
            num_experts_per_tok=2,
            moe_intermediate_size=20,
            intermediate_size=56,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            head_dim=16,
        ),
    ),
    "qwen3_moe-e9-k8-step2": (
        "Qwen3MoeConfig",
        dict(
            num_experts=9,
            num_experts_per_tok=8,
            moe_intermediate_size=12,
            intermediate_size=40,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        ),
    ),
    "qwen2_moe-e5-k1-shared": (
        "Qwen2MoeConfig",
        dict(
            num_experts=5,
            num_experts_per_tok=1,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=36,
            intermediate_size=64,
            norm_topk_prob=False,
        ),
    ),
    "qwen2_moe-e11-k3-shared-norm-step2": (
        "Qwen2MoeConfig",
        dict(
            num_experts=11,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=28,
            intermediate_size=40,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        ),
    ),
    "qwen2_moe-e6-k2-noshared-norm": (
        "Qwen2MoeConfig",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=0,  # transformers' shared expert then adds 0
            intermediate_size=40,
            norm_topk_prob=True,
        ),
    ),
    "mixtral-e3-k2-sliding": (
        "MixtralConfig",
        dict(num_local_experts=3, num_experts_per_tok=2, intermediate_size=40, sliding_window=6),
    ),
    "mixtral-e8-k1": (
        "MixtralConfig",
        dict(num_local_experts=8, num_experts_per_tok=1, intermediate_size=24),
    ),
    "olmoe-e13-k8": (
        "OlmoeConfig",
        dict(num_experts=13, num_experts_per_tok=8, intermediate_size=16, norm_topk_prob=False),
    ),
    "olmoe-e5-k2-norm-clip": (
        "OlmoeConfig",
        dict(
            num_experts=5,
            num_experts_per_tok=2,
            intermediate_size=24,
            norm_topk_prob=True,
            clip_qkv=0.4,
        ),
    ),
}
COMMON = dict(num_hidden_layers=4, max_position_embeddings=64, rms_norm_eps=1e-5)


def make_moe_model(family: str, seed: int | None = None, **overrides):
    transformers = require("transformers")
    torch = require("torch")
    cls_name, kwargs = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**COMMON, **ATTN, **kwargs, **overrides})
    config._attn_implementation = "eager"
    # crc32, not hash(): str hashes change per process (PYTHONHASHSEED)
    torch.manual_seed(zlib.crc32(family.encode()) if seed is None else seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
                p.copy_(1.0 * torch.randn_like(p))  # routers far from uniform
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


def check_against(hf, folder, n_tokens: int = 21, n_prefill: int = 8) -> None:
    torch = require("torch")
    tokens = np.random.default_rng(3).integers(0, hf.config.vocab_size, size=n_tokens).tolist()
    with torch.no_grad():
        want_full = hf(torch.tensor([tokens])).logits[0].numpy()
    want_inc = hf_logits_incremental(hf, tokens, n_prefill)
    ex = ReferenceExecutor(build_graph(load_model(folder), max_ctx=32))
    assert rel_err(ex.logits(tokens), want_full) <= 1e-4
    ex.reset()
    steps = [ex.logits(tokens[:n_prefill])]
    steps += [ex.logits([t], i) for i, t in enumerate(tokens) if i >= n_prefill]
    assert rel_err(np.concatenate(steps), want_inc) <= 1e-4


@pytest.mark.oracle
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_matches_transformers(family, tmp_path):
    hf = make_moe_model(family)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    cfg = model.config
    sparse = [
        i
        for i, layer in enumerate(hf.model.layers)
        if hasattr(layer.mlp, "experts") or hasattr(layer, "block_sparse_moe")
    ]
    assert list(cfg.moe_layers) == sparse and len(sparse) > 0
    assert cfg.num_experts == FAMILIES[family][1].get(
        "num_experts", FAMILIES[family][1].get("num_local_experts")
    )
    check_against(hf, tmp_path)


@pytest.mark.oracle
def test_fused_expert_tensors(tmp_path):
    """Checkpoints holding experts as transformers >= 5 does in memory: gate_up_proj
    [E, 2F, H] and down_proj [E, H, F], one tensor per layer."""
    torch = require("torch")
    safetensors_torch = require("safetensors.torch")
    hf = make_moe_model("qwen2_moe-e5-k1-shared")
    state = hf.state_dict()
    if not any(k.endswith("experts.gate_up_proj") for k in state):
        pytest.skip("this transformers keeps experts as separate modules")
    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in state.items()}
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path)
    assert model.has("gate_up_exps", 0)
    assert torch is not None
    check_against(hf, tmp_path)


@pytest.mark.oracle
@pytest.mark.parametrize("experts,k", [(9, 2), (9, 3), (64, 1), (130, 2), (13, 8)])
def test_router_ties_like_transformers(experts, k, tmp_path):
    """Routers with all-zero rows: those experts' logits are exactly 0 for every token, so
    tokens whose k-th best expert is one of them meet exact ties, broken as torch.topk
    breaks them (its CPU partial_sort / nth_element order, not lowest index first)."""
    torch = require("torch")
    hf = make_moe_model(
        "olmoe-e13-k8",
        seed=experts * 10 + k,
        num_experts=experts,
        num_experts_per_tok=k,
        num_hidden_layers=2,
    )
    with torch.no_grad():
        for layer in hf.model.layers:
            w = layer.mlp.gate.weight
            # k + 2 experts keep a router row, spread over the index range
            w[~torch.isin(torch.arange(experts), torch.arange(k + 2) * (experts // (k + 2)))] = 0
    hf.save_pretrained(tmp_path)
    # the test is void unless ties reach the top-k boundary, so check they do
    h = torch.randn(16, hf.config.hidden_size)
    probs = torch.softmax(h @ hf.model.layers[0].mlp.gate.weight.T, -1)
    top = torch.topk(probs, k + 1).values
    assert bool((top[:, k - 1] == top[:, k]).any())
    check_against(hf, tmp_path, n_tokens=24, n_prefill=10)


def test_topk_tie_order_is_torchs():
    torch = require("torch")
    rng = np.random.default_rng(5)
    for _ in range(1500):
        n = int(rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 60, 64, 65, 128, 129, 200]))
        k = int(rng.integers(1, min(n, 9) + 1))
        x = rng.integers(0, int(rng.integers(1, 5)), size=n).astype(np.float32)
        if rng.random() < 0.3:
            x = x + (rng.random(n) < 0.5) * rng.standard_normal(n).astype(np.float32)
        want = torch.topk(torch.from_numpy(x), k).indices.tolist()
        assert topk_torch_cpu(x.tolist(), k) == want, (n, k, x.tolist())


def test_config_sparse_layers(tmp_path):
    """decoder_sparse_step and mlp_only_layers pick the sparse layers as transformers does."""
    from hipc.graphs.config import from_hf

    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 8,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "vocab_size": 50,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 3,
        "mlp_only_layers": [5],
    }
    c = from_hf(cfg)
    assert c.moe_layers == (2,) and c.is_moe
    assert from_hf({**cfg, "decoder_sparse_step": 1}).moe_layers == (0, 1, 2, 3, 4, 6)
    assert not from_hf({**cfg, "num_experts": 0, "num_experts_per_tok": 0}).is_moe


def test_bad_moe_config_is_one_line(tmp_path):
    from hipc.base.errors import HipcError

    cfg = {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 50,
        "num_local_experts": 4,
        "num_experts_per_tok": 5,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from hipc.graphs.config import from_hf

    with pytest.raises(HipcError, match="num_experts_per_tok \\(5\\)"):
        from_hf(cfg)


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["hf", "gguf", "artifact"])
def test_info_counts_active_parameters(tmp_path, capsys, kind):
    """`hipc info` of the HF folder, of a GGUF of it and of its compiled artifact: the
    parameters transformers counts, and those a token reads."""
    from hipc.cli.main import main

    from gguf_writer import write_gguf

    hf = make_moe_model("qwen2_moe-e11-k3-shared-norm-step2")
    hf.save_pretrained(tmp_path / "m")
    target = tmp_path / "m"
    if kind == "gguf":
        target = write_gguf(hf, tmp_path / "m.gguf", "qwen2moe", tokenizer=False)
    elif kind == "artifact":
        assert main(["compile", str(target), "-o", str(tmp_path / "m.hipc"), "-q"]) == 0
        target = tmp_path / "m.hipc"
    capsys.readouterr()
    assert main(["info", str(target)]) == 0
    info = json.loads(capsys.readouterr().out)
    total = sum(p.numel() for p in hf.parameters())
    routed = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    idle = routed * (11 - 3) // 11  # a token reads 3 of the 11 experts
    assert info["graph" if kind != "artifact" else "weights"]["parameters"] == total
    assert info["moe"]["experts"] == 11 and info["moe"]["active_experts"] == 3
    assert info["moe"]["shared_expert"] and info["moe"]["sparse_layers"] == 1
    assert info["moe"]["active_parameters"] == total - idle


@pytest.mark.oracle
def test_bf16_checkpoint(tmp_path):
    """Released MoE checkpoints are bf16: per-expert bf16 tensors stacked, then widened."""
    transformers = require("transformers")
    torch = require("torch")
    make_moe_model("qwen3_moe-e7-k2-norm-mlp_only").to(torch.bfloat16).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.experts(0)["gate"].dtype == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    check_against(hf.eval(), tmp_path)


@pytest.mark.oracle
@pytest.mark.parametrize("family", ["qwen2_moe-e5-k1-shared", "olmoe-e5-k2-norm-clip"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_canonical_moe_graph_keeps_logits(family, dtype, tmp_path):
    """canonicalize (Experts on the stored 3-D weights) and repack leave the logits alone.
    Qwen2-MoE's block reads its norm with four Linears: the router merges with the shared
    expert's sigmoid gate and the shared gate with its up (a GLU pair), not all four; and
    the residual takes the experts' sum and the shared expert as two Adds."""
    torch = require("torch")
    from hipc.compiler.ir.verify import verify
    from hipc.compiler.passes.canonicalize import canonicalize
    from hipc.compiler.passes.repack import merge_parallel_linears, split_residual_sums

    make_moe_model(family).to(getattr(torch, dtype)).save_pretrained(tmp_path)
    graph = build_graph(load_model(tmp_path), max_ctx=32)
    canonical = verify(canonicalize(graph))
    canonical = verify(merge_parallel_linears(verify(split_residual_sums(canonical))))
    experts = [n for n in canonical.nodes if n.op == "hipc::Experts"]
    assert experts and all(i in canonical.initializers for n in experts for i in n.inputs[3:])
    assert not any(n.op in ("Cast", "hipc::Dequantize") for n in canonical.nodes)
    if family.startswith("qwen2"):
        splits = {n.name: list(n.outputs) for n in canonical.nodes if n.op == "Split"}
        assert splits["l0.router+shared.expert_gate.split"] == [
            "l0.router",
            "l0.shared.expert_gate",
        ]
        assert splits["l0.shared.gate+up.split"] == ["l0.shared.gate", "l0.shared.up"]
        (add,) = canonical.consumers(experts[0].outputs[0])
        (last,) = canonical.consumers(add.outputs[0])
        assert "l0.attn.residual" in add.inputs and "l0.shared.scaled" in last.inputs
    tokens = np.random.default_rng(1).integers(0, 211, size=12).tolist()
    want = ReferenceExecutor(graph).logits(tokens)
    got = ReferenceExecutor(canonical).logits(tokens)
    assert rel_err(got, want) <= 1e-5


def quantizable_moe(**sizes):
    """The tiny Qwen3-MoE the quantized-expert tests write as GGUF (9 experts, all 8 routed,
    every layer sparse, widths that are whole quant blocks; `sizes` override them: 256 for
    the K-quants' super-blocks)."""
    widths = {"hidden_size": 64, "head_dim": 16, "moe_intermediate_size": 32, **sizes}
    return make_moe_model(
        "qwen3_moe-e9-k8-step2", decoder_sparse_step=1, norm_topk_prob=True, **widths
    )


# quantizable_moe's widths for the K-quants: rows of whole 256-weight super-blocks
KQUANT_WIDTHS = {"hidden_size": 256, "head_dim": 64, "moe_intermediate_size": 256}


def sharp_router_moe(router_scale: float, **sizes):
    """quantizable_moe with its routers scaled by `router_scale`: the model whose stepwise
    quantized decode the GPU test and the rounding model compare."""
    import torch

    src = quantizable_moe(**sizes)
    with torch.no_grad():
        for name, p in src.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(router_scale)
    return src
