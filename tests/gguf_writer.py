"""Write small GGUF files from a transformers model, the way llama.cpp's converter lays them out.

Used to check the GGUF path against transformers reading the same file: Q/K rows of
the llama architecture permuted for llama.cpp's RoPE, tied embeddings as a missing
output.weight, quantized tensor types, and Gemma's conventions (norm weights stored as
1 + w, sandwich-norm names, soft-capping and sliding-window keys).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Mixture of experts (llama.cpp's names; experts stacked 3-D by write_gguf)
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# per-expert HF tensor (transformers < 5 in memory) -> stacked GGUF tensor
EXPERT = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}


# gguf-py's tensor names for MODEL_ARCH.GEMMA2/GEMMA3: HF's post_attention_layernorm is the
# norm after attention there, pre_feedforward_layernorm the one before the MLP
GEMMA_LAYER = {
    **LAYER,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
GEMMA_ARCHS = ("gemma2", "gemma3")


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    parts = hf.split(".")
    table = GEMMA_LAYER if arch in GEMMA_ARCHS else LAYER
    return f"blk.{parts[2]}.{table['.'.join(parts[3:])]}"


def permute_for_llamacpp(w: np.ndarray, n_head: int) -> np.ndarray:
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def moe_tensors(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF expert tensors (fused gate_up_proj [E, 2F, H] / down_proj, or one per expert)
    -> GGUF's stacked blk.N.ffn_{gate,up,down}_exps; other tensors unchanged."""
    out: dict[str, np.ndarray] = {}
    per_expert: dict[str, dict[int, np.ndarray]] = {}
    for name, arr in state.items():
        parts = name.split(".")
        if name.endswith("experts.gate_up_proj"):
            half = arr.shape[1] // 2
            out[f"blk.{parts[2]}.ffn_gate_exps.weight"] = arr[:, :half]
            out[f"blk.{parts[2]}.ffn_up_exps.weight"] = arr[:, half:]
        elif name.endswith("experts.down_proj"):
            out[f"blk.{parts[2]}.ffn_down_exps.weight"] = arr
        elif "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            e = int(parts[parts.index("experts") + 1])
            key = f"blk.{parts[2]}.{EXPERT[parts[-2]]}.weight"
            per_expert.setdefault(key, {})[e] = arr
        else:
            out[name] = arr
    for key, experts in per_expert.items():
        out[key] = np.stack([experts[e] for e in sorted(experts)])
    return out


def _add_moe_metadata(w, cfg, arch: str) -> None:
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if not experts:
        return
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    width = getattr(cfg, "moe_intermediate_size", None)
    if width:  # Qwen-MoE: experts narrower than the dense layers
        w.add_expert_feed_forward_length(width)
    shared = getattr(cfg, "shared_expert_intermediate_size", None)
    if shared:
        w.add_expert_shared_feed_forward_length(shared)
    # llama.cpp's converters leave this out (each architecture has a fixed rule); written
    # here so test models that deviate from that rule say so
    w.add_expert_weights_norm(bool(getattr(cfg, "norm_topk_prob", True)))
    if getattr(cfg, "clip_qkv", None):
        w.add_clamp_kqv(cfg.clip_qkv)


