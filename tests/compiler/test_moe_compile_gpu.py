"""MoE models compiled for GPU targets without a GPU: nvcc for sm_90, clang for gfx1100 and
gfx942 (compiler/kernels/moe.py's GPU half, templates/hip/moe_*.hip.j2).

The code objects must hold every kernel the plans launch; a sparse layer's decode is one
routing kernel (the norm and the router GEMV fused in) and two expert kernels (routing happens
on the device, inside the captured graph), or, where the router is read elsewhere too
(Qwen2-MoE's shared-expert gate), the lone norm, the router GEMV and the two expert kernels;
its prefill the device-side grouping chain. Q4_0 and Q4_K_M (Q4_K gate/up, Q6_K down) experts
stay quantized: their decode kernels multiply int8 (dp4a / v_dot4), and bf16 and quantized
experts prefill on the matrix instructions.
Qwen2-MoE's shared expert follows as a GLU GEMV and a down GEMV with the gated residual
(sigmoid of the router's extra column). The routing's tie order is checked on the host
(test_moe_route_host.py) and the kernels run on the GPU machine (tests/gpu).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from test_compile_gpu import (
    DOT4_INSTRUCTION,
    MMA_INSTRUCTION,
    compiled,
    kernel_code,
    launched_kernels,
)

from gguf_writer import q3_k_m_type, q4_k_m_type, requantize_gguf, write_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))  # the MoE families
from test_moe import KQUANT_WIDTHS, make_moe_model, quantizable_moe

from hipc.compiler.kernels.moe import SHORT_TILES_ENV

pytestmark = pytest.mark.oracle
TARGETS = ("sm_90", "gfx1100", "gfx942")


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    """OLMoE: k = 8 of 13 experts, the q/k norm over the whole projection (lone norms)."""
    root = tmp_path_factory.mktemp("olmoe")
    make_moe_model("olmoe-e13-k8").save_pretrained(root / "src")
    return compiled(root, root / "src", TARGETS)


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4")
    src = make_moe_model(
        "qwen3_moe-e9-k8-step2", hidden_size=64, head_dim=16, decoder_sparse_step=1,
        moe_intermediate_size=32,
    )  # fmt: skip
    path = write_gguf(src, root / "m.gguf", "qwen3moe", "Q4_0", tokenizer=False)
    # the short prefill tiles opted in (moe.short_tiles): sm_90 gets a grouping and GEMM pair
    # per tile height, each for its step sizes
    os.environ[SHORT_TILES_ENV] = "1"
    try:
        return compiled(root, path, TARGETS)
    finally:
        del os.environ[SHORT_TILES_ENV]


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """llama-quantize's Q4_K_M experts: gate and up Q4_K, down Q6_K (rows of 256: the
    super-blocks)."""
    root = tmp_path_factory.mktemp("q4_k_m")
    src = quantizable_moe(**KQUANT_WIDTHS)
    f32 = write_gguf(src, root / "f.gguf", "qwen3moe", "F32", tokenizer=False)
    return compiled(root, requantize_gguf(f32, root / "m.gguf", q4_k_m_type), TARGETS)


@pytest.fixture(scope="module")
def q3_k_m(tmp_path_factory):
    """llama-quantize's Q3_K_M experts: gate and up Q3_K (no offsets), down Q4_K."""
    root = tmp_path_factory.mktemp("q3_k_m")
    src = quantizable_moe(**KQUANT_WIDTHS)
    f32 = write_gguf(src, root / "f.gguf", "qwen3moe", "F32", tokenizer=False)
    return compiled(root, requantize_gguf(f32, root / "m.gguf", q3_k_m_type), TARGETS)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    make_moe_model("qwen2_moe-e11-k3-shared-norm-step2").save_pretrained(root / "src")
    return compiled(root, root / "src", TARGETS)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    torch = pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("bf16")
    make_moe_model("mixtral-e8-k1").to(torch.bfloat16).save_pretrained(root / "src")
    return compiled(root, root / "src", (*TARGETS, "gfx1201"))


def steps(artifact, target):
    return json.loads((artifact / "plan.json").read_text())["targets"][target]["steps"]


