"""Write a random-weight Qwen3.5 / Qwen3.5-MoE GGUF (qwen35 / qwen35moe) straight in its
storage type, for benchmarks that put hipc beside llama.cpp on one file.

Three layers in four are Gated DeltaNet (linear attention), every fourth a gated full
attention layer (full_attention_interval 4); the MoE preset has 256 routed experts plus a
shared one per layer, as Qwen3.5-35B-A3B. Weights are drawn directly as Q4_0 / Q8_0 blocks,
or in llama-quantize's Q4_K_M types (write_moe_gguf.py's random blocks; one tensor at a time
in memory), norms, routers, the conv and the gate parameters stay F32 as llama.cpp's
converter and quantizer leave them.
Names, shapes and metadata keys are llama.cpp's (src/models/qwen35*.cpp): attn_qkv (q, k,
v) and attn_gate (z) on linear layers, ssm_beta / ssm_alpha, ssm_conv1d [C, K], ssm_a
(= -exp(A_log), negative), ssm_dt.bias, ssm_norm, ssm_out; attn_q holding [query | gate]
per head on full layers; post_attention_norm before the feed-forward; keys ssm.conv_kernel,
ssm.state_size (the key head width, = the value head width llama.cpp assumes),
ssm.group_count (key heads), ssm.time_step_rank (value heads), ssm.inner_size,
full_attention_interval, rope.dimension_count (the partial rotary width) and
rope.dimension_sections (M-RoPE sections; text-only positions make them plain RoPE).

  python docs/benchmarks/write_hybrid_gguf.py --preset qwen3.5-35b-a3b --type q4_0 out.gguf
  python docs/benchmarks/write_hybrid_gguf.py --preset qwen3.5-35b-a3b --type q4_k_m out.gguf
  python docs/benchmarks/write_hybrid_gguf.py --preset cpu-moe-0.7b --type q8_0 small.gguf
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

PRESETS = {
    # transformers' Qwen3_5MoeTextConfig defaults (Qwen3.5-35B-A3B)
    "qwen3.5-35b-a3b": dict(
        arch="qwen35moe", layers=40, hidden=2048, heads=16, kv_heads=2, head_dim=256,
        rotary=64, experts=256, active=8, expert_ffn=512, shared_ffn=512,
        key_heads=16, value_heads=32, linear_dim=128, conv=4, vocab=248320,
    ),
    # the same structure at 0.73B parameters (0.17B read per token): the CPU benchmark's
    # MoE model (2 cores, docs/benchmarks/cpu-hybrid.md)
    "cpu-moe-0.7b": dict(
        arch="qwen35moe", layers=12, hidden=1024, heads=8, kv_heads=2, head_dim=128,
        rotary=32, experts=64, active=8, expert_ffn=256, shared_ffn=256,
        key_heads=4, value_heads=8, linear_dim=128, conv=4, vocab=32000,
    ),
    # dense Qwen3.5 at 0.47B parameters (0.43B read per token)
    "cpu-dense-0.5b": dict(
        arch="qwen35", layers=24, hidden=1024, heads=8, kv_heads=2, head_dim=128,
        rotary=32, ffn=4096, key_heads=4, value_heads=8, linear_dim=128, conv=4, vocab=32000,
    ),
    # a few seconds to write and compile (tests/graphs/test_hybrid_llama_cpp.py)
    "tiny-dense": dict(
        arch="qwen35", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64,
        rotary=16, ffn=512, key_heads=2, value_heads=4, linear_dim=64, conv=4, vocab=2048,
    ),
    "tiny": dict(
        arch="qwen35moe", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64,
        rotary=16, experts=16, active=4, expert_ffn=128, shared_ffn=128,
        key_heads=2, value_heads=4, linear_dim=64, conv=4, vocab=2048,
    ),
}  # fmt: skip
FILE_TYPE = {
    "q4_0": "MOSTLY_Q4_0", "q8_0": "MOSTLY_Q8_0", "q4_k_m": "MOSTLY_Q4_K_M", "f32": "ALL_F32",
}  # fmt: skip


def _moe_tool():
    spec = importlib.util.spec_from_file_location("write_moe_gguf", HERE / "write_moe_gguf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def tensor_list(cfg: dict, qtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, storage) of every tensor, as llama.cpp's loader asks for them;
    "q4_k_m": each matrix's type as write_moe_gguf.q4_k_m_type gives it."""
    out = _tensors(cfg, qtype)
    if qtype != "q4_k_m":
        return out
    q4_k_m_type, L = _moe_tool().q4_k_m_type, cfg["layers"]

    def layer(name: str) -> int:
        return int(name.split(".")[1]) if name.startswith("blk.") else 0

    return [(n, s, q4_k_m_type(n, layer(n), L) if k == qtype else k) for n, s, k in out]


