"""Mixture-of-Experts on the GPU: hipc beside llama.cpp on the same files, in one run.

Run on the GPU machine (docs/benchmarks/README.md says how the device tool carries it):

    python docs/benchmarks/bench_gpu_moe.py --out $OUT/moe.md [--llamacpp-bin DIR] \
        [--models qwen3,olmoe] [--layers qwen3=48,olmoe=16] [--profile] \
        [--activations int16,int8]
    python docs/benchmarks/bench_gpu_moe.py --models qwen3 --layers qwen3=8 \
        --variant before:int16:moe.MOE_UP_BLOCKS_PER_SM=2 --variant after:int16: ...

Models (random weights, real shapes; --layers cuts the layer count to save disk and time):
  qwen3  Qwen3-30B-A3B shape, Q4_0: a GGUF written directly in blocks by write_moe_gguf.py
         (17 GB at 48 layers); hipc compiles that file and llama-bench reads the same one.
  qwen3_q4km  the same shape in llama-quantize's Q4_K_M mix (Q4_K, Q6_K for the output and,
         in the layers given more bits, attn_v and the down experts).
  olmoe  OLMoE-1B-7B shape, bf16: a Hugging Face folder with per-expert tensors for hipc
         (14 GB at 16 layers), and, with --llamacpp-bin, an F16 GGUF of the same shape for
         llama.cpp (write_moe_gguf.py --type f16), written after hipc's files are deleted.
For each: `hipc compile --target sm_90` (timed), a 512-token prefill and 128 greedy decode
tokens (median of --repeats; greedy decode is the engine's forward() per token, logits copied
back and argmax taken on the host; the second decode column evaluates tokens as llama-bench's
tg does, logits copied back but no sampling), and `llama-bench -p 512 -n 128 -fa 1 -ngl 99` with
--llamacpp-bin DIR. Decode bandwidth counts the ACTIVE bytes one token reads: attention,
norms, the router, k of the E experts, the LM head and one embedding row, against the
device-to-device copy bandwidth measured in the same run. --profile adds each decode
kernel's time (profile_gpu_decode.py) for the first model. --activations int16,int8: a hipc
row per rounding of the quantized GEMVs' activations (int8: as llama.cpp's). --variant: one
model compiled several ways (compiler constants replaced, see compile_hipc), each as decode
tok/s and its graph's replay, in place of the table (moedec_check.sh).

Full size, both models (the lead's call; qwen3 ~3 min, olmoe ~4 min at 16 layers: a 14 GB
bf16 folder, hipc's 14 GB artifact, then after both are deleted a 14 GB F16 GGUF):

    python docs/benchmarks/bench_gpu_moe.py --models qwen3,olmoe --repeats 2 \
        --activations int16,int8 --llamacpp-bin DIR --out $OUT/moe.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu import bench_hipc, ceilings, log  # noqa: E402
from write_moe_gguf import PRESETS  # noqa: E402
from write_moe_gguf import write as write_gguf  # noqa: E402

PRESET = {"qwen3": "qwen3-30b-a3b", "qwen3_q4km": "qwen3-30b-a3b", "olmoe": "olmoe-1b-7b"}
FORMAT = {
    "qwen3": "Q4_0 GGUF",
    "qwen3_q4km": "Q4_K_M GGUF",
    "olmoe": "bf16 safetensors (llama.cpp: F16 GGUF)",
}
GGUF_TYPE = {"qwen3": "q4_0", "qwen3_q4km": "q4_k_m"}  # the models written as GGUF


def gguf_active_bytes(path: Path, cfg: dict) -> int:
    """Bytes one decode token reads from a GGUF: k / E of each stacked expert tensor, one row
    of the embedding table, every other tensor whole."""
    import gguf

    total = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        n = int(t.n_bytes)
        if "_exps." in t.name:
            n = n * cfg["active"] // cfg["experts"]
        elif t.name.startswith("token_embd"):
            n //= cfg["vocab"]
        total += n
    return total


def write_olmoe_hf(folder: Path, cfg: dict) -> int:
    """An OLMoE-shaped bf16 Hugging Face folder (one tensor per expert, as allenai ships it);
    returns the active bytes of a decode token."""
    from hipc.base.safetensors_file import LazyTensor, write_safetensors

    L, H, NH, D, E, F, V = (cfg[k] for k in ("layers", "hidden", "heads", "head_dim", "experts",
                                              "expert_ffn", "vocab"))  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": V,
        "hidden_size": H, "intermediate_size": F, "num_hidden_layers": L,
        "num_attention_heads": NH, "num_key_value_heads": cfg["kv_heads"], "num_experts": E,
        "num_experts_per_tok": cfg["active"], "norm_topk_prob": False, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "clip_qkv": None, "torch_dtype": "bfloat16",
    }))  # fmt: skip
    rng = np.random.default_rng(0)
    base = (0.02 * rng.standard_normal(1 << 22)).astype(np.float32).view(np.uint32) >> 16
    base = base.astype(np.uint16)

    def rnd(shape):
        def load():
            n, off = int(np.prod(shape)), int(rng.integers(0, 1 << 20))
            return np.tile(base, -(-(n + off) // base.size))[off : off + n].reshape(shape)

        return load

    def ones(n):
        return lambda: np.full(n, 0x3F80, np.uint16)  # bf16 1.0

    KV = cfg["kv_heads"] * D
    tensors = [
        ("model.embed_tokens.weight", (V, H), rnd((V, H))),
        ("model.norm.weight", (H,), ones(H)),
        ("lm_head.weight", (V, H), rnd((V, H))),
    ]
    active = 2 * H + 2 * V * H + 2 * H  # final norm, LM head, one embedding row
    for i in range(L):
        p = f"model.layers.{i}."
        attn = [("q_proj", (NH * D, H)), ("k_proj", (KV, H)), ("v_proj", (KV, H)),
                ("o_proj", (H, NH * D))]  # fmt: skip
        tensors += [(p + f"self_attn.{n}.weight", s, rnd(s)) for n, s in attn]
        tensors += [
            (p + "self_attn.q_norm.weight", (NH * D,), ones(NH * D)),
            (p + "self_attn.k_norm.weight", (KV,), ones(KV)),
            (p + "input_layernorm.weight", (H,), ones(H)),
            (p + "post_attention_layernorm.weight", (H,), ones(H)),
            (p + "mlp.gate.weight", (E, H), rnd((E, H))),
        ]
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            tensors += [(q + "gate_proj.weight", (F, H), rnd((F, H))),
                        (q + "up_proj.weight", (F, H), rnd((F, H))),
                        (q + "down_proj.weight", (H, F), rnd((H, F)))]  # fmt: skip
        active += 2 * (sum(int(np.prod(s)) for _, s in attn) + NH * D + KV + 2 * H + E * H)
        active += 2 * cfg["active"] * 3 * F * H
    lazy = [LazyTensor(n, np.dtype(np.uint16), s, f, code="BF16") for n, s, f in tensors]
    write_safetensors(folder / "model.safetensors", lazy)
    return active


def compile_hipc(
    src: Path, artifact: Path, target: str, activations: str = "int16", sets: str = ""
) -> float:
    """`hipc compile`, timed. `sets` ("module.NAME=EXPR;..."): compiler constants replaced
    before compiling (hipc.compiler.kernels.<module>.NAME = eval(EXPR) there), so that one
    device call can time launch choices side by side (--variants) without a flag in hipc."""
    t = time.perf_counter()
    args = ["compile", str(src), "--target", target, "-o", str(artifact), "-q",
            "--max-context", "1024", "--prefill-chunk", "512", "--activations", activations]  # fmt: skip
    code = ["import importlib, sys", "from hipc.cli.main import main"]
    for item in filter(None, sets.split(";")):
        name, expr = item.split("=", 1)
        mod, attr = name.strip().rsplit(".", 1)
        code += [f"m = importlib.import_module('hipc.compiler.kernels.{mod}')",
                 f"assert hasattr(m, {attr!r}), {name!r}",
                 f"setattr(m, {attr!r}, eval({expr!r}, vars(m)))"]  # fmt: skip
    code.append(f"sys.exit(main({args!r}))")
    subprocess.run([sys.executable, "-c", "\n".join(code)], check=True)
    return time.perf_counter() - t


def llama_bench(bin_dir: Path, gguf_path: Path, repeats: int) -> dict | None:
    bench = bin_dir / "llama-bench"
    if not bench.exists():
        log(f"llama.cpp: {bench} not found")
        return None
    cmd = [str(bench), "-m", str(gguf_path), "-ngl", "99", "-fa", "1", "-p", "512", "-n", "128",
           "-r", str(repeats), "-o", "json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    try:
        rows = json.loads(proc.stdout)
    except json.JSONDecodeError:
        log("llama-bench failed:", proc.stderr[-800:])
        return None
    return {"prefill" if r["n_prompt"] else "decode": r["avg_ts"] for r in rows}


def decode_and_replay(artifact: Path, repeats: int, prompt: int = 512, decode: int = 128):
    """One load: decode tok/s as bench_hipc times it (forward() per token, argmax on the
    host) and the seconds the decode step's captured graph takes replayed back to back (no
    host work between: the kernels' launch chain alone, without the logits' copy)."""
    from hipc.runtime.engine import load_engine

    os.environ["HIPC_OVERLAP_LAUNCHES"] = "1"
    eng = load_engine(artifact, target="cuda")
    ids = np.random.default_rng(1).integers(0, eng.vocab_size, prompt).tolist()
    tok = int(eng.forward(ids, 0).argmax())
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(decode):
            tok = int(eng.forward([tok], prompt + i).argmax())
        rates.append(decode / (time.perf_counter() - t))
    b = eng.backend
    d, graph = b._driver, b._graphs[("decode", 1)][1]
    d.synchronize()
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        d.graph_launch(graph)
    d.synchronize()
    replay = (time.perf_counter() - t) / n
    eng.close()
    return max(rates), replay


def variants(args, name: str, cfg: dict, ceil_copy: float) -> str:
    """--variant LABEL:ACTIVATIONS:SETS ...: one source file, compiled once per variant (SETS
    as compile_hipc's `sets`), each timed by decode_and_replay (best of --repeats); --profile
    adds the per-kernel profile of the second variant (the first being "before")."""
    src = write_gguf(args.work / f"{name}.gguf", cfg, GGUF_TYPE[name])
    active = gguf_active_bytes(src, cfg)
    lines = [
        f"variants: {name}, {cfg['layers']} layers, {active / 1e9:.3f} GB active per token",
        "",
        "| variant | activations | decode tok/s | graph replay ms | per layer us | active % of copy |",
        "|---|---|---:|---:|---:|---:|",
    ]
    profiles = []
    base = None
    for i, spec in enumerate(args.variant):
        label, act, sets = [*spec.split(":", 2), "", ""][:3]
        artifact = args.work / f"{name}-{i}.hipc"
        try:
            compile_hipc(src, artifact, args.target, act or "int16", sets)
            dc, g = decode_and_replay(artifact, args.repeats)
        except Exception as e:  # a variant that fails is a row, not the end
            lines.append(f"| {label} | {act} | failed: {str(e)[-120:]} | | | |")
            log(lines[-1])
            continue
        base = base if base is not None else g
        # the LM head, final norm and embedding row are common to every variant: the
        # difference between two variants' replay over the layers is theirs alone
        lines.append(
            f"| {label} | {act or 'int16'} | {dc:,.1f} | {g * 1e3:.3f} | "
            f"{(g - base) / cfg['layers'] * 1e6:+.2f} vs first | "
            f"{100 * dc * active / ceil_copy:.0f}% |"
        )
        log(lines[-1])
        if args.profile and i == 1:
            profiles.append(f"profile, {label}:\n```\n{profile(artifact)}```")
        subprocess.run(["rm", "-rf", str(artifact)], check=True)
    src.unlink()
    return "\n".join([*profiles, "", *lines])


def profile(artifact: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(HERE / "profile_gpu_decode.py"), str(artifact), "--position", "512"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return proc.stdout + proc.stderr[-2000:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="qwen3,olmoe")
    ap.add_argument("--layers", default="", help="per-model layer counts, e.g. qwen3=8,olmoe=2")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-moe-bench"))
    ap.add_argument("--llamacpp-bin", type=Path, default=None, help="folder with llama-bench")
    ap.add_argument("--profile", action="store_true", help="per-kernel decode times")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--activations",
        default="int16",
        help="hipc compile --activations, comma-separated for a row each (int16,int8): "
        "llama.cpp's quantized GEMVs take int8 activations",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:ACT:SETS",
        help="time compile variants of the first model instead (see variants())",
    )
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    layers = dict(kv.split("=") for kv in args.layers.split(",") if kv)
    ceil = ceilings()
    copy = ceil["copy_bytes_per_s"]
    log(f"ceilings: copy {copy / 1e12:.2f} TB/s")
    rows, notes = [], []
    if args.variant:
        name = args.models.split(",")[0]
        cfg = dict(PRESETS[PRESET[name]])
        cfg["layers"] = int(layers.get(name, cfg["layers"]))
        text = variants(args, name, cfg, copy)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return
    for name in args.models.split(","):
        cfg = dict(PRESETS[PRESET[name]])
        if name in layers:
            cfg["layers"] = int(layers[name])
        label = f"{name} ({cfg['layers']} layers, {FORMAT[name].split(' ')[0]})"
        artifact = args.work / f"{name}.hipc"
        t = time.perf_counter()
        if name in GGUF_TYPE:
            src = write_gguf(args.work / f"{name}.gguf", cfg, GGUF_TYPE[name])
            active = gguf_active_bytes(src, cfg)
        else:
            src = args.work / name
            active = write_olmoe_hf(src, cfg)
        log(f"{name}: wrote {src} in {time.perf_counter() - t:.0f} s")
        # bf16 experts have no quantized activations: one hipc row whatever --activations says
        for act in args.activations.split(",") if name in GGUF_TYPE else ["int16"]:
            compile_s = compile_hipc(src, artifact, args.target, act)
            r = bench_hipc(artifact, args.repeats, 512, 128)
            eng = "hipc" + (" (int8 activations)" if act == "int8" else "")
            rows.append((label, eng, r["prefill"], r["decode"], r["decode_eval"], active))
            log(rows[-1])
            notes.append(
                f"{name}, {eng}: compile {compile_s:.0f} s, load {r['load_s']:.1f} s, "
                f"{r['kernels']} kernels per decode step, {active / 1e9:.3f} GB active per "
                f"decode token ({cfg['active']} of {cfg['experts']} experts)"
            )
            if args.profile and len(notes) == 1:
                notes.append("decode profile:\n```\n" + profile(artifact) + "```")
            subprocess.run(["rm", "-rf", str(artifact)], check=True)
        if name == "olmoe":
            subprocess.run(["rm", "-rf", str(src)], check=True)
        if args.llamacpp_bin:
            if name == "olmoe":  # llama.cpp reads no safetensors: the same shape as F16
                src = write_gguf(args.work / f"{name}-f16.gguf", cfg, "f16")
            lc = llama_bench(args.llamacpp_bin, src, args.repeats)
            if lc:
                eng = "llama.cpp " + (GGUF_TYPE.get(name, "f16").upper())
                dc = lc.get("decode", 0.0)
                rows.append((label, eng, lc.get("prefill", 0.0), None, dc, active))
                log(rows[-1])
        if isinstance(src, Path) and src.suffix == ".gguf":
            src.unlink()
    lines = [
        f"ceilings: device copy {copy / 1e12:.2f} TB/s (read+write), "
        f"bf16 matmul {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s",
        "",
        "| model | engine | prefill 512 tok/s | greedy decode tok/s (host argmax) "
        "| decode tok/s (as llama-bench: logits copied, no sampling) | active GB/s | % of copy bw |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, eng, pf, greedy, dc, active in rows:
        bw = dc * active
        g = "" if greedy is None else f"{greedy:,.1f}"
        lines.append(
            f"| {label} | {eng} | {pf:,.0f} | {g} | {dc:,.1f} | {bw / 1e9:,.0f} | {100 * bw / copy:.0f}% |"
        )
    lines += ["", *[f"- {n}" for n in notes]]
    text = "\n".join(lines)
    print(text)
    if args.out:
        cmd = "python docs/benchmarks/bench_gpu_moe.py " + " ".join(sys.argv[1:])
        args.out.write_text(f"# GPU MoE benchmark\n\n```\n{cmd}\n```\n\n{text}\n")
    os.sync()


if __name__ == "__main__":
    main()