@pytest.mark.parametrize("target", TARGETS)
def test_moe_kernels_in_every_code_object(olmoe, q4, shared, target):
    for art, layer in ((olmoe, "l0"), (q4, "l0"), (shared, "l1")):
        code = kernel_code(art, target)
        assert launched_kernels(art, target) <= set(code)
        group = f"{layer}.moe"
        decode = [x["kernel"] for x in steps(art, target)["decode"] if x["group"] == group]
        launches = [x for x in steps(art, target)["prefill"] if x["group"] == group]
        prefill = [x["kernel"] for x in launches]
        # (the grouped GEMMs are _mma_ kernels for bf16 and quantized experts), once per tile
        # height (moe.tile_ranges), each height for its step sizes: together every size once
        kinds = [k.split("_prefill_")[-1].split("_mma_")[-1] for k in prefill]
        heights = (len(kinds) - 2) // 3
        assert kinds == ["route", *["group", "gate_up", "down"] * heights, "combine"]
        # 16, 32 and 64 rows where opted in (E = 9, k = 8: the short ones for steps up to 32)
        assert heights == (3 if art is q4 and target == "sm_90" else 1)
        max_tokens = json.loads((art / "plan.json").read_text())["max_tokens"]
        ranges = [tuple(x.get("tokens", (1, max_tokens))) for x in launches[1:-1]]
        assert ranges == [r for r in ranges[::3] for _ in range(3)]
        covered = sorted(t for lo, hi in ranges[::3] for t in range(lo, hi + 1))
        assert covered == list(range(1, max_tokens + 1))
        groups = [x["group"] for x in steps(art, target)["decode"]]
        i = groups.index(group)
        if art is shared:
            # the norm and the router (with the shared expert's gate column) are read by the
            # shared expert too: they stay kernels of their own, and _up routes
            assert [k.rsplit("_", 1)[-1] for k in decode] == ["up", "down"]
            router = f"{layer}.router+shared.expert_gate"
            assert groups[i - 2 : i] == [f"{layer}.ffn_norm", router]
        else:
            # the norm and the router's GEMV fused in: one routing kernel, then the experts
            assert [k.rsplit("_", 1)[-1] for k in decode] == ["route", "up", "down"]
            assert groups[i - 1] == f"{layer}.o"


@pytest.mark.parametrize("target", TARGETS)
def test_shared_expert_after_the_experts(shared, target):
    """moe adds the routed sum in place, then the shared expert: its gate+up GLU GEMV and its
    down GEMV adding sigmoid(gate logit) * row, the logit read from the router's last column."""
    plan = json.loads((shared / "plan.json").read_text())
    decode = plan["targets"][target]["steps"]["decode"]
    groups = [x["group"] for x in decode]
    i = groups.index("l1.moe")
    assert groups[i : i + 4] == ["l1.moe", "l1.moe", "l1.shared.gate+up", "l1.shared.down"]
    down = decode[i + 3]
    assert "_residual_sig_" in down["kernel"]
    assert down["args"][-1] == {"kind": "int", "value": 12}  # ldg: the router's 11 + the gate
    assert launched_kernels(shared, target) <= set(kernel_code(shared, target))


@pytest.mark.parametrize("target", TARGETS)
def test_quantized_experts_decode_on_int8_dot_products(q4, target):
    plan = json.loads((q4 / "plan.json").read_text())
    experts = [w for w in plan["weights"] if w["name"].endswith("_exps.weight")]
    assert experts and all(w["dtype"] == "q4_0" and len(w["shape"]) == 3 for w in experts)
    code = kernel_code(q4, target)
    moe = [k for k in code if k.startswith("moe_") and k.endswith(("_up", "_down"))]
    moe = [k for k in moe if "_decode_" in k]
    assert len(moe) == 2 and all(DOT4_INSTRUCTION[target] in code[k] for k in moe)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mix", ["q4_k_m", "q3_k_m"])