def _tensors(cfg: dict, qtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    H, L, V = cfg["hidden"], cfg["layers"], cfg["vocab"]
    NH, NKV, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    nk, nv, d = cfg["key_heads"], cfg["value_heads"], cfg["linear_dim"]
    C = 2 * nk * d + nv * d
    moe = cfg["arch"] == "qwen35moe"
    out = [
        ("token_embd.weight", (V, H), qtype),
        ("output_norm.weight", (H,), "f32"),
        ("output.weight", (V, H), qtype),
    ]
    for i in range(L):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (H,), "f32"),
            (b + "post_attention_norm.weight", (H,), "f32"),
        ]
        if (i + 1) % 4:
            out += [
                (b + "attn_qkv.weight", (C, H), qtype),
                (b + "attn_gate.weight", (nv * d, H), qtype),
                (b + "ssm_beta.weight", (nv, H), qtype),
                (b + "ssm_alpha.weight", (nv, H), qtype),
                (b + "ssm_conv1d.weight", (C, cfg["conv"]), "f32"),
                (b + "ssm_dt.bias", (nv,), "f32"),
                (b + "ssm_a", (nv,), "f32"),
                (b + "ssm_norm.weight", (d,), "f32"),
                (b + "ssm_out.weight", (H, nv * d), qtype),
            ]
        else:
            out += [
                (b + "attn_q.weight", (2 * NH * D, H), qtype),
                (b + "attn_k.weight", (NKV * D, H), qtype),
                (b + "attn_v.weight", (NKV * D, H), qtype),
                (b + "attn_output.weight", (H, NH * D), qtype),
                (b + "attn_q_norm.weight", (D,), "f32"),
                (b + "attn_k_norm.weight", (D,), "f32"),
            ]
        if moe:
            E, F, S = cfg["experts"], cfg["expert_ffn"], cfg["shared_ffn"]
            out += [
                (b + "ffn_gate_inp.weight", (E, H), "f32"),
                (b + "ffn_gate_exps.weight", (E, F, H), qtype),
                (b + "ffn_up_exps.weight", (E, F, H), qtype),
                (b + "ffn_down_exps.weight", (E, H, F), qtype),
                (b + "ffn_gate_inp_shexp.weight", (H,), "f32"),
                (b + "ffn_gate_shexp.weight", (S, H), qtype),
                (b + "ffn_up_shexp.weight", (S, H), qtype),
                (b + "ffn_down_shexp.weight", (H, S), qtype),
            ]
        else:
            F = cfg["ffn"]
            out += [
                (b + "ffn_gate.weight", (F, H), qtype),
                (b + "ffn_up.weight", (F, H), qtype),
                (b + "ffn_down.weight", (H, F), qtype),
            ]
    return out


def parameters(cfg: dict) -> tuple[int, int]:
    """(all parameters, those one decode token reads: the active experts only)."""
    total = active = 0
    for name, shape, _ in tensor_list(cfg, "q8_0"):
        n = int(np.prod(shape))
        total += n
        if name == "token_embd.weight":
            n = shape[1]
        elif "_exps" in name:
            n = n // cfg["experts"] * cfg["active"]
        active += n
    return total, active


def write(path: Path, cfg: dict, qtype: str, seed: int = 0, scale: float = 0.05) -> Path:
    import gguf

    tool = _moe_tool()
    rng = np.random.default_rng(seed)
    arch, nv, d = cfg["arch"], cfg["value_heads"], cfg["linear_dim"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(262144)
    w.add_embedding_length(cfg["hidden"])
    w.add_block_count(cfg["layers"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["rotary"])
    pairs = cfg["rotary"] // 2  # Qwen3.5's mrope_section [11, 11, 10] for 32 pairs
    t = (pairs * 11 + 16) // 32
    w.add_rope_dimension_sections([t, t, pairs - 2 * t, 0])
    w.add_rope_freq_base(10000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_ssm_conv_kernel(cfg["conv"])
    w.add_ssm_state_size(d)
    w.add_ssm_group_count(cfg["key_heads"])
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(nv * d)
    w.add_full_attention_interval(4)
    if arch == "qwen35moe":
        w.add_expert_count(cfg["experts"])
        w.add_expert_used_count(cfg["active"])
        w.add_expert_feed_forward_length(cfg["expert_ffn"])
        w.add_expert_shared_feed_forward_length(cfg["shared_ffn"])
    else:
        w.add_feed_forward_length(cfg["ffn"])
    w.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPE[qtype]))
    V = cfg["vocab"]
    tool.add_filler_vocabulary(w, V)
    tensors = tensor_list(cfg, qtype)

    def data(shape: tuple[int, ...], kind: str, name: str) -> np.ndarray:
        if kind != "f32":
            return tool.random_blocks(rng, kind, shape, scale)
        if name.endswith("ssm_a"):  # -exp(A_log), A_log = log(U(1, 16)) as transformers inits
            return -rng.uniform(1, 16, shape).astype(np.float32)
        if name.endswith("ssm_dt.bias"):
            return np.ones(shape, np.float32)
        if "norm" in name:
            return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    tool.write_tensors(w, tensors, data)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--type", choices=sorted(FILE_TYPE), default="q4_0")
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=0.05, help="typical weight magnitude")
    args = ap.parse_args()
    cfg = dict(PRESETS[args.preset])
    if args.layers:
        cfg["layers"] = args.layers
    total, active = parameters(cfg)
    path = write(args.out, cfg, args.type, args.seed, args.scale)
    print(
        f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, {total / 1e9:.2f}B parameters, "
        f"{active / 1e9:.2f}B read per token)"
    )


if __name__ == "__main__":
    main()
