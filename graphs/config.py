"""One config record for every supported model, from HF config.json or GGUF metadata.

Families differ in a handful of switches (q/k/v bias, q/k norm, tied embeddings,
RoPE layout and scaling); the builder reads only this record, never the raw config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hipc.base.errors import HipcError

# HF `architectures[0]` / `model_type` -> family
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED = sorted(set(HF_ARCHITECTURES) | set(GGUF_ARCHITECTURES.values()))

ROPE_SCALING_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    rope_scaling: Mapping[str, Any] | None = None
    # GGUF files of the llama architecture store Q/K rows permuted for llama.cpp's
    # interleaved (GPT-J) RoPE; applying RoPE interleaved is exact for them.
    rope_interleaved: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise HipcError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise HipcError(
                f"config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise HipcError(
                f"config field head_dim must be a positive even number, got {self.head_dim}"
            )
        kind = rope_type(self.rope_scaling)
        if kind not in ROPE_SCALING_TYPES:
            raise HipcError(
                f"config: rope_scaling type {kind!r} is not supported "
                f"(supported: {', '.join(ROPE_SCALING_TYPES)})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _unsupported(arch: str) -> HipcError:
    return HipcError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED)})")


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Normalize a Hugging Face config.json (already parsed) into a ModelConfig."""
    archs = cfg.get("architectures") or []
    if archs:
        family = HF_ARCHITECTURES.get(archs[0])
        if family is None:
            raise _unsupported(archs[0])
    else:
        family = HF_MODEL_TYPES.get(cfg.get("model_type", ""))
        if family is None:
            raise _unsupported(str(cfg.get("model_type", "<missing model_type>")))
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise HipcError(f"{source}: hidden_act {act!r} is not supported (only silu)")

    def need(key: str) -> Any:
        if key not in cfg:
            raise HipcError(f"{source}: missing field {key!r}")
        return cfg[key]

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    head_dim = cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) else 0)
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope_params and rope_type(rope_params) != "default":
        scaling = rope_params
    if scaling is not None and rope_type(scaling) == "default":
        scaling = None
    window = cfg.get("sliding_window") if family == "mistral" else None
    if family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise HipcError(f"{source}: use_sliding_window=true is not supported for {family}")
    try:
        return ModelConfig(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            rope_scaling=dict(scaling) if scaling else None,
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
        )
    except (TypeError, ValueError) as e:
        raise HipcError(f"{source}: malformed config ({e})") from None


def from_gguf(meta: Mapping[str, Any], vocab_size: int, source: str = "gguf") -> ModelConfig:
    """Normalize GGUF metadata (key -> python value) into a ModelConfig."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise _unsupported(str(arch))
    family = GGUF_ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        full = f"{arch}.{name}"
        if full not in meta:
            if default is None:
                raise HipcError(f"{source}: missing metadata key {full!r}")
            return default
        return meta[full]

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    scaling = None
    scale_type = meta.get(f"{arch}.rope.scaling.type")
    if scale_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scale_type not in (None, "none"):
        raise HipcError(f"{source}: rope scaling type {scale_type!r} is not supported")
    kv_heads = key("attention.head_count_kv", heads)
    return ModelConfig(
        family=family,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 2048)),
        qk_norm=family == "qwen3",
        rope_scaling=scaling,
        rope_interleaved=arch in ("llama", "mistral"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_as_ids(meta.get("tokenizer.ggml.eos_token_id")),
    )
