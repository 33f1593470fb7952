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
- byte-level BPE vocabularies go in as `gpt2` with the merges; `tokenizer.ggml.pre` is
  the pre-tokenizer name whose splitting reproduces the source tokenizer on a probe text
  (llama.cpp recognizes pre-tokenizers by their output the same way).
Written one tensor at a time into a temporary file renamed into place last.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hipc.base.errors import HipcError
from hipc.compiler.ir import QUANT_BLOCKS, QUANT_DTYPES, Graph, WeightRef
from hipc.compiler.source.reader import WeightReader
from hipc.graphs import Model
from hipc.graphs.names import GGUF_LLAMA

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

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
    scaling = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type"))
    if scaling not in (None, "default", "linear"):
        raise HipcError(f"--export-gguf: rope scaling {scaling!r} is not exported (only linear)")

    tensors = _tensors(model, graph, arch)
    w = gguf.GGUFWriter(str(path) + ".tmp", arch)
    _write_config(w, model, recipe, scaling)
    _write_tokenizer(w, model)
    for name, (ref, _) in tensors.items():
        shape, dtype = _stored_shape(ref)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = gguf.GGMLQuantizationType[ref.dtype.upper()] if ref.dtype in QUANT_DTYPES else None
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (ref, permute_heads) in enumerate(tensors.values()):
            data = _data(reader, ref)
            if permute_heads:
                data = _permute_rows(data, permute_heads)
            w.write_tensor_data(np.ascontiguousarray(data))
            if on_progress:
                on_progress(i + 1, len(tensors))
        w.close()
        os.replace(str(path) + ".tmp", path)
    except OSError as e:
        w.close()
        Path(str(path) + ".tmp").unlink(missing_ok=True)
        raise HipcError(f"--export-gguf: cannot write {path} ({e.strerror})") from None
    return path


def _tensors(model: Model, graph: Graph, arch: str) -> dict[str, tuple[WeightRef, int]]:
    """GGUF name -> (the weight as the graph reads it, heads to permute rows by or 0)."""
    cfg = model.config
    # the graph's initializers are named by source tensor; quantized ones now point at
    # the store, the rest at the model's files
    by_source = {ref.name: ref for ref in graph.initializers.values() if isinstance(ref, WeightRef)}
    permute = arch == "llama" and model.source.format != "gguf"
    out: dict[str, tuple[WeightRef, int]] = {}
    layered = [r for r, t in GGUF_LLAMA.items() if "{i}" in t]
    for role in ("embed", "norm", "lm_head"):
        if model.has(role):
            out[GGUF_LLAMA[role]] = (_ref(model, by_source, role, None), 0)
    for i in range(cfg.num_layers):
        for role in layered:
            if not model.has(role, i):
                continue
            heads = {"q": cfg.num_heads, "q_bias": cfg.num_heads}.get(role)
            heads = heads or {"k": cfg.num_kv_heads, "k_bias": cfg.num_kv_heads}.get(role, 0)
            out[GGUF_LLAMA[role].format(i=i)] = (
                _ref(model, by_source, role, i),
                heads if permute else 0,
            )
    return out


def _ref(model: Model, by_source: dict[str, WeightRef], role: str, layer: int | None):
    name = model.tensor_name(role, layer)
    return by_source.get(name) or model.source.weight_ref(name)


def _stored_shape(ref: WeightRef) -> tuple[tuple[int, ...], str]:
    """The shape and numpy dtype of what is written: quantized rows as uint8 blocks,
    float16 as is, the other floats (bf16 widened exactly) as float32."""
    if ref.dtype in QUANT_DTYPES:
        elems, block_bytes = QUANT_BLOCKS[ref.dtype]
        return (*ref.shape[:-1], ref.shape[-1] // elems * block_bytes), "uint8"
    return tuple(ref.shape), "float16" if ref.dtype == "float16" else "float32"


def _data(reader: WeightReader, ref: WeightRef) -> np.ndarray:
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
