"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrids compiled for GPU targets without a GPU: nvcc
for sm_90, clang for gfx1100 and gfx942 (compiler/kernels/deltanet.py's GPU half,
templates/hip/deltanet.hip.j2; the attention kernels' partial RoPE and output gate).

The code objects must hold every kernel the plans launch; each linear-attention layer is one
deltanet launch per decode step and per prefill step shorter than the delta rule's chunk (a
block per key head, a thread per state column of its value heads), and four chunked-prefill
launches (prep, solve, scan, norm) in steps of a chunk or more; the full-attention layers
launch the gated, partially rotating
attention kernels (sm_90 prefill: the flash kernel under the default bf16 policy). The
kernels run on the GPU machine (tests/gpu/test_deltanet_gpu.py, test_compiled_hybrid_gpu.py).
"""

from __future__ import annotations

import json

import pytest
from test_compile_gpu import compiled, kernel_code, launched_kernels

from support import HYBRID_FAMILIES, make_hybrid_hf

pytestmark = pytest.mark.oracle
TARGETS = ("sm_90", "gfx1100", "gfx942")
WAVE = {"sm_90": 32, "gfx1100": 32, "gfx942": 64}


@pytest.fixture(scope="module", params=sorted(HYBRID_FAMILIES))
def hybrid(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = make_hybrid_hf(request.param, root / "src")
    return request.param, model.config, compiled(root, root / "src", TARGETS)


def plan_steps(artifact, target):
    return json.loads((artifact / "plan.json").read_text())["targets"][target]["steps"]


@pytest.mark.parametrize("target", TARGETS)
def test_hybrid_kernels_in_every_code_object(hybrid, target):
    _, _, art = hybrid
    assert launched_kernels(art, target) <= set(kernel_code(art, target))


@pytest.mark.parametrize("target", TARGETS)
def test_deltanet_launches_per_linear_layer_step(hybrid, target):
    family, cfg, art = hybrid
    linear = [f"l{i}" for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    threads = -(-(nv // nk) * dv // WAVE[target]) * WAVE[target]
    plan = json.loads((art / "plan.json").read_text())
    steps, max_tokens = plan["targets"][target]["steps"], plan["max_tokens"]
    assert max_tokens >= 64
    for step in ("decode", "prefill", "batch"):
        launches = [x for x in steps[step] if x["kernel"].startswith("deltanet_")]
        groups = [x["group"].split(".")[0] for x in launches]
        per_layer = 5 if step == "prefill" else 1
        assert groups == [g for g in linear for _ in range(per_layer)], family
        # the conv window and the delta-rule matrices are each launch's two state arguments,
        # their slots the rows' sequences
        assert all(sum(a["kind"] == "state" for a in x["args"]) == 2 for x in launches)
        assert all(
            [a["name"] for a in x["args"] if a["kind"] == "input"] == ["pos", "seq"]
            for x in launches
        )
        serial = launches[::per_layer]
        # a block per key head and row (the rows of one sequence's run: its first row's)
        assert all(x["grid"] == [nk, "T"] and x["block"] == [threads] for x in serial)
        if step == "batch":
            # rows of several sequences: the serial kernel whatever the step's size
            assert all("tokens" not in x for x in serial)
        if step == "prefill":
            assert all(x["tokens"] == [2, 63] for x in serial)
            chunked = [x for x in launches if x not in serial]
            parts = [x["kernel"].rsplit("_", 1)[1] for x in chunked]
            assert parts == ["prep", "solve", "scan", "norm"] * len(linear)
            assert all(x["tokens"] == [64, max_tokens] for x in chunked)
            cols = next(b for b in (8, 4, 2, 1) if dv % b == 0)  # per scan block
            assert [x["grid"] for x in chunked[:4]] == [
                ["T", nk], [nv, "cdiv(T,64)"], [nv, dv // cols], ["T"]
            ]  # fmt: skip
            # their scratch: one region, the same for every layer
            assert len({str(x["args"][-1]) for x in chunked}) == 1


def test_gated_partial_rope_attention_on_sm90(hybrid):
    """The full-attention layers' kernels carry the switches (their sources say so) and the
    sm_90 prefill attends on the flash kernel."""
    _, cfg, art = hybrid
    source = (art / "kernels" / "sm_90.hip").read_text()
    rope = getattr(cfg, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") or cfg.partial_rotary_factor
    rot = int(cfg.head_dim * factor)
    assert f"RoPE rotates the first {rot} of the {cfg.head_dim} dims" in source
    assert "out = attention * sigmoid(gate)" in source
    prefill = {x["kernel"].rsplit("_", 1)[-1] for x in plan_steps(art, "sm_90")["prefill"]}
    assert {"kv", "flash"} <= prefill, prefill  # ..._rope_kv, ..._flash


def test_q4_k_m_hybrid_moe_gguf_on_every_target(tmp_path):
    """Qwen3.5-MoE from a GGUF in llama-quantize's Q4_K_M types (K-quant matrices, Q5_0 where
    a row is no whole super-block, Q4_K / Q6_K experts): every kernel the plans launch is in
    the code objects, the experts' decode kernels on int8 dot products."""
    from test_compile_gpu import DOT4_INSTRUCTION

    from gguf_writer import q4_k_m_type, requantize_gguf, write_hybrid_gguf

    widths = dict(hidden_size=256, linear_value_head_dim=64, moe_intermediate_size=256)
    hf = make_hybrid_hf("qwen3_5_moe", tmp_path / "hf", seed=8, **widths)
    f32 = write_hybrid_gguf(hf, tmp_path / "f.gguf", "qwen35moe")
    path = requantize_gguf(
        f32, tmp_path / "m.gguf", lambda n, s: q4_k_m_type(n, s, experts_only=False)
    )
    art = compiled(tmp_path, path, TARGETS)
    plan = json.loads((art / "plan.json").read_text())
    types = {w["dtype"] for w in plan["weights"]}
    assert {"q4_k", "q6_k", "q5_0"} <= types, types
    for target in TARGETS:
        code = kernel_code(art, target)
        assert launched_kernels(art, target) <= set(code)
        decode = plan_steps(art, target)["decode"]
        experts = [x["kernel"] for x in decode if x["kernel"].endswith(("_up", "_down"))]
        experts = [k for k in experts if k.startswith("moe_")]
        assert experts and all(DOT4_INSTRUCTION[target] in code[k] for k in experts)
