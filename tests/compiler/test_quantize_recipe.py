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
from hipc.compiler.ir import Graph, TensorType, WeightRef
from hipc.compiler.quant_recipes import RECIPES, choose_types, use_more_bits
from hipc.graphs.names import NAME_TABLES


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


def test_unknown_recipe():
    with pytest.raises(HipcError, match="unknown recipe 'q3_k_m'"):
        choose_types(shaped_graph("gguf", 2, 64, 96, 100, 64, 32, False), "q3_k_m")
    assert "q4_k_m" in RECIPES
