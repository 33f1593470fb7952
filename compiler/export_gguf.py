"""`hipc compile --export-gguf PATH`: the (quantized) model as a GGUF file llama.cpp loads.

The tensors are the graph's after the quantize stage, copied block for block, under
llama.cpp's names (graphs/names.py's GGUF table) with the metadata its loader reads
and the tokenizer. Layout facts follow llama.cpp's convert_hf_to_gguf.py:
- Mistral is written as the `llama` architecture (its loader has no `mistral`), Qwen2
  and Qwen3 as themselves;
- for `llama`, Q and K rows are permuted per head so llama.cpp's RoPE, which rotates
  adjacent pairs, sees what HF's rotate-half RoPE sees. Quantized rows are independent,
  so permuting rows of blocks is exact; a GGUF source is already in that layout;
- a tied embedding is written once, with no output.weight;
- MoE models (Qwen3-MoE, Qwen2-MoE, OLMoE as themselves, Mixtral as `llama` with experts):
  the router as ffn_gate_inp, the experts stacked 3-D as ffn_{gate,up,down}_exps [E, rows,
  cols] (HF's per-expert tensors stacked, a fused gate_up split by rows: exact for quantized
  rows too), Qwen2-MoE's shared expert as ffn_*_shexp with its gate ffn_gate_inp_shexp [H],
  and the expert keys (count, used count, widths, whether the top-k weights are renormalised).
  What llama.cpp would read as another model is refused: renormalisation of the top-k
  weights other than the architecture's fixed rule (norm_topk_prob), dense layers mixed in
  (mlp_only_layers, decoder_sparse_step: its MoE architectures have experts in every layer),
  OLMoE's clip_qkv (its olmoe graph never clamps) or grouped-query heads (its k norm is as
  wide as the hidden size);
- byte-level BPE vocabularies go in as `gpt2` with the merges; `tokenizer.ggml.pre` is
  the pre-tokenizer name whose splitting reproduces the source tokenizer on a probe text
  (llama.cpp recognizes pre-tokenizers by their output the same way).
Written one tensor at a time into a temporary file renamed into place last.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hipc.base.errors import HipcError
from hipc.compiler.ir import QUANT_DTYPES, Graph, StackedWeight, WeightRef, quant_row_bytes
from hipc.compiler.source.reader import WeightReader
from hipc.graphs import Model
from hipc.graphs.config import GGUF_MOE_NORM
from hipc.graphs.names import GGUF_LLAMA

GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
}
# written per MoE layer by _expert_tensors, not by the per-layer role loop
EXPERT_ROLES = frozenset(
    {"router", "gate_exps", "up_exps", "down_exps", "gate_up_exps", "gate_exp", "up_exp",
     "down_exp", "shared_expert_gate"}
)  # fmt: skip

# llama.cpp's llama_ftype values for general.file_type (informational in the file);
# plain K types are written as the *_S mixes whose base type they are.
FILE_TYPE = {
    None: 0,
    "q4_0": 2,
    "q4_1": 3,
    "q8_0": 7,
    "q5_0": 8,
    "q5_1": 9,
    "q4_k": 14,
    "q4_k_m": 15,
    "q5_k": 16,
    "q5_k_m": 17,
    "q6_k": 18,
    "q2_k": 10,
    "q3_k": 11,
    "q3_k_m": 12,
    "q3_k_l": 13,
    "iq4_nl": 25,
    "iq4_xs": 30,
}

# Text whose tokenization tells pre-tokenizers apart: digit runs, contractions, case,
# whitespace runs and newlines, punctuation runs, accents, CJK, emoji.
_PROBE = (
    "Hello world! I'm 12345 years old, isn't it? \n\n   spaces\t\ttabs\r\nDON'T 3.14159 "
    "ÁÉÍÓÚ naïve café Здравствуйте 東京 日本語 🚀🎉 ...!!! $$$ a1b2c3 ```code``` 1000000"
)


def export_gguf(
    model: Model,
    graph: Graph,
    path: str | os.PathLike,
    recipe: str | None = None,
    reader: WeightReader | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> Path:
    import gguf

    reader = reader or WeightReader()
    cfg, path = model.config, Path(path)
    arch = GGUF_ARCH.get(cfg.family)
    if arch is None:
        raise HipcError(f"--export-gguf: family {cfg.family!r} has no GGUF layout here")
    if cfg.sliding_window and cfg.sliding_window < cfg.max_position_embeddings:
        raise HipcError(
            f"--export-gguf: the model attends over a sliding window ({cfg.sliding_window}), "
            f"which llama.cpp's {arch} architecture does not read"
        )
    if cfg.num_experts and len(cfg.moe_layers) != cfg.num_layers:
        dense = sorted(set(range(cfg.num_layers)) - set(cfg.moe_layers))
        raise HipcError(
            f"--export-gguf: layers {dense} are dense (mlp_only_layers / decoder_sparse_step), "
            f"which llama.cpp's {arch} architecture does not read (every layer has experts)"
        )
    if cfg.num_experts and cfg.norm_topk_prob != GGUF_MOE_NORM[arch]:
        raise HipcError(
            f"--export-gguf: llama.cpp's {arch} architecture "
            f"{'always' if GGUF_MOE_NORM[arch] else 'never'} renormalises the top-k expert "
            f"weights, this model {'does not' if GGUF_MOE_NORM[arch] else 'does'} "
            "(norm_topk_prob)"
        )
    if arch == "olmoe" and cfg.clip_qkv:
        # llama.cpp reads olmoe.attention.clamp_kqv but its olmoe graph never applies it
        raise HipcError(
            f"--export-gguf: clip_qkv ({cfg.clip_qkv}) is not applied by llama.cpp's olmoe "
            "architecture: the file would compute another model there"
        )
    if arch == "olmoe" and cfg.num_kv_heads != cfg.num_heads:
        raise HipcError(
            f"--export-gguf: llama.cpp's olmoe architecture has as many key/value heads as "
            f"query heads (this model: {cfg.num_kv_heads} of {cfg.num_heads})"
        )
    scaling = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type"))
    if scaling not in (None, "default", "linear"):
        raise HipcError(f"--export-gguf: rope scaling {scaling!r} is not exported (only linear)")

    tensors = _tensors(model, graph, arch)
    w = gguf.GGUFWriter(str(path) + ".tmp", arch)
    _write_config(w, model, recipe, scaling)
    _write_tokenizer(w, model)
    for name, t in tensors.items():
        shape, dtype = _stored_shape(t.ref, t.shape)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        qtype = t.ref.dtype
        raw = gguf.GGMLQuantizationType[qtype.upper()] if qtype in QUANT_DTYPES else None
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, t in enumerate(tensors.values()):
            data = _data(reader, t.ref)
            if t.rows is not None:
                data = data[:, t.rows[0] : t.rows[1]]
            if t.permute_heads:
                data = _permute_rows(data, t.permute_heads)
            shape = _stored_shape(t.ref, t.shape)[0]
            w.write_tensor_data(np.ascontiguousarray(data).reshape(shape))
            if on_progress:
                on_progress(i + 1, len(tensors))
        w.close()
        os.replace(str(path) + ".tmp", path)
    except OSError as e:
        w.close()
        Path(str(path) + ".tmp").unlink(missing_ok=True)
        raise HipcError(f"--export-gguf: cannot write {path} ({e.strerror})") from None
    return path


@dataclass(frozen=True)
class Tensor:
    """One GGUF tensor: the weight as the graph reads it (a stacked one: its experts),
    optionally only rows [a, b) of each expert (a fused gate_up's halves), the heads to
    permute rows by (0: none), and the shape to write where it differs from the source's
    (the shared expert's gate [1, H] -> [H])."""

    ref: WeightRef | StackedWeight
    permute_heads: int = 0
    rows: tuple[int, int] | None = None
    shape: tuple[int, ...] | None = None


def _tensors(model: Model, graph: Graph, arch: str) -> dict[str, Tensor]:
    """GGUF name -> what to write there."""
    cfg = model.config
    # the graph's initializers are named by source tensor; quantized ones now point at
    # the store, the rest at the model's files
    by_source = {ref.name: ref for ref in graph.initializers.values() if isinstance(ref, WeightRef)}
    permute = arch == "llama" and model.source.format != "gguf"
    out: dict[str, Tensor] = {}
    layered = [r for r, t in GGUF_LLAMA.items() if "{i}" in t and r not in EXPERT_ROLES]
    for role in ("embed", "norm", "lm_head"):
        if model.has(role):
            out[GGUF_LLAMA[role]] = Tensor(_ref(model, by_source, role, None))
    for i in range(cfg.num_layers):
        for role in layered:
            if not model.has(role, i):
                continue
            heads = {"q": cfg.num_heads, "q_bias": cfg.num_heads}.get(role)
            heads = heads or {"k": cfg.num_kv_heads, "k_bias": cfg.num_kv_heads}.get(role, 0)
            out[GGUF_LLAMA[role].format(i=i)] = Tensor(
                _ref(model, by_source, role, i), heads if permute else 0
            )
        if i in cfg.moe_layers:
            out.update(_expert_tensors(model, by_source, i))
    return out


def _expert_tensors(model: Model, by_source: dict[str, WeightRef], i: int) -> dict[str, Tensor]:
    """Layer i's router, routed experts (stacked 3-D) and shared-expert gate."""
    out = {GGUF_LLAMA["router"].format(i=i): Tensor(_ref(model, by_source, "router", i))}
    experts = {k: by_source.get(w.name, w) for k, w in model.experts(i).items()}
    if "gate_up" in experts:
        fused = experts.pop("gate_up")
        E, F2, H = fused.shape
        F = F2 // 2
        experts["gate"] = Tensor(fused, rows=(0, F), shape=(E, F, H))
        experts["up"] = Tensor(fused, rows=(F, F2), shape=(E, F, H))
    for k in ("gate", "up", "down"):
        t = experts[k] if isinstance(experts[k], Tensor) else Tensor(experts[k])
        out[GGUF_LLAMA[f"{k}_exps"].format(i=i)] = t
    if model.config.shared_expert_intermediate_size and model.has("shared_expert_gate", i):
        # llama.cpp holds it as one vector [H]; HF as the [1, H] matrix it is
        gate = _ref(model, by_source, "shared_expert_gate", i)
        out[GGUF_LLAMA["shared_expert_gate"].format(i=i)] = Tensor(gate, shape=(gate.shape[-1],))
    return out


def _ref(model: Model, by_source: dict[str, WeightRef], role: str, layer: int | None):
    name = model.tensor_name(role, layer)
    return by_source.get(name) or model.source.weight_ref(name)


def _stored_shape(
    ref: WeightRef | StackedWeight, shape: tuple[int, ...] | None = None
) -> tuple[tuple[int, ...], str]:
    """The shape and numpy dtype of what is written: quantized rows as uint8 blocks,
    float16 as is, the other floats (bf16 widened exactly) as float32."""
    shape = tuple(shape or ref.shape)
    if ref.dtype in QUANT_DTYPES:
        return (*shape[:-1], quant_row_bytes(ref.dtype, shape[-1])), "uint8"
    return shape, "float16" if ref.dtype == "float16" else "float32"


def _data(reader: WeightReader, ref: WeightRef | StackedWeight) -> np.ndarray:
    if isinstance(ref, StackedWeight):  # one expert per file tensor: stacked here
        return np.stack([_data(reader, p) for p in ref.parts])
    if ref.dtype in QUANT_DTYPES:
        return np.asarray(reader.stored(ref), dtype=np.uint8)
    if ref.dtype == "float16":
        return np.asarray(reader.stored(ref), dtype=np.float16)
    return np.asarray(reader.value(ref), dtype=np.float32)


def _permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Within each head, rows (0, 1, ..., d/2-1, d/2, ...) -> (0, d/2, 1, d/2+1, ...)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _write_config(w: Any, model: Model, recipe: str | None, scaling: str | None) -> None:
    cfg = model.config
    w.add_name(model.name)
    w.add_file_type(FILE_TYPE.get(recipe, 0))
    w.add_quantization_version(2)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    if scaling == "linear":
        w.add_rope_scaling_type(_gguf().RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(cfg.rope_scaling["factor"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.experts_per_token)
        w.add_expert_feed_forward_length(cfg.expert_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _gguf():
    import gguf

    return gguf


def _write_tokenizer(w: Any, model: Model) -> None:
    src = model.source
    if src.format == "gguf":
        # the source's own vocabulary, as llama.cpp's converter wrote it
        for key, field in src.gguf.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[-1] if len(field.types) > 1 else None
                w.add_key_value(key, field.contents(), field.types[0], sub)
        return
    if not (src.path / "tokenizer.json").is_file():
        w.add_tokenizer_model("none")
        return
    tok = src.tokenizer()
    data = json.loads((src.path / "tokenizer.json").read_text(encoding="utf-8"))
    kind = (data.get("model") or {}).get("type")
    byte_level = "ByteLevel" in json.dumps(data.get("pre_tokenizer")) or "ByteLevel" in json.dumps(
        data.get("decoder")
    )
    if kind != "BPE" or not byte_level or (data.get("model") or {}).get("byte_fallback"):
        raise HipcError(
            f"--export-gguf: {src.path / 'tokenizer.json'}: only byte-level BPE vocabularies "
            f"are exported (this one is {kind}{' with byte fallback' if byte_level else ''})"
        )
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    n = max(model.config.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # UNUSED, llama.cpp's type for padding ids
    for text, i in vocab.items():
        tokens[i], types[i] = text, 1  # NORMAL
    for i, added in tok.backend.get_added_tokens_decoder().items():
        types[i] = 3 if added.special else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": tok.add_bos,
    }
    if tok.bos_token_id is not None:
        meta["tokenizer.ggml.bos_token_id"] = tok.bos_token_id
    if tok.eos_token_ids:
        meta["tokenizer.ggml.eos_token_id"] = tok.eos_token_ids[0]
    meta["tokenizer.ggml.pre"] = _pre_tokenizer_name(meta, tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_add_bos_token(tok.add_bos)
    if tok.bos_token_id is not None:
        w.add_bos_token_id(tok.bos_token_id)
    if tok.eos_token_ids:
        w.add_eos_token_id(tok.eos_token_ids[0])
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


def _pre_tokenizer_name(meta: dict[str, Any], tok: Any) -> str:
    """The first llama.cpp pre-tokenizer name under which the vocabulary splits the probe
    text exactly as the source tokenizer does."""
    from hipc.compiler.source.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_from_gguf_metadata

    want = tok.encode(_PROBE, add_special_tokens=False)
    seen = {id(PRE_TOKENIZERS["default"])}  # llama.cpp's 'default' is its legacy regex set
    for name, pre in PRE_TOKENIZERS.items():
        if id(pre) in seen and name != "gpt-2":
            continue
        seen.add(id(pre))
        got = tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.pre": name})
        if got.encode(_PROBE, add_special_tokens=False) == want:
            return name
    raise HipcError(
        "--export-gguf: no llama.cpp pre-tokenizer splits text as this tokenizer.json does"
    )
