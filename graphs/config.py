"""One config record for every supported model, from HF config.json or GGUF metadata.

Families differ in a handful of switches (q/k/v bias, q/k norm, tied embeddings,
RoPE layout and scaling, Mixture-of-Experts routing; Gemma's sandwich norms, GeGLU,
soft-capping, scaled embeddings and alternating sliding-window layers); the builders
read only this record, never the raw config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hipc.base.errors import HipcError

# HF `architectures[0]` / `model_type` -> family
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3_moe",
    "qwen2_moe": "qwen2_moe",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
# llama.cpp writes Mixtral as "llama" with expert tensors (from_gguf tells them apart)
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "qwen3moe": "qwen3_moe",
    "qwen2moe": "qwen2_moe",
    "olmoe": "olmoe",
    "qwen3next": "qwen3_next",
    "qwen35": "qwen3_5",
    "qwen35moe": "qwen3_5_moe",
}
GEMMA = ("gemma2", "gemma3")
# Gated DeltaNet linear attention between gated full-attention layers (graphs/hybrid.py)
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
SUPPORTED = sorted(set(HF_ARCHITECTURES) | set(GGUF_ARCHITECTURES.values()) | {"mixtral"})
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_next", "qwen3_5_moe")
# llama.cpp renormalises the routed weights per architecture (its build_moe_ffn norm_w),
# unless the file says otherwise with expert_weights_norm
GGUF_MOE_NORM = {
    "qwen3moe": True,
    "qwen2moe": False,
    "olmoe": False,
    "llama": True,
    "qwen3next": True,
    "qwen35moe": True,
}

ROPE_SCALING_TYPES = ("default", "linear", "dynamic", "llama3")
# transformers' config-class defaults where a family's differ from Llama's
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"max_position_embeddings": 8192},
    "gemma3": {"max_position_embeddings": 131072, "rope_theta": 1_000_000.0},
    "qwen3_next": {"max_position_embeddings": 32768, "head_dim": 256},
    "qwen3_5": {"max_position_embeddings": 32768, "head_dim": 256},
    "qwen3_5_moe": {"max_position_embeddings": 32768, "head_dim": 256},
}
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
    hidden_act: str = "silu"  # the GLU's activation: "silu" or "gelu_tanh" (Gemma's GeGLU)
    # Gemma's RMSNorm scales by (1 + w). HF files store w (offset 1); llama.cpp's converter
    # stores 1 + w in the GGUF (offset 0).
    norm_weight_offset: float = 0.0
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden), rounded to the model's dtype
    post_norms: bool = False  # Gemma: RMSNorm on the attention and feed-forward outputs too
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma-2)
    final_softcap: float | None = None  # the same on the logits
    # per layer "full_attention" | "sliding_attention"; empty: every layer follows sliding_window
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # Gemma-3: RoPE base of sliding layers (unscaled)
    # OLMoE: q/k RMSNorm over the whole projection instead of per head, and q/k/v clamping
    qk_norm_full: bool = False
    clip_qkv: float | None = None
    # Mixture of experts (num_experts 0: a dense model). Layers in moe_layers route each
    # token to experts_per_token of num_experts SwiGLU experts of width
    # expert_intermediate_size (softmax over all experts, then top-k, then renormalised
    # to sum 1 when norm_topk_prob); the other layers keep the dense MLP. A shared
    # expert (Qwen2-MoE) sees every token, scaled by sigmoid(h . w_gate).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # Hybrids (Qwen3-Next, Qwen3.5): layers typed "linear_attention" are Gated DeltaNet
    # layers with these shapes; full-attention layers gate their output by sigmoid of a
    # second half of the q projection and rotate only the first rotary_dim dims.
    linear_conv_kernel: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # llama.cpp's converter reorders Qwen3.5's value heads from grouped by key head
    # (HF: value head j reads key head j // r) to tiled (j % key heads)
    linear_v_tiled: bool = False
    # HF stores A_log (the decay rate is -exp(A_log)); llama.cpp stores -exp(A_log)
    linear_a_log: bool = True
    rotary_dim: int = 0  # 0: the whole head
    attn_output_gate: bool = False
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
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise HipcError(f"config: activation {self.hidden_act!r} is not supported")
        if self.layer_types and (
            len(self.layer_types) != self.num_layers
            or any(t not in LAYER_TYPES for t in self.layer_types)
        ):
            raise HipcError(
                f"config field layer_types must list {self.num_layers} of "
                f"{', '.join(LAYER_TYPES)}, got {list(self.layer_types)}"
            )
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise HipcError(
                    f"config: num_experts_per_tok ({self.experts_per_token}) must be between 1 "
                    f"and the number of experts ({self.num_experts})"
                )
            if self.expert_intermediate_size <= 0:
                raise HipcError(
                    f"config: the experts' intermediate size must be positive, "
                    f"got {self.expert_intermediate_size}"
                )
            bad = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
            if bad:
                raise HipcError(
                    f"config: sparse layers {bad} out of range 0..{self.num_layers - 1}"
                )
        if "linear_attention" in self.layer_types:
            k, v = self.linear_key_heads, self.linear_value_heads
            dims = (k, v, self.linear_key_head_dim, self.linear_value_head_dim)
            if min(dims) <= 0 or v % k or self.linear_conv_kernel <= 0:
                raise HipcError(
                    f"config: linear attention needs positive head counts and dims with value "
                    f"heads a multiple of key heads, and a conv kernel; got key heads {k}, value "
                    f"heads {v}, dims {dims[2]}/{dims[3]}, kernel {self.linear_conv_kernel}"
                )
        if self.rotary_dim and (self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            raise HipcError(
                f"config: rotary dim {self.rotary_dim} must be even and at most head_dim "
                f"{self.head_dim}"
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

    @property
    def rope_dim(self) -> int:
        """The dims of a head RoPE rotates (the first ones; the rest pass through)."""
        return self.rotary_dim or self.head_dim

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def window(self, layer: int) -> int:
        """The sliding window of one layer; 0 for full attention."""
        if self.layer_types and self.layer_types[layer] == "full_attention":
            return 0
        return self.sliding_window or 0

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts and self.moe_layers)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_types"] = list(self.layer_types)
        d["moe_layers"] = list(self.moe_layers)
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["moe_layers"] = tuple(d.get("moe_layers", ()))
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
    if family in HYBRID and isinstance(cfg.get("text_config"), Mapping):
        # a multimodal checkpoint (Qwen3.5 with its vision tower): its text model only
        top = {k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg}
        cfg = {**cfg["text_config"], **top, "architectures": archs, "vision_skipped": True}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise HipcError(
            f"{source}: hidden_act {act!r} is not supported (supported: {', '.join(HF_ACTIVATIONS)})"
        )

    def need(key: str) -> Any:
        if key not in cfg:
            raise HipcError(f"{source}: missing field {key!r}")
        return cfg[key]

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    defaults = HF_DEFAULTS.get(family, {})
    head_dim = (
        cfg.get("head_dim")
        or defaults.get("head_dim")
        or (hidden // heads if isinstance(hidden, int) else 0)
    )
    rope_params = cfg.get("rope_parameters") or {}
    local_rope: Mapping[str, Any] = {}
    if isinstance(rope_params.get("full_attention"), Mapping):
        # per layer type (Gemma-3 in transformers 5): global layers' RoPE, then local ones'
        local_rope = rope_params.get("sliding_attention") or {}
        rope_params = rope_params["full_attention"]
    rope_theta = cfg.get(
        "rope_theta", rope_params.get("rope_theta", defaults.get("rope_theta", 10000.0))
    )
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope_params and rope_type(rope_params) != "default":
        scaling = rope_params
    if scaling is not None and rope_type(scaling) == "default":
        scaling = None
    window = cfg.get("sliding_window") if family in ("mistral", "mixtral") else None
    if family in GEMMA:
        window = cfg.get("sliding_window", 4096)
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and cfg.get("use_sliding_window"):
        raise HipcError(f"{source}: use_sliding_window=true is not supported for {family}")
    try:
        moe = _hf_moe(family, cfg, need)
        return ModelConfig(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need(
                "moe_intermediate_size" if family == "qwen3_5_moe" else "intermediate_size"
            ),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(
                cfg.get("max_position_embeddings", defaults.get("max_position_embeddings", 2048))
            ),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family in GEMMA)),
            attention_bias=bool(
                cfg.get("qkv_bias", True)
                if family == "qwen2_moe"
                else cfg.get("attention_bias", family == "qwen2")
            ),
            qk_norm=family in ("qwen3", "qwen3_moe", "olmoe", "gemma3", *HYBRID),
            qk_norm_full=family == "olmoe",
            clip_qkv=float(cfg["clip_qkv"]) if cfg.get("clip_qkv") is not None else None,
            rope_scaling=dict(scaling) if scaling else None,
            sliding_window=int(window) if window else None,
            hidden_act=HF_ACTIVATIONS[act],
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
            **(_gemma_hf(cfg, family, local_rope, source) if family in GEMMA else {}),
            **(_hybrid_hf(cfg, int(head_dim), rope_params) if family in HYBRID else {}),
            **moe,
        )
    except (TypeError, ValueError) as e:
        raise HipcError(f"{source}: malformed config ({e})") from None


def _gemma_hf(
    cfg: Mapping[str, Any], family: str, local_rope: Mapping[str, Any], source: str
) -> dict[str, Any]:
    """The Gemma-2/3 switches of an HF config; a missing key takes transformers' default."""
    layers = int(cfg["num_hidden_layers"])
    pattern = 2 if family == "gemma2" else int(cfg.get("sliding_window_pattern") or 6)
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    extra: dict[str, Any] = {}

    def gemma2_cap(value: float) -> float | None:
        return value if family == "gemma2" else None

    if family == "gemma3":
        if rope_type(local_rope) != "default":
            raise HipcError(f"{source}: RoPE scaling on sliding layers is not supported")
        extra["rope_local_theta"] = float(
            local_rope.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
        )
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    return dict(
        norm_weight_offset=1.0,
        embedding_multiplier=in_dtype(math.sqrt(int(cfg["hidden_size"])), dtype),
        post_norms=True,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        attn_softcap=_positive_or_none(cfg.get("attn_logit_softcapping", gemma2_cap(50.0))),
        final_softcap=_positive_or_none(cfg.get("final_logit_softcapping", gemma2_cap(30.0))),
        layer_types=tuple(types),
        **extra,
    )


