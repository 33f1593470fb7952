"""--quant recipes: the type each matrix gets (compiler/quant_recipes.py).

The *_k_m mixes are checked against what llama.cpp's own llama-quantize wrote:
the real SmolLM2-135M-Instruct requantized to Q4_K_M held 166 Q5_0, 16 Q4_K, 15 Q8_0
and 14 Q6_K matrices (issue 12), and Llama-3-8B's Q4_K_M holds 193 Q4_K and 33 Q6_K
(llama.cpp's load log for it).
"""

from __future__ import annotations

from collections import Counter

import pytest

from hipc.base.errors import HipcError
from hipc.compiler.ir import Graph, StackedWeight, TensorType, WeightRef
from hipc.compiler.quant_recipes import RECIPES, choose_types, use_more_bits
from hipc.graphs.names import FAMILY_NAME_TABLES, NAME_TABLES


def shaped_graph(fmt, layers, hidden, ffn, vocab, q_rows, kv_rows, tied, dtype="bfloat16"):
    """A graph holding just the initializers a Llama-family model of this shape has."""
    g, table = Graph("shape"), NAME_TABLES[fmt]

    def add(role, i, shape):
        name = table[role].format(i=i)
        ref = WeightRef("/nonexistent", name, dtype, shape, fmt)
        g.add_initializer(name, ref, TensorType(dtype, shape))

    add("embed", None, (vocab, hidden))
    add("norm", None, (hidden,))
    if not tied:
        add("lm_head", None, (vocab, hidden))
    for i in range(layers):
        add("attn_norm", i, (hidden,))
        add("q", i, (q_rows, hidden))
        add("k", i, (kv_rows, hidden))
        add("v", i, (kv_rows, hidden))
        add("o", i, (hidden, q_rows))
        add("gate", i, (ffn, hidden))
        add("up", i, (ffn, hidden))
        add("down", i, (hidden, ffn))
    return g


SMOLLM2 = dict(layers=30, hidden=576, ffn=1536, vocab=49152, q_rows=576, kv_rows=192, tied=True)
LLAMA3_8B = dict(
    layers=32, hidden=4096, ffn=14336, vocab=128256, q_rows=4096, kv_rows=1024, tied=False
)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_q4_k_m_on_smollm2_matches_llama_quantize(fmt):
    types = choose_types(shaped_graph(fmt, **SMOLLM2), "q4_k_m")
    assert Counter(c.dtype for c in types.values()) == {
        "q5_0": 166,
        "q4_k": 16,
        "q8_0": 15,
        "q6_k": 14,
    }
    by_role = {(c.role, c.layer): c.dtype for c in types.values()}
    # the tied embedding is the output matrix: 576 is not whole super-blocks -> Q8_0
    assert by_role[("output", None)] == "q8_0"
    for i in range(30):
        more = use_more_bits(i, 30)
        assert by_role[("down", i)] == ("q6_k" if more else "q4_k")  # 1536 = 6 x 256
        assert by_role[("v", i)] == ("q8_0" if more else "q5_0")  # Q6_K / Q4_K fallbacks
        assert by_role[("q", i)] == "q5_0"


def test_q4_k_m_on_llama3_8b_matches_llama_quantize():
    types = choose_types(shaped_graph("safetensors", **LLAMA3_8B), "q4_k_m")
    assert Counter(c.dtype for c in types.values()) == {"q4_k": 193, "q6_k": 33}
    by_role = {(c.role, c.layer): c.dtype for c in types.values()}
    assert by_role[("output", None)] == "q6_k"
    assert by_role[("embed", None)] == "q4_k"  # untied: the base type


def test_more_bits_layers():
    # first and last eighth, every third layer between (llama.cpp's use_more_bits)
    assert [i for i in range(32) if use_more_bits(i, 32)] == [
        0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31,
    ]  # fmt: skip


