"""Write a random-weight MoE GGUF of any shape, straight in its storage type.

For benchmarks that put hipc beside llama.cpp on one file: the GPU machine's disk has no
room for an F32/F16 copy of a 30B model, so the weights are drawn directly as Q4_0 /
Q8_0 / Q4_K / Q6_K blocks (random quants, random f16 scales around `--scale`), never as
floats, or as
F16 values tiled from one random block (fast enough for a 14 GB file), one tensor at a
time (memory: the largest tensor). Norms and routers stay F32 as llama.cpp's
converter keeps them. Architecture names, tensor names and metadata keys are llama.cpp's
(gguf-py constants), so llama.cpp and hipc read the same file.

  python docs/benchmarks/write_moe_gguf.py --preset qwen3-30b-a3b --type q4_0 out.gguf
  python docs/benchmarks/write_moe_gguf.py --preset qwen3-30b-a3b --type q4_k_m out.gguf
  python docs/benchmarks/write_moe_gguf.py --preset tiny --type q8_0 tiny.gguf
  python docs/benchmarks/write_moe_gguf.py --preset olmoe-1b-7b --type f16 olmoe.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

PRESETS = {
    # Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B)
    "qwen3-30b-a3b": dict(
        arch="qwen3moe",
        layers=48,
        hidden=2048,
        heads=32,
        kv_heads=4,
        head_dim=128,
        experts=128,
        active=8,
        expert_ffn=768,
        vocab=151936,
    ),
    # OLMoE-1B-7B (config.json of allenai/OLMoE-1B-7B-0924)
    "olmoe-1b-7b": dict(
        arch="olmoe",
        layers=16,
        hidden=2048,
        heads=16,
        kv_heads=16,
        head_dim=128,
        experts=64,
        active=8,
        expert_ffn=1024,
        vocab=50304,
    ),
    # Qwen3-MoE's structure (many narrow experts, 8 routed) at 0.70B parameters, 140M read
    # per token: the CPU benchmark's model (2 cores, docs/benchmarks/cpu-moe.md)
    "cpu-0.7b": dict(
        arch="qwen3moe",
        layers=12,
        hidden=1024,
        heads=16,
        kv_heads=4,
        head_dim=64,
        experts=64,
        active=8,
        expert_ffn=256,
        vocab=32000,
    ),
    # a CPU-sized model of the same structure
    "tiny": dict(
        arch="qwen3moe",
        layers=4,
        hidden=256,
        heads=8,
        kv_heads=2,
        head_dim=32,
        experts=16,
        active=4,
        expert_ffn=128,
        vocab=2048,
    ),
}
# bytes per block, weights per block
BLOCK = {
    "q4_0": (18, 32), "q8_0": (34, 32), "q4_k": (144, 256), "q5_k": (176, 256), "q6_k": (210, 256),
}  # fmt: skip
# q4_k_m: llama-quantize's Q4_K_M mix (q4_k_m_type)
TYPES = ("q4_0", "q8_0", "q4_k_m", "f16")
FILE_TYPE = {
    "q4_0": "MOSTLY_Q4_0", "q8_0": "MOSTLY_Q8_0", "q4_k_m": "MOSTLY_Q4_K_M", "f16": "MOSTLY_F16",
}  # fmt: skip


def q4_k_m_type(name: str, layer: int, layers: int) -> str:
    """The type llama-quantize's Q4_K_M gives a matrix (its llama_tensor_get_type's main
    rules): Q6_K for the output matrix, and for attn_v and ffn_down(_exps, _shexp) in the
    layers it gives more bits (compiler/quant_recipes follows the same rules); Q5_K for a
    fused attn_qkv (Qwen3.5's linear-attention layers); Q4_K otherwise."""
    from hipc.compiler.quant_recipes import use_more_bits

    if "attn_qkv." in name:
        return "q5_k"
    if name == "output.weight" or (
        use_more_bits(layer, layers) and ("attn_v." in name or "ffn_down" in name)
    ):
        return "q6_k"
    return "q4_k"


def tiled_f16(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Random-looking f16 values: one random block of 2^20 repeated from a random offset
    (drawing 7 billion normals one by one would take minutes)."""
    base = (scale * rng.standard_normal(1 << 20)).astype(np.float16)
    n, off = int(np.prod(shape)), int(rng.integers(0, 1 << 19))
    return np.tile(base, -(-(n + off) // base.size))[off : off + n].reshape(shape)


def random_blocks(rng: np.random.Generator, qtype: str, shape: tuple[int, ...], scale: float):
    """uint8 [..., rows, blocks * bytes] of valid blocks: f16 scale, then random quants."""
    nbytes, per = BLOCK[qtype]
    *lead, cols = shape
    if cols % per:
        raise SystemExit(f"{qtype}: row width {cols} is not a multiple of {per}")
    nblocks = int(np.prod(lead)) * (cols // per)
    out = rng.integers(0, 256, size=(nblocks, nbytes), dtype=np.uint8)
    # The largest quant times scale (Q8_0: 127; Q4_0: 7 from its nibbles' [-8, 7]; Q4_K / Q5_K:
    # 63 (6-bit scale) x 15 / 31, a min of the same order subtracted; Q6_K: 128 (int8 scale) x
    # 32) is about `scale`, so the weights stay near +-`scale`.
    q, at = {
        "q8_0": (127, 0), "q4_0": (7, 0), "q4_k": (63 * 15, 0), "q5_k": (63 * 31, 0),
        "q6_k": (128 * 32, 208),
    }[qtype]  # fmt: skip
    d = (scale / q * (0.5 + rng.random(nblocks))).astype(np.float16)
    out[:, at : at + 2] = d.view(np.uint8).reshape(nblocks, 2)
    if qtype in ("q4_k", "q5_k"):  # dmin: the same order as d
        out[:, 2:4] = d.view(np.uint8).reshape(nblocks, 2)
    return out.reshape(*lead, (cols // per) * nbytes)


def add_filler_vocabulary(w, V: int) -> None:
    """Byte-level symbols then filler tokens: llama.cpp needs a vocabulary to load."""
    tokens = [bytes([i]).decode("latin-1") if i < 256 else f"<t{i}>" for i in range(V)]
    tokens[256] = "ab"  # one merge: a BPE vocabulary with none is refused (hipc: merges missing)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * V)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_tensors(w, tensors: list[tuple[str, tuple[int, ...], str]], data) -> None:
    """Header first, then one tensor at a time (`data(shape, kind, name)`): only the largest
    is ever in memory."""
    import gguf

    for name, shape, kind in tensors:
        if kind in ("f32", "f16"):
            dt = np.dtype(np.float32 if kind == "f32" else np.float16)
            w.add_tensor_info(name, shape, dt, int(np.prod(shape)) * dt.itemsize)
        else:  # numpy-order byte shape: the writer turns it into GGUF's dims
            nbytes, per = BLOCK[kind]
            byte_shape = (*shape[:-1], shape[-1] // per * nbytes)
            size = int(np.prod(byte_shape))
            qt = getattr(gguf.GGMLQuantizationType, kind.upper())
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), size, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in tensors:
        w.write_tensor_data(data(shape, kind, name))
    w.close()


def write(path: Path, cfg: dict, qtype: str, seed: int = 0, scale: float = 0.05) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    arch, L, H = cfg["arch"], cfg["layers"], cfg["hidden"]
    NH, NKV, D, E, F, V = (cfg[k] for k in ("heads", "kv_heads", "head_dim", "experts",
                                             "expert_ffn", "vocab"))  # fmt: skip
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["active"])
    w.add_expert_feed_forward_length(F)
    w.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPE[qtype]))
    add_filler_vocabulary(w, V)

    def kind(name: str, layer: int = 0) -> str:
        return q4_k_m_type(name, layer, L) if qtype == "q4_k_m" else qtype

    tensors: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (V, H), kind("token_embd.weight")),
        ("output_norm.weight", (H,), "f32"),
        ("output.weight", (V, H), kind("output.weight")),
    ]
    for i in range(L):
        b = f"blk.{i}."
        blocked = [
            ("attn_q.weight", (NH * D, H)),
            ("attn_k.weight", (NKV * D, H)),
            ("attn_v.weight", (NKV * D, H)),
            ("attn_output.weight", (H, NH * D)),
            ("ffn_gate_exps.weight", (E, F, H)),
            ("ffn_up_exps.weight", (E, F, H)),
            ("ffn_down_exps.weight", (E, H, F)),
        ]
        tensors += [
            (b + "attn_norm.weight", (H,), "f32"),
            (b + "attn_q_norm.weight", (D if arch == "qwen3moe" else NH * D,), "f32"),
            (b + "attn_k_norm.weight", (D if arch == "qwen3moe" else NKV * D,), "f32"),
            (b + "ffn_norm.weight", (H,), "f32"),
            (b + "ffn_gate_inp.weight", (E, H), "f32"),
            *((b + n, shape, kind(b + n, i)) for n, shape in blocked),
        ]

    def data(shape: tuple[int, ...], kind: str, name: str) -> np.ndarray:
        if kind == "f32" and "norm" in name:
            return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if kind == "f32":
            return (scale * rng.standard_normal(shape)).astype(np.float32)
        if kind == "f16":
            return tiled_f16(rng, shape, scale)
        return random_blocks(rng, kind, shape, scale)

    write_tensors(w, tensors, data)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--type", choices=sorted(TYPES), default="q4_0")
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=0.05, help="typical weight magnitude")
    args = ap.parse_args()
    cfg = dict(PRESETS[args.preset])
    if args.layers:
        cfg["layers"] = args.layers
    path = write(args.out, cfg, args.type, args.seed, args.scale)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