def _hybrid_hf(cfg: Mapping[str, Any], head_dim: int, rope: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 switches, with transformers' config defaults."""
    layers = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("full_attention_interval", 4))
    types = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)
    ]
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    extra = {"vision": "skipped (text model only)"} if cfg.get("vision_skipped") else {}
    return dict(
        layer_types=tuple(types),
        linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        rotary_dim=int(head_dim * partial),
        attn_output_gate=True,
        norm_weight_offset=1.0,  # (1 + w) RMSNorms; the gated norm keeps w
        extra=extra,
    )


def in_dtype(value: float, dtype: str | None) -> float:
    """`value` as a scalar of the model's dtype holds it: transformers multiplies Gemma's
    embeddings by sqrt(hidden) cast to the weights' dtype (48.0 stays, 59.87 -> 60.0 in bf16)."""
    if dtype == "bfloat16":
        # 8 significant bits, ties to even (Python's round)
        m, e = math.frexp(value)
        return math.ldexp(round(m * 256) / 256, e)
    if dtype == "float16":
        return float(np.float16(value))
    return float(np.float32(value))


def _positive_or_none(value: Any) -> float | None:
    return float(value) if value else None


def _hf_moe(family: str, cfg: Mapping[str, Any], need: Any) -> dict[str, Any]:
    """The MoE fields of a config.json, as each family's transformers code reads them."""
    if family not in MOE_FAMILIES:
        return {}
    keys = [k for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None]
    experts = cfg[keys[0]] if keys else need("num_experts")
    layers = int(need("num_hidden_layers"))
    if family in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        # transformers: layer i is sparse unless listed in mlp_only_layers, and only
        # every decoder_sparse_step-th layer is
        step = int(cfg.get("decoder_sparse_step", 1))
        if step <= 0:
            raise HipcError("config: decoder_sparse_step must be positive")
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        width = int(need("moe_intermediate_size"))
    elif family == "qwen3_5_moe":  # every layer sparse
        sparse = tuple(range(layers))
        width = int(need("moe_intermediate_size"))
    else:  # Mixtral and OLMoE: every layer sparse, intermediate_size is the expert width
        sparse = tuple(range(layers))
        width = int(need("intermediate_size"))
    return dict(
        num_experts=int(experts),
        experts_per_token=int(need("num_experts_per_tok")) if experts else 0,
        expert_intermediate_size=width,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if family in ("qwen2_moe", "qwen3_next", "qwen3_5_moe")
        else 0,
        # Mixtral and Qwen3.5-MoE always renormalise the top-k weights (Mixtral as a softmax
        # over the top-k logits); Qwen3-Next's config defaults to it
        norm_topk_prob=True
        if family in ("mixtral", "qwen3_5_moe")
        else bool(cfg.get("norm_topk_prob", family == "qwen3_next")),
        moe_layers=sparse if int(experts) > 0 else (),
    )