def test_k_quant_experts_on_int8_dot_products_and_matrix_instructions(mix, target, request):
    """Q4_K gate/up and Q6_K down experts (Q4_K_M), Q3_K and Q4_K (Q3_K_M): the decode kernels
    multiply their quants as int8, the grouped prefill GEMMs on the matrix instructions; every
    launched kernel is in the code object."""
    art = request.getfixturevalue(mix)
    types = {"q4_k_m": ("q4_k", "q6_k"), "q3_k_m": ("q3_k", "q4_k")}[mix]
    plan = json.loads((art / "plan.json").read_text())
    experts = {w["name"]: w["dtype"] for w in plan["weights"] if len(w["shape"]) == 3}
    assert {d for n, d in experts.items() if "down" in n} == {types[1]}
    assert {d for n, d in experts.items() if "down" not in n} == {types[0]}
    code = kernel_code(art, target)
    assert launched_kernels(art, target) <= set(code)
    decode = [x["kernel"] for x in steps(art, target)["decode"] if x["group"] == "l0.moe"]
    assert [k.rsplit("_", 1)[-1] for k in decode] == ["route", "up", "down"]
    assert all(DOT4_INSTRUCTION[target] in code[k] for k in decode[1:])
    gemms = [x for x in steps(art, target)["prefill"] if x["group"] == "l0.moe"][2:4]
    assert [x["kernel"].rsplit("_mma_", 1)[-1] for x in gemms] == ["gate_up", "down"]
    want = {**MMA_INSTRUCTION, "sm_90": MMA_INSTRUCTION["sm_80"]}[target]
    assert all(want in code[x["kernel"]] for x in gemms)


@pytest.mark.parametrize("target", TARGETS)
def test_bf16_experts_prefill_on_matrix_instructions(bf16, q4, target):
    code = kernel_code(bf16, target)
    gemms = [x for x in steps(bf16, target)["prefill"] if x["group"] == "l0.moe"][2:4]
    assert [x["kernel"].rsplit("_mma_", 1)[-1] for x in gemms] == ["gate_up", "down"]
    # the grouped GEMMs run on mma.sync on Hopper too (no wgmma form for them yet)
    want = {**MMA_INSTRUCTION, "sm_90": MMA_INSTRUCTION["sm_80"]}[target]
    assert all(want in code[x["kernel"]] for x in gemms)
    assert all(x["shared"] > 0 for x in gemms)
    # quantized experts too, as their integer quants (exact in bf16), scaled per group
    q4_gemms = [x for x in steps(q4, target)["prefill"] if x["group"] == "l0.moe"][2:4]
    assert [x["kernel"].rsplit("_mma_", 1)[-1] for x in q4_gemms] == ["gate_up", "down"]
    q4_code = kernel_code(q4, target)
    assert all(want in q4_code[x["kernel"]] for x in q4_gemms)


def test_bf16_experts_prefill_on_gfx1201_wmma(bf16):
    """RDNA4's WMMA (its own operand layout) in the grouped GEMMs too."""
    code = kernel_code(bf16, "gfx1201")
    gemms = [x for x in steps(bf16, "gfx1201")["prefill"] if x["group"] == "l0.moe"][2:4]
    assert [x["kernel"].rsplit("_mma_", 1)[-1] for x in gemms] == ["gate_up", "down"]
    assert all(MMA_INSTRUCTION["gfx1201"] in code[x["kernel"]] for x in gemms)


@pytest.fixture(scope="module")
def olmoe_clip(tmp_path_factory):
    """OLMoE with clip_qkv: q, k, v clamped as the attention kernels read them."""
    root = tmp_path_factory.mktemp("olmoe_clip")
    make_moe_model("olmoe-e5-k2-norm-clip").save_pretrained(root / "src")
    return compiled(root, root / "src", ("sm_90", "gfx942"))


def attention_bodies(artifact, target) -> dict[str, str]:
    """The rendered source of each attention kernel (rope_kv, prefill, decode) by name."""
    source = (artifact / "kernels" / f"{target}.hip").read_text()
    bodies = {}
    for part in source.split("\nHIPC_KERNEL ")[1:]:
        name = re.match(r"void\s+(?:\w+\([\d, ]+\)\s+)?(\w+)\(", part)  # after the bounds macro
        if name and name.group(1).startswith("attention_"):
            bodies[name.group(1)] = part
    return bodies


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_olmoe_clip_qkv_in_the_attention_kernels(olmoe_clip, olmoe, target):
    assert launched_kernels(olmoe_clip, target) <= set(kernel_code(olmoe_clip, target))
    clipped = attention_bodies(olmoe_clip, target)
    assert len(clipped) >= 3, sorted(clipped)  # rope_kv, a prefill attention, decode
    assert all("hipc_clip(" in body and "0.4000000" in body for body in clipped.values())
    # without clip_qkv the switch is off at compile time: no clamp is emitted
    plain = attention_bodies(olmoe, target)
    assert plain and not any("hipc_clip(" in body for body in plain.values())
