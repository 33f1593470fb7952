"""Which GGML type each weight matrix gets under `--quant RECIPE`.

Each recipe is llama-quantize's file type of that name as its llama_tensor_get_type
picks types without an importance matrix (facts, not code, taken from llama.cpp's
src/llama-quant.cpp): a base type for every matrix, the exceptions in RULES below, then
the row-length fallback. `q4_k` and `q5_k` are the *_S file types minus Q4_K_S's few
Q5_K layers; `q3_k` is Q3_K_S; `q2_k` is Q2_K (not Q2_K_S); `iq4_nl` / `iq4_xs` as without
an importance matrix. Only matrices (2-D float weights) and MoE experts (3-D: GGUF's stacked
tensors, HF's per-expert ones as a StackedWeight) are quantized; norms, biases and the
routers (llama-quantize keeps every ffn_gate_inp as it is) stay.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hipc.base.errors import HipcError
from hipc.compiler.ir import QUANT_BLOCKS, QUANT_DTYPES, Graph, StackedWeight, WeightRef
from hipc.graphs.names import FAMILY_NAME_TABLES, NAME_TABLES

# recipe -> the type of every matrix no rule below picks for
BASE = {
    "q8_0": "q8_0",
    "q4_0": "q4_0",
    "q4_1": "q4_1",
    "q5_0": "q5_0",
    "q5_1": "q5_1",
    "iq4_nl": "iq4_nl",
    "iq4_xs": "iq4_xs",
    "q2_k": "q2_k",
    "q3_k": "q3_k",
    "q4_k": "q4_k",
    "q5_k": "q5_k",
    "q6_k": "q6_k",
    "q3_k_m": "q3_k",
    "q3_k_l": "q3_k",
    "q4_k_m": "q4_k",
    "q5_k_m": "q5_k",
}
RECIPES = tuple(BASE)
_FLOATS = ("float32", "float16", "bfloat16", "float64")
_ALL = RECIPES
_MIXES = ("q4_k_m", "q5_k_m")

# The exceptions to the base type, first match wins:
#   (recipes, roles, on which layers, type, why)
# "output" is the LM head, or the embedding when it is tied (it is the LM head then).
RULES = (
    # The output matrix's error lands directly on the logits, and it is one matrix, so
    # 6 bits cost little (a Q8_0 recipe keeps Q8_0).
    (_ALL, ("output",), "base is not q8_0", "q6_k", "output matrix"),
    # 8 experts (Mixtral): attention is a small part of the model, so k and v get 8 bits
    # (over any other rule for them) and the output projection 5 in Q4_K_M, Q3_K_S and Q3_K_M
    # (llama.cpp's n_expert == 8 rules; its list leaves Q3_K_L's at the base type)
    (_ALL, ("v", "k"), "8 experts", "q8_0", "8-expert model"),
    (
        ("q4_k_m", "q2_k", "q3_k", "q3_k_m", "iq4_nl", "iq4_xs"),
        ("o",),
        "8 experts",
        "q5_k",
        "8-expert model",
    ),
    (("q3_k_l",), ("o",), "8 experts", "q3_k", "8-expert model"),
    # attn_v is small under GQA and feeds every head's output; ffn_down is the matmul
    # most sensitive to quantization. Both get 6 bits on the "more bits" layers: the
    # first and last eighth of the layers and every third layer between them.
    (_MIXES, ("v", "down"), "more-bits layer", "q6_k", "on a more-bits layer"),
    # 70B-class models (80 layers, GQA): 8 query heads share each v head, so v is 8x
    # smaller than q and 5 bits cost almost nothing (llama.cpp's LLM_TYPE_70B rule,
    # which lifts only 3- and 4-bit types).
    (
        ("q4_k_m", "q4_k", "q3_k", "q3_k_m", "q2_k"),
        ("v",),
        "80 layers with GQA",
        "q5_k",
        "80-layer GQA",
    ),
    # Q3_K_M: v 5 bits on its first two layers and down on the first sixteenth, else both 4,
    # as o; Q3_K_L: all three 5 bits
    (("q3_k_m",), ("v",), "first 2 layers", "q5_k", "the first two layers"),
    (("q3_k_m",), ("down",), "first sixteenth", "q5_k", "the first sixteenth of the layers"),
    (("q3_k_m",), ("v", "o", "down"), "always", "q4_k", "Q3_K_M's 4-bit matrices"),
    (("q3_k_l",), ("v", "o", "down"), "always", "q5_k", "Q3_K_L's 5-bit matrices"),
    # Q2_K: attn_v 4 bits under a GQA of 4 or more, else 3 as attn_output and ffn_down
    (("q2_k",), ("v",), "GQA of 4 or more", "q4_k", "4+ query heads a KV head"),
    (("q2_k",), ("v", "o", "down"), "always", "q3_k", "Q2_K's 3-bit matrices"),
    # IQ4_NL / IQ4_XS (no importance matrix): attn_v 5 bits where 4 or more query heads share
    # each KV head, ffn_down on the first eighth of the layers
    (("iq4_nl", "iq4_xs"), ("v",), "GQA of 4 or more", "q5_k", "4+ query heads a KV head"),
    (("iq4_nl", "iq4_xs"), ("down",), "first eighth", "q5_k", "the first eighth of the layers"),
    # a fused q/k/v (GGUF's attn_qkv: Qwen3.5's linear-attention in_proj_qkv) is one step
    # up in the *_M mixes: llama.cpp's ATTENTION_QKV rule
    (("q4_k_m",), ("ssm_qkv",), "always", "q5_k", "fused q/k/v"),
    (("q5_k_m",), ("ssm_qkv",), "always", "q6_k", "fused q/k/v"),
    (("q3_k_m", "q3_k_l"), ("ssm_qkv",), "always", "q4_k", "fused q/k/v"),
)
# roles llama-quantize never quantizes: the routers (and Qwen2-MoE's shared-expert gate,
# a 1-D tensor in its GGUF files)
KEEP = ("router", "shared_expert_gate")
# expert and shared-expert roles -> the dense role whose rules they follow (llama.cpp
# matches tensor names by substring: ffn_down_exps and ffn_down_shexp are "ffn_down")
AS_ROLE = {
    "down_exp": "down",
    "down_exps": "down",
    "shared_down": "down",
    "gate_exp": "gate",
    "gate_exps": "gate",
    "shared_gate": "gate",
    "up_exp": "up",
    "up_exps": "up",
    "shared_up": "up",
}

# A row whose length is not a multiple of 256 cannot hold K-quant super-blocks; these
# are llama.cpp's substitutes (32-element blocks, about as many bits). A row that is not
# a multiple of 32 either stays in its float type (llama.cpp would write F16).
K_FALLBACK = {
    "q2_k": "q4_0",
    "q3_k": "q4_0",
    "q4_k": "q5_0",
    "q5_k": "q5_1",
    "q6_k": "q8_0",
    "iq4_xs": "iq4_nl",
}


@dataclass(frozen=True)
class TensorChoice:
    ref: WeightRef | StackedWeight
    role: str | None  # "q", "down", "embed" ... (graphs/names.py), None if unknown
    layer: int | None
    dtype: str  # the type it will be stored in (its own float type if left alone)
    why: str


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits in the *_M mixes."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def choose_types(graph: Graph, recipe: str) -> dict[str, TensorChoice]:
    """Initializer name -> the type the recipe gives it, for every 2-D weight and every
    3-D expert tensor from a file."""
    if recipe not in RECIPES:
        raise HipcError(f"--quant: unknown recipe {recipe!r} (known: {', '.join(RECIPES)})")
    mats: dict[str, WeightRef | StackedWeight] = {
        name: init
        for name, init in graph.initializers.items()
        if (isinstance(init, WeightRef) and len(init.shape) in (2, 3))
        or isinstance(init, StackedWeight)
    }
    for init in mats.values():
        if init.dtype in QUANT_DTYPES:
            ref = init.parts[0] if isinstance(init, StackedWeight) else init
            raise HipcError(
                f"--quant: {ref.path}: tensor {ref.name!r} is already {init.dtype}; "
                "--quant needs float weights (a bf16/f16/f32 model)"
            )
    roles = {
        name: _role(init.parts[0] if isinstance(init, StackedWeight) else init)
        for name, init in mats.items()
    }
    mats = {n: w for n, w in mats.items() if roles[n][0] not in KEEP}
    experts = {w.shape[0] for w in mats.values() if len(w.shape) == 3}
    has_lm_head = any(r == "lm_head" for r, _ in roles.values())
    layers = [i for _, i in roles.values() if i is not None]
    n_layers = max(layers) + 1 if layers else 0
    gqa = _gqa(mats, roles)

    out = {}
    for name, init in mats.items():
        role, layer = roles[name]
        if init.dtype not in _FLOATS:
            continue
        if role == "lm_head" or (role == "embed" and not has_lm_head):
            role = "output"
        role = AS_ROLE.get(role, role)
        dtype, why = pick_type(recipe, role, layer, n_layers, gqa=gqa, experts=experts)
        dtype, why = _fit(dtype, why, init)
        out[name] = TensorChoice(init, role, layer, dtype, why)
    return out


def pick_type(
    recipe: str,
    role: str | None,
    layer: int | None,
    n_layers: int,
    *,
    gqa: float = 1.0,
    experts: set[int] | frozenset[int] = frozenset(),
) -> tuple[str, str]:
    """The type RULES give a matrix of this role ("output" for the LM head, the dense role
    for an expert's) on this layer, and why, before the row-length fallback."""
    when = {
        "base is not q8_0": BASE[recipe] != "q8_0",
        "more-bits layer": layer is not None and use_more_bits(layer, n_layers),
        "first 2 layers": layer is not None and layer < 2,
        "first sixteenth": layer is not None and layer < n_layers // 16,
        "first eighth": layer is not None and layer < n_layers // 8,
        "GQA of 4 or more": gqa >= 4,
        "80 layers with GQA": n_layers == 80 and gqa > 1,
        "8 experts": experts == {8},
        "always": True,
    }
    for recipes, roles, on, rule_type, rule_why in RULES:
        if recipe in recipes and role in roles and when[on]:
            return rule_type, f"{role}: {rule_why}"
    return BASE[recipe], "base type"


def _fit(dtype: str, why: str, init: WeightRef | StackedWeight) -> tuple[str, str]:
    """The row-length fallback: K-quants need 256-element rows, the others 32."""
    k = init.shape[-1]
    if k % QUANT_BLOCKS[dtype][0] and dtype in K_FALLBACK:
        why = f"{why}; rows of {k} are not whole 256-blocks: {K_FALLBACK[dtype]} for {dtype}"
        dtype = K_FALLBACK[dtype]
    if k % QUANT_BLOCKS[dtype][0]:
        return init.dtype, f"{why}; rows of {k} are not whole 32-blocks: kept {init.dtype}"
    return dtype, why


def _gqa(
    mats: dict[str, WeightRef | StackedWeight], roles: dict[str, tuple[str | None, int | None]]
) -> float:
    """Query heads per KV head (llama.cpp's n_gqa), from layer 0's q and v rows; 1 if unknown."""
    rows = {roles[n]: w.shape[0] for n, w in mats.items() if roles[n][1] == 0}
    if ("q", 0) not in rows or ("v", 0) not in rows:
        return 1.0
    return rows[("q", 0)] / rows[("v", 0)]


_PATTERNS: dict[str, list[tuple[re.Pattern, str]]] = {}


def _role(ref: WeightRef) -> tuple[str | None, int | None]:
    """(role, layer) of a source tensor, by its file format's name table."""
    patterns = _PATTERNS.get(ref.format)
    if patterns is None:
        # every family's table (the hybrids' attn_qkv ...): a matrix's name means one role in
        # all of them; a role may list alternative names; {e} (an expert's index) is not
        # captured
        tables = [NAME_TABLES, *FAMILY_NAME_TABLES.values()]
        patterns = _PATTERNS[ref.format] = [
            (
                re.compile(
                    re.escape(t)
                    .replace(re.escape("{i}"), r"(\d+)")
                    .replace(re.escape("{e}"), r"\d+")
                    + "$"
                ),
                role,
            )
            for table in tables
            for role, names in table.get(ref.format, {}).items()
            for t in (names if isinstance(names, tuple) else (names,))
        ]
    for pattern, role in patterns:
        m = pattern.match(ref.name)
        if m:
            return role, int(m.group(1)) if m.groups() else None
    return None, None