def from_gguf(meta: Mapping[str, Any], vocab_size: int, source: str = "gguf") -> ModelConfig:
    """Normalize GGUF metadata (key -> python value) into a ModelConfig."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise _unsupported(str(arch))
    family = GGUF_ARCHITECTURES[arch]
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if arch == "llama" and experts:
        family = "mixtral"

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
    gemma = _gemma_gguf(meta, arch, int(key("block_count")), hidden, heads, head_dim)
    if family in HYBRID:
        gemma = _hybrid_gguf(key, arch, int(key("block_count")))
    moe: dict[str, Any] = {}
    if family in MOE_FAMILIES:
        if not experts:
            raise HipcError(f"{source}: missing metadata key {arch + '.expert_count'!r}")
        expert_width = meta.get(f"{arch}.expert_feed_forward_length")
        moe = dict(
            num_experts=experts,
            experts_per_token=int(key("expert_used_count")),
            expert_intermediate_size=int(expert_width or key("feed_forward_length")),
            shared_expert_intermediate_size=int(
                meta.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0
            ),
            norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", GGUF_MOE_NORM[arch])),
            # every layer until the loader has looked at which ones hold a router
            moe_layers=tuple(range(int(key("block_count")))),
        )
    dense_width = meta.get(f"{arch}.feed_forward_length") or moe.get("expert_intermediate_size")
    clamp = meta.get(f"{arch}.attention.clamp_kqv")
    return ModelConfig(
        family=family,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(dense_width or key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 2048)),
        qk_norm=family in ("qwen3", "qwen3_moe", "olmoe", "gemma3", *HYBRID),
        qk_norm_full=family == "olmoe",
        clip_qkv=float(clamp) if clamp else None,
        rope_scaling=scaling,
        rope_interleaved=arch in ("llama", "mistral"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_as_ids(meta.get("tokenizer.ggml.eos_token_id")),
        **gemma,
        **moe,
    )


def _hybrid_gguf(key: Any, arch: str, layers: int) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 as llama.cpp's converter writes them: ssm.* shapes, the
    full-attention interval, norms stored as 1 + w, -exp(A_log), and (Qwen3.5) value heads
    reordered to the tiled order."""
    interval = int(key("full_attention_interval", 4))
    value_heads = int(key("ssm.time_step_rank"))
    return dict(
        layer_types=tuple(
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)
        ),
        linear_conv_kernel=int(key("ssm.conv_kernel")),
        linear_key_heads=int(key("ssm.group_count")),
        linear_value_heads=value_heads,
        linear_key_head_dim=int(key("ssm.state_size")),
        linear_value_head_dim=int(key("ssm.inner_size")) // value_heads,
        linear_v_tiled=arch in ("qwen35", "qwen35moe"),
        linear_a_log=False,
        rotary_dim=int(key("rope.dimension_count")),
        attn_output_gate=True,
        norm_weight_offset=0.0,
    )