def write_gguf(
    model,
    path: Path,
    arch: str = "llama",
    qtype: str = "F32",
    per_expert: bool = False,
    tokenizer: bool = True,
) -> Path:
    """Write `model` (a transformers CausalLM) as GGUF; 2-D and 3-D (experts) weights
    stored as `qtype`. MoE models get llama.cpp's stacked expert tensors and metadata, or
    with `per_expert` the early Mixtral layout (blk.N.ffn_gate.E.weight ...). Without
    `tokenizer`, tokenizer.ggml.model is "none" (a file `hipc compile` takes as ids only)."""
    import gguf

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.rope_parameters or {}
    rope = rope.get("full_attention", rope)  # Gemma-3: the global layers' base
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch in GEMMA_ARCHS:
        # the keys llama.cpp's converter writes for Gemma (none holds query_pre_attn_scalar)
        if cfg.attn_logit_softcapping:
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    _add_moe_metadata(w, cfg, arch)
    # a byte-level vocabulary of the right size: single characters, then filler tokens
    tokens = [
        chr(0x100 + i) if i >= 256 else bytes([i]).decode("latin-1") for i in range(cfg.vocab_size)
    ]
    tokens[-1] = "ab"  # one merge: a vocabulary hipc can build a tokenizer from
    w.add_tokenizer_model("gpt2" if tokenizer else "none")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    state = {k: t.detach().float().numpy() for k, t in model.state_dict().items()}
    tensors = moe_tensors(state)
    if per_expert:
        for name in [n for n in tensors if "_exps." in n]:
            stacked = tensors.pop(name)
            for e, arr in enumerate(stacked):
                tensors[name.replace("_exps.", f".{e}.")] = arr
    for name, arr in tensors.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = permute_for_llamacpp(arr, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = permute_for_llamacpp(arr, cfg.num_key_value_heads)
        elif arch in GEMMA_ARCHS and name.endswith("norm.weight"):
            arr = arr + 1  # the converter stores Gemma's (1 + w) scale
        gname = name if name.startswith("blk.") else gguf_name(name, arch)
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            arr = arr.reshape(-1)  # llama.cpp holds the shared expert's gate as [H]
        if arr.ndim >= 2 and qtype != "F32" and "ffn_gate_inp" not in gname:
            w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny_llama_writer(
    path: Path, H: int, F: int, V: int, L: int, NH: int, NKV: int, context: int = 64
):
    """A GGUFWriter holding a tiny llama's metadata and a tokenizer hipc can build: byte-level
    symbols for the first ids, then one merged token (no byte needs more)."""
    import gguf

    D = H // NH
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(context)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    symbols = [chr(c) for c in range(ord("!"), ord("!") + V - 1)]
    w.add_token_list([*symbols, '!"'])
    w.add_token_types([1] * V)
    w.add_token_merges(['! "'])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    return w


def write_numpy_gguf(
    path: Path,
    qtype: str = "F32",
    seed: int = 0,
    *,
    hidden: int = 64,
    ffn: int = 96,
    types: Callable[[str], str] | None = None,
    context: int = 64,
    tied: bool = False,
) -> Path:
    """A tiny random llama-architecture GGUF written with numpy alone (no transformers).

    hidden 64 / ffn 96 so every row is whole 32-element blocks; norms stay float32.
    `tied`: no output.weight, so the logits multiply token_embd (as SmolLM2's file).
    `types` (tensor name -> hipc dtype, e.g. "q4_k") picks a type per matrix, quantized by
    hipc.compiler.quantize (K-quants need hidden and ffn multiples of 256); else every
    matrix is `qtype`, quantized by gguf-py.
    """
    import gguf

    rng = np.random.default_rng(seed)
    H, F, V, L, NH, NKV = hidden, ffn, 160, 2, 4, 2
    D = H // NH
    w = _tiny_llama_writer(path, H, F, V, L, NH, NKV, context)
    qt = getattr(gguf.GGMLQuantizationType, qtype)

    def mat(name: str, *shape: int) -> None:
        arr = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        if types is not None and types(name) != "float32":
            from hipc.compiler.quantize import quantize

            kind = getattr(gguf.GGMLQuantizationType, types(name).upper())
            data = np.frombuffer(quantize(arr, types(name)), np.uint8).reshape(shape[0], -1)
            w.add_tensor(name, data, raw_dtype=kind)
        elif qtype == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        elif qtype != "F32":
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, arr)

    def vec(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.2 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", V, H)
    vec("output_norm.weight", H)
    if not tied:
        mat("output.weight", V, H)
    for i in range(L):
        vec(f"blk.{i}.attn_norm.weight", H)
        vec(f"blk.{i}.ffn_norm.weight", H)
        mat(f"blk.{i}.attn_q.weight", NH * D, H)
        mat(f"blk.{i}.attn_k.weight", NKV * D, H)
        mat(f"blk.{i}.attn_v.weight", NKV * D, H)
        mat(f"blk.{i}.attn_output.weight", H, NH * D)
        mat(f"blk.{i}.ffn_gate.weight", F, H)
        mat(f"blk.{i}.ffn_up.weight", F, H)
        mat(f"blk.{i}.ffn_down.weight", H, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def requantize_gguf(
    src: Path, dst: Path, type_of: Callable[[str, tuple[int, ...]], str | None]
) -> Path:
    """Copy a GGUF file with every tensor re-stored as `type_of(name, shape)` (None: float32),
    quantized by hipc.compiler.quantize from gguf-py's dequantized values; metadata as is."""
    import gguf

    from hipc.compiler.quantize import quantize

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        kind = type_of(t.name, shape)
        if kind is None:
            w.add_tensor(t.name, values)
        else:
            qt = getattr(gguf.GGMLQuantizationType, kind.upper())
            # rows of blocks, any leading dimensions kept (MoE's stacked experts)
            data = np.frombuffer(quantize(values, kind), np.uint8).reshape(*shape[:-1], -1)
            w.add_tensor(t.name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def q4_k_m_type(name: str, shape: tuple[int, ...], experts_only: bool = True) -> str | None:
    """requantize_gguf's `type_of` for llama-quantize's Q4_K_M experts: gate and up Q4_K, down
    Q6_K (the type of the layers given more bits); with `experts_only` False the other
    matrices too: Q4_K where rows are whole super-blocks, else Q5_0 (llama.cpp's substitute),
    norms, the conv, routers and the embedding left float32."""
    if "_exps" in name:
        return "q6_k" if "down" in name else "q4_k"
    skip = ("norm", "ssm_conv", "gate_inp", "token_embd", "ssm_a", "ssm_dt")
    if experts_only or len(shape) != 2 or any(s in name for s in skip):
        return None
    return "q4_k" if shape[-1] % 256 == 0 else "q5_0" if shape[-1] % 32 == 0 else None


def q3_k_m_type(name: str, shape: tuple[int, ...]) -> str | None:
    """requantize_gguf's `type_of` for llama-quantize's Q3_K_M experts: gate and up Q3_K, down
    Q4_K (Q3_K_M's ffn_down outside its first layers); the rest float32."""
    if "_exps" in name:
        return "q4_k" if "down" in name else "q3_k"
    return None


def q2_k_dense_type(name: str) -> str:
    """write_numpy_gguf's `types` for a Q2_K file of a Llama as llama-quantize's Q2_K mixes go:
    Q2_K most matrices and the embedding, attn_v and ffn_down one step up (Q3_K), the output
    Q6_K."""
    if name == "output.weight":
        return "q6_k"
    return "q3_k" if name.endswith(("attn_v.weight", "ffn_down.weight")) else "q2_k"


def q3_k_m_dense_type(name: str) -> str:
    """write_numpy_gguf's `types` for llama-quantize's Q3_K_M of a Llama: q, k, gate, up and the
    embedding Q3_K, v, o and down Q4_K, the output Q6_K."""
    if name == "output.weight":
        return "q6_k"
    return (
        "q4_k"
        if name.endswith(("attn_v.weight", "attn_output.weight", "ffn_down.weight"))
        else "q3_k"
    )


def write_mixed_glu_gguf(
    path: Path, gate: str = "q4_k", up: str = "q5_0", rest: str = "q8_0"
) -> Path:
    """write_numpy_gguf 256 wide (ffn 512) with ffn_gate and ffn_up in different types, the
    rest in `rest`: no one GLU epilogue can read both (compiler/kernels/glu.py)."""
    types = {"ffn_gate": gate, "ffn_up": up}
    return write_numpy_gguf(
        path,
        hidden=256,
        ffn=512,
        types=lambda n: next((t for k, t in types.items() if k in n), rest),
    )


def write_q6k_head_gguf(path: Path, seed: int = 0) -> Path:
    """A tiny llama GGUF typed as llama-quantize's Q4_0 files are: Q4_0 linears and
    embedding, the output matrix Q6_K (random super-blocks: gguf-py has no Q6_K quantizer).
    hidden 256, so the output's rows are whole super-blocks."""
    import gguf

    rng = np.random.default_rng(seed)
    H, F, V, L, NH, NKV = 256, 96, 160, 1, 4, 2
    D = H // NH
    w = _tiny_llama_writer(path, H, F, V, L, NH, NKV)
    q4 = gguf.GGMLQuantizationType.Q4_0

    def mat(name: str, *shape: int) -> None:
        arr = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(arr, q4), raw_dtype=q4)

    def vec(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.2 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", V, H)
    vec("output_norm.weight", H)
    blocks = rng.integers(0, 256, (V * H // 256, 210), dtype=np.uint8)
    d = rng.uniform(1e-4, 3e-4, len(blocks)).astype(np.float16)
    blocks[:, 208:] = d.view(np.uint8).reshape(-1, 2)
    w.add_tensor("output.weight", blocks.reshape(V, -1), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    for i in range(L):
        vec(f"blk.{i}.attn_norm.weight", H)
        vec(f"blk.{i}.ffn_norm.weight", H)
        mat(f"blk.{i}.attn_q.weight", NH * D, H)
        mat(f"blk.{i}.attn_k.weight", NKV * D, H)
        mat(f"blk.{i}.attn_v.weight", NKV * D, H)
        mat(f"blk.{i}.attn_output.weight", H, NH * D)
        mat(f"blk.{i}.ffn_gate.weight", F, H)
        mat(f"blk.{i}.ffn_up.weight", F, H)
        mat(f"blk.{i}.ffn_down.weight", H, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiled_v(arr: np.ndarray, axis: int, k_heads: int, ratio: int, dim: int) -> np.ndarray:
    """Value heads from grouped by key head (HF) to tiled order (llama.cpp's Qwen3.5):
    along `axis`, [k_heads, ratio, dim] -> [ratio, k_heads, dim]."""
    arr = np.moveaxis(arr, axis, 0)
    rest = arr.shape[1:]
    arr = arr.reshape(k_heads, ratio, dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(arr, 0, axis)


def hybrid_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """A Qwen3-Next / Qwen3.5 transformers model's tensors as llama.cpp's converter writes
    them (qwen3next / qwen35 / qwen35moe): (1 + w) norms stored as 1 + w (not the gated
    norm), -exp(A_log), the conv weight squeezed to [C, K], Qwen3-Next's per-key-head
    in_proj_qkvz split into attn_qkv (q, k, v each whole) and attn_gate (z), Qwen3.5's value
    heads reordered to the tiled order, experts stacked."""
    cfg = model.config
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    tiled = arch in ("qwen35", "qwen35moe") and nk != nv
    state = {k: t.detach().float().numpy() for k, t in model.state_dict().items()}
    layer = {
        **LAYER,
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
        "linear_attn.in_proj_z.weight": "attn_gate.weight",
        "linear_attn.in_proj_b.weight": "ssm_beta.weight",
        "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
        "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
        "linear_attn.conv1d.weight": "ssm_conv1d.weight",
        "linear_attn.dt_bias": "ssm_dt.bias",
        "linear_attn.A_log": "ssm_a",
        "linear_attn.norm.weight": "ssm_norm.weight",
        "linear_attn.out_proj.weight": "ssm_out.weight",
    }
    out: dict[str, np.ndarray] = {}
    for name, arr in moe_tensors(state).items():
        if name.startswith("blk."):
            out[name] = arr
            continue
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            arr = arr + 1
        if name.endswith("A_log"):
            arr = -np.exp(arr)
        if name.endswith("conv1d.weight"):
            arr = arr.reshape(arr.shape[0], arr.shape[-1])
        if name in HF_TO_GGUF:
            out[HF_TO_GGUF[name]] = arr
            continue
        parts = name.split(".")
        i, role = parts[2], ".".join(parts[3:])
        if role == "linear_attn.in_proj_qkvz.weight":
            per = arr.reshape(nk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = np.split(per, np.cumsum([dk, dk, r * dv])[:3], axis=1)
            flat = [x.reshape(-1, arr.shape[1]) for x in (q, k, v, z)]
            out[f"blk.{i}.attn_qkv.weight"] = np.concatenate(flat[:3])
            out[f"blk.{i}.attn_gate.weight"] = flat[3]
            continue
        if tiled and role.startswith("linear_attn."):
            qk = 2 * nk * dk
            if role == "linear_attn.in_proj_qkv.weight" or role == "linear_attn.conv1d.weight":
                arr = np.concatenate([arr[:qk], _tiled_v(arr[qk:], 0, nk, r, dv)])
            elif role == "linear_attn.in_proj_z.weight":
                arr = _tiled_v(arr, 0, nk, r, dv)
            elif role.split(".")[1] in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
                arr = _tiled_v(arr, 0, nk, r, 1)
            elif role == "linear_attn.out_proj.weight":
                arr = _tiled_v(arr, 1, nk, r, dv)
        out[f"blk.{i}.{layer[role]}"] = arr
    return out


def write_hybrid_gguf(
    model, path: Path, arch: str, qtype: str = "F32", tensors: dict | None = None
) -> Path:
    """A Qwen3-Next / Qwen3.5 transformers model as a qwen3next / qwen35 / qwen35moe GGUF;
    2-D weights whose rows fit the block stored as `qtype` (the conv weight, routers and
    narrower rows stay float32, as llama.cpp's quantizer leaves them). `tensors`: the
    GGUF tensors to write instead of the model's (hybrid_tensors' names)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    width = getattr(cfg, "intermediate_size", None)
    if isinstance(width, int):
        w.add_feed_forward_length(width)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters
    w.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(4)
    if arch != "qwen35":
        _add_moe_metadata(w, cfg, arch)
    tokens = [bytes([i]).decode("latin-1") if i < 256 else f"<{i}>" for i in range(cfg.vocab_size)]
    w.add_tokenizer_model("none")
    w.add_token_list(tokens)
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    for name, arr in (tensors or hybrid_tensors(model, arch)).items():
        if name == "output.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("ffn_gate_inp_shexp.weight"):
            arr = arr.reshape(-1)
        fits = arr.ndim >= 2 and arr.shape[-1] % 32 == 0
        plain = "ffn_gate_inp" in name or "ssm_conv1d" in name
        if qtype != "F32" and fits and not plain:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