def test_q5_k_m_and_the_70b_rule():
    g = shaped_graph("safetensors", 80, 8192, 28672, 1000, 8192, 1024, False)
    q4 = choose_types(g, "q4_k_m")
    q5 = choose_types(g, "q5_k_m")
    v4 = Counter(c.dtype for c in q4.values() if c.role == "v")
    assert v4 == {"q6_k": 40, "q5_k": 40}  # 80-layer GQA: the other attn_v get Q5_K
    assert Counter(c.dtype for c in q5.values() if c.role == "v") == {"q6_k": 40, "q5_k": 40}
    assert Counter(c.dtype for c in q5.values()) == {"q5_k": 80 * 5 + 40 + 40 + 1, "q6_k": 81}


@pytest.mark.parametrize("recipe", ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k"])
def test_plain_types_with_the_output_rule_and_row_length_fallback(recipe):
    types = choose_types(shaped_graph("safetensors", **SMOLLM2), recipe)
    fallback = {"q4_k": "q5_0", "q6_k": "q8_0"}.get(recipe, recipe)
    for c in types.values():
        if c.role == "output":  # the tied embedding: 576 is not whole super-blocks
            assert c.dtype == "q8_0", c
        else:
            whole = c.ref.shape[1] % 256 == 0
            assert c.dtype == (recipe if whole or recipe[-1] != "k" else fallback), c
    assert len(types) == 30 * 7 + 1  # every matrix; norms are not in the plan


def test_q4_0_on_llama3_8b_keeps_the_output_in_q6_k():
    # what issue 12 found in llama-quantize's Q4_0 of Llama-3-8B: output.weight in Q6_K
    types = choose_types(shaped_graph("safetensors", **LLAMA3_8B), "q4_0")
    assert Counter(c.dtype for c in types.values()) == {"q4_0": 225, "q6_k": 1}
    assert {c.role for c in types.values() if c.dtype == "q6_k"} == {"output"}
    assert Counter(
        c.dtype for c in choose_types(shaped_graph("safetensors", **LLAMA3_8B), "q8_0").values()
    ) == {"q8_0": 226}


def test_rows_not_whole_blocks_stay_float():
    g = shaped_graph("safetensors", 2, 64, 72, 100, 64, 32, True, dtype="float16")
    types = choose_types(g, "q4_0")
    assert {c.dtype for c in types.values() if c.ref.shape[1] == 72} == {"float16"}
    assert {c.dtype for c in types.values() if c.ref.shape[1] == 64 and c.role != "output"} == {
        "q4_0"
    }


def test_already_quantized_weights_are_refused():
    with pytest.raises(HipcError, match="already q4_0; --quant needs float weights"):
        choose_types(shaped_graph("gguf", 2, 64, 96, 100, 64, 32, False, dtype="q4_0"), "q8_0")


@pytest.mark.parametrize(("fmt", "recipe", "want"), [
    ("gguf", "q4_k_m", "q5_k"), ("safetensors", "q4_k_m", "q5_k"), ("gguf", "q5_k_m", "q6_k"),
    ("gguf", "q4_k", "q4_k"),
])  # fmt: skip
def test_a_fused_qkv_gets_a_step_up_in_the_mixes(fmt, recipe, want):
    """llama-quantize's ATTENTION_QKV rule: a fused attn_qkv (Qwen3.5's linear-attention
    in_proj_qkv) is Q5_K under Q4_K_M and Q6_K under Q5_K_M; the plain types leave it be."""
    g = shaped_graph(fmt, 2, 256, 512, 1000, 256, 128, False)
    name = FAMILY_NAME_TABLES["qwen3_5"][fmt]["ssm_qkv"]
    name = (name if isinstance(name, str) else name[0]).format(i=0)
    ref = WeightRef("/nonexistent", name, "bfloat16", (768, 256), fmt)
    g.add_initializer(name, ref, TensorType("bfloat16", ref.shape))
    choice = choose_types(g, recipe)[name]
    assert (choice.role, choice.dtype) == ("ssm_qkv", want)


def test_unknown_recipe():
    with pytest.raises(HipcError, match="unknown recipe 'q2_k_s'"):
        choose_types(shaped_graph("gguf", 2, 64, 96, 100, 64, 32, False), "q2_k_s")
    assert "q4_k_m" in RECIPES


# Llama-3-8B's Q3_K_S / Q3_K_M / Q3_K_L by llama.cpp's llama_tensor_get_type (src/
# llama-quant.cpp): Q3_K_M's attn_v is Q5_K on its first two layers, its ffn_down on the
# first sixteenth, both Q4_K after, attn_output Q4_K; Q3_K_L's three are Q5_K
@pytest.mark.parametrize(("recipe", "want"), [
    ("q3_k", {"q3_k": 225, "q6_k": 1}),
    ("q3_k_m", {"q3_k": 129, "q4_k": 92, "q5_k": 4, "q6_k": 1}),
    ("q3_k_l", {"q3_k": 129, "q5_k": 96, "q6_k": 1}),
])  # fmt: skip
def test_q3_k_recipes_on_llama3_8b(recipe, want):
    types = choose_types(shaped_graph("gguf", **LLAMA3_8B), recipe)
    assert Counter(c.dtype for c in types.values()) == want
    by_role = {(c.role, c.layer): c.dtype for c in types.values()}
    if recipe == "q3_k_m":
        assert [by_role[("v", i)] for i in range(4)] == ["q5_k", "q5_k", "q4_k", "q4_k"]
        assert [by_role[("down", i)] for i in range(3)] == ["q5_k", "q5_k", "q4_k"]  # 32 / 16
        assert {by_role[("o", i)] for i in range(32)} == {"q4_k"}
        assert by_role[("q", 5)] == by_role[("gate", 5)] == by_role[("embed", None)] == "q3_k"


def test_q2_k_recipe_on_llama3_8b_and_its_fallback():
    """llama.cpp's Q2_K of Llama-3-8B (llama_tensor_get_type): attn_v Q4_K (4 query heads a KV
    head), attn_output and ffn_down Q3_K, the rest and the embedding Q2_K, the output Q6_K;
    SmolLM2's 576-wide rows take Q2_K's fallback, Q4_0; an 80-layer GQA model's attn_v Q5_K."""
    types = choose_types(shaped_graph("gguf", **LLAMA3_8B), "q2_k")
    assert Counter(c.dtype for c in types.values()) == {
        "q2_k": 129,
        "q3_k": 64,
        "q4_k": 32,
        "q6_k": 1,
    }
    by_role = {(c.role, c.layer): c.dtype for c in types.values()}
    assert by_role[("v", 7)] == "q4_k" and by_role[("o", 7)] == by_role[("down", 7)] == "q3_k"
    smol = {
        (c.role, c.layer): c.dtype
        for c in choose_types(shaped_graph("safetensors", **SMOLLM2), "q2_k").values()
    }
    assert (
        smol[("q", 3)] == smol[("gate", 3)] == "q4_0" and smol[("down", 3)] == "q3_k"
    )  # 1536 = 6 x 256
    g = shaped_graph("safetensors", 80, 8192, 28672, 1000, 8192, 1024, False)
    assert Counter(c.dtype for c in choose_types(g, "q2_k").values() if c.role == "v") == {
        "q5_k": 80
    }


def test_q3_k_m_fallbacks_and_the_70b_and_8_expert_rules():
    # SmolLM2's 576-wide rows take Q3_K's fallback, Q4_0 (llama.cpp's tensor_type_fallback)
    smol = choose_types(shaped_graph("safetensors", **SMOLLM2), "q3_k_m")
    by_role = {(c.role, c.layer): c.dtype for c in smol.values()}
    assert by_role[("q", 3)] == "q4_0" and by_role[("gate", 3)] == "q4_0"
    assert by_role[("down", 0)] == "q5_k" and by_role[("down", 3)] == "q4_k"  # 1536 = 6 x 256
    assert by_role[("v", 0)] == "q5_1" and by_role[("v", 3)] == "q5_0"  # Q5_K / Q4_K's
    # 80 layers with GQA: every attn_v Q5_K (the 70B rule lifts Q3_K and Q4_K)
    g = shaped_graph("safetensors", 80, 8192, 28672, 1000, 8192, 1024, False)
    for recipe in ("q3_k", "q3_k_m", "q3_k_l"):
        v = Counter(c.dtype for c in choose_types(g, recipe).values() if c.role == "v")
        assert v == {"q5_k": 80}, (recipe, v)


def moe_shaped_graph(fmt, layers, experts, hidden, expert_ffn, shared_ffn=0, vocab=1000):
    """The initializers of a MoE model of this shape (8 layers, 4/2 heads of 64): routers,
    3-D experts (a StackedWeight of per-expert tensors under HF names), shared expert."""
    g, table = Graph("moe"), NAME_TABLES[fmt]

    def ref(role, i, shape, e=None):
        names = table[role]
        name = (names if isinstance(names, str) else names[0]).format(i=i, e=e)
        return WeightRef("/nonexistent", name, "float32", shape, fmt)

    def add(init):
        g.add_initializer(init.name, init, TensorType("float32", init.shape))

    add(ref("embed", None, (vocab, hidden)))
    add(ref("lm_head", None, (vocab, hidden)))
    for i in range(layers):
        for role, rows in (("q", 256), ("k", 128), ("v", 128)):
            add(ref(role, i, (rows, hidden)))
        add(ref("o", i, (hidden, 256)))
        add(ref("router", i, (experts, hidden)))
        for role, shape in (
            ("gate", (expert_ffn, hidden)),
            ("up", (expert_ffn, hidden)),
            ("down", (hidden, expert_ffn)),
        ):
            if fmt == "gguf":
                add(ref(f"{role}_exps", i, (experts, *shape)))
            else:
                parts = tuple(ref(f"{role}_exp", i, shape, e) for e in range(experts))
                add(StackedWeight(f"l{i}.{role}_exps", parts))
        if shared_ffn:
            add(ref("shared_gate", i, (shared_ffn, hidden)))
            add(ref("shared_up", i, (shared_ffn, hidden)))
            add(ref("shared_down", i, (hidden, shared_ffn)))
            add(ref("shared_expert_gate", i, (1, hidden)))
    return g


# The types llama.cpp's llama-quantize wrote for F32 GGUFs of these shapes (8 layers,
# hidden 256, 4/2 heads of 64, experts 256 wide; Mixtral written as llama.cpp's "llama"
# with 8 experts, Qwen2-MoE with a 512-wide shared expert), quantized tensors only.
LLAMA_QUANTIZE_MOE = {
    ("mixtral", "q4_0"): {"q4_0": 41, "q8_0": 16, "q6_k": 1},
    ("mixtral", "q4_k_m"): {"q4_k": 29, "q8_0": 16, "q5_k": 8, "q6_k": 5},
    ("mixtral", "q8_0"): {"q8_0": 58},
    ("qwen3moe", "q4_0"): {"q4_0": 57, "q6_k": 1},
    ("qwen3moe", "q4_k_m"): {"q4_k": 49, "q6_k": 9},
    ("qwen2moe", "q4_0"): {"q4_0": 81, "q6_k": 1},
    ("qwen2moe", "q4_k_m"): {"q4_k": 69, "q6_k": 13},
}
MOE_SHAPES = {
    "mixtral": dict(experts=8),
    "qwen3moe": dict(experts=9),
    "qwen2moe": dict(experts=5, shared_ffn=512),
}


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
@pytest.mark.parametrize("model,recipe", sorted(LLAMA_QUANTIZE_MOE))
def test_moe_recipes_match_llama_quantize(fmt, model, recipe):
    """Experts are quantized (3-D, or HF's per-expert tensors stacked) and follow the dense
    roles' rules (ffn_down_exps and ffn_down_shexp are ffn_down: more bits on the *_M
    mixes' layers); routers and the shared-expert gate are kept; 8 experts lift attn_k and
    attn_v to Q8_0 and Q4_K_M's attn_output to Q5_K."""
    g = moe_shaped_graph(fmt, 8, hidden=256, expert_ffn=256, **MOE_SHAPES[model])
    types = choose_types(g, recipe)
    assert Counter(c.dtype for c in types.values()) == LLAMA_QUANTIZE_MOE[(model, recipe)]
    assert not {c.role for c in types.values()} & {"router", "shared_expert_gate"}
    experts = [c for c in types.values() if len(c.ref.shape) == 3]
    assert len(experts) == 8 * 3
    if recipe == "q4_k_m":
        downs = {c.layer: c.dtype for c in experts if c.role == "down"}
        assert downs == {i: "q6_k" if use_more_bits(i, 8) else "q4_k" for i in range(8)}


# Q3_K_M of the same shapes by llama.cpp's rules (not a llama-quantize run): Mixtral's 8
# experts lift attn_k / attn_v to Q8_0 and attn_output to Q5_K; elsewhere attn_v is Q5_K on
# the first two layers and Q4_K after, attn_output and every ffn_down (experts and shared
# expert alike; 8 layers have no first sixteenth) Q4_K
Q3_K_M_MOE = {
    "mixtral": {"q3_k": 25, "q8_0": 16, "q5_k": 8, "q4_k": 8, "q6_k": 1},
    "qwen3moe": {"q3_k": 33, "q5_k": 2, "q4_k": 22, "q6_k": 1},
    "qwen2moe": {"q3_k": 49, "q5_k": 2, "q4_k": 30, "q6_k": 1},
}


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
@pytest.mark.parametrize("model", sorted(Q3_K_M_MOE))
def test_q3_k_m_moe(fmt, model):
    g = moe_shaped_graph(fmt, 8, hidden=256, expert_ffn=256, **MOE_SHAPES[model])
    types = choose_types(g, "q3_k_m")
    assert Counter(c.dtype for c in types.values()) == Q3_K_M_MOE[model]
    experts = {(c.role, c.layer): c.dtype for c in types.values() if len(c.ref.shape) == 3}
    assert {d for (role, _), d in experts.items() if role != "down"} == {"q3_k"}
    assert {d for (role, _), d in experts.items() if role == "down"} == {"q4_k"}


@pytest.mark.parametrize("recipe", ["iq4_nl", "iq4_xs"])
def test_iq4_recipes(recipe):
    """llama.cpp's IQ4_NL / IQ4_XS file types without an importance matrix: attn_v Q5_K where
    4 or more query heads share a KV head (Llama-3-8B's 32 / 8; SmolLM2's 9 / 3 is not),
    ffn_down Q5_K on the first eighth of the layers, Q6_K output; IQ4_XS rows that are not
    whole super-blocks fall back to IQ4_NL."""
    types = choose_types(shaped_graph("gguf", **LLAMA3_8B), recipe)
    assert Counter(c.dtype for c in types.values()) == {recipe: 189, "q5_k": 36, "q6_k": 1}
    by_role = {(c.role, c.layer): c.dtype for c in types.values()}
    assert {by_role[("v", i)] for i in range(32)} == {"q5_k"}
    assert [by_role[("down", i)] for i in range(3, 6)] == ["q5_k", recipe, recipe]  # 32 / 8
    smol = choose_types(shaped_graph("safetensors", **SMOLLM2), recipe)
    by_role = {(c.role, c.layer): c.dtype for c in smol.values()}
    assert by_role[("v", 0)] == by_role[("q", 0)] == "iq4_nl"  # 576: no super-blocks
    assert by_role[("down", 2)] == "q5_k" and by_role[("down", 3)] == recipe  # 30 / 8 = 3