def _gemma_gguf(
    meta: Mapping[str, Any], arch: str, layers: int, hidden: int, heads: int, head_dim: int
) -> dict[str, Any]:
    """The Gemma-2/3 switches as llama.cpp reads them from a GGUF file."""
    if arch not in GEMMA:
        return {}
    window = meta.get(f"{arch}.attention.sliding_window")
    pattern = 2 if arch == "gemma2" else 6
    types = tuple(
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    )
    # No key holds the attention scale: llama.cpp takes hidden/heads for the 27B models
    # (46 layers of Gemma-2, 62 of Gemma-3), head_dim otherwise.
    big = layers == (46 if arch == "gemma2" else 62)
    extra: dict[str, Any] = {"rope_local_theta": 10000.0} if arch == "gemma3" else {}
    return dict(
        hidden_act="gelu_tanh",
        norm_weight_offset=0.0,  # the converter stored 1 + w
        embedding_multiplier=float(np.float32(math.sqrt(hidden))),
        post_norms=True,
        query_pre_attn_scalar=float(hidden // heads if big else head_dim),
        attn_softcap=_positive_or_none(meta.get(f"{arch}.attn_logit_softcapping")),
        final_softcap=_positive_or_none(meta.get(f"{arch}.final_logit_softcapping")),
        sliding_window=int(window) if window else None,
        layer_types=types if window else (),
        **extra,
    )
