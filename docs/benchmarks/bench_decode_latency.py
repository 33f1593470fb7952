"""Batch-1 decode time that is not weight streaming, before/after: each model compiled with
each decode-attention form (compiler/kernels/attention.py decode_form: "head", one block per
query head and split; "gqa", one block per KV head and split; "tile[:options]", the grouped
kernel with its tile loaded before the wait), then timed on one GPU.

    # here: the SmolLM2 metadata (bench_gpu_quant.py --prep-smol), and the kernels prebuilt
    python docs/benchmarks/bench_decode_latency.py --meta .work/gpuq-meta --prebuild
    # on the GPU machine (HIPC_CACHE_DIR as here: the compile then only writes weights)
    python docs/benchmarks/bench_decode_latency.py --meta .work/gpuq-meta --out $OUT/lat.md

Models (--models; default l8_q4_0,smol_q4_1): smol_bf16 (SmolLM2-135M shape, random bf16), smol_q4_1 (the real SmolLM2 Q4_1's
tensor list and tokenizer, random blocks), l8_q4_0 (Llama-3-8B shape as llama-quantize's
Q4_0 makes it, cut to --l8-layers layers). Per model and form: the engine's forward() loop
(decode tok/s at each --positions, 128 tokens), the decode graph replayed alone, the
per-kernel profile (profile_gpu_decode.kernel_times: events between launches, so without
the launches' overlap), and for smol_q4_1 the generation loop (runtime/generate.py, a chat
prompt, 128 tokens, EOS ignored) with its host time per token between collecting one step
and submitting the next (the GPU idles then).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODELS = ("l8_q4_0", "smol_q4_1", "smol_bf16")
FORMS = ("head", "gqa", "tile")


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_source(model: str, work: Path, args) -> Path:
    import bench_gpu
    import bench_gpu_quant as q

    path = work / model
    if path.exists():
        return path
    if model == "smol_bf16":
        bench_gpu.write_model("smol", path)
    elif model == "smol_q4_1":
        path = path.with_suffix(".gguf")
        if not path.exists():
            q.write_smol(args.meta, path)
    else:
        path = path.with_suffix(".gguf")
        if not path.exists():
            q.L8["L"] = args.l8_layers
            q.write_l8(path, "l8_q4_0")
    return path


def compile_model(src: Path, form: str, work: Path) -> Path:
    from hipc.cli.main import main as hipc
    from hipc.compiler.kernels import attention

    out = work / f"{src.stem}-{form.replace(':', '_')}.hipc"
    if out.exists():
        return out
    attention.DECODE_FORM = form
    argv = ["compile", str(src), "--target", "sm_90", "-o", str(out), "-q"]
    if src.suffix == ".gguf":
        argv += ["--activations", "int8"]
    t = time.perf_counter()
    rc = hipc(argv)
    if rc:
        raise SystemExit(f"compile {src} ({form}) failed: {rc}")
    log(f"compiled {out.name} in {time.perf_counter() - t:.1f} s")
    return out


def engine_loop(eng, position: int, n: int = 128, repeats: int = 5) -> float:
    ids = np.random.default_rng(1).integers(0, eng.vocab_size, position).tolist()
    rates = []
    for _ in range(repeats):
        tok = int(eng.forward(ids, 0).argmax())
        t = time.perf_counter()
        for i in range(n):
            tok = int(eng.forward([tok], position + i).argmax())
        rates.append(n / (time.perf_counter() - t))
    return statistics.median(rates)


class Timed:
    """The engine, with the host time between a step's collect() returning and the next
    submit() (or forward()) being called: what the host adds to each token while the GPU
    waits."""

    def __init__(self, eng) -> None:
        self.eng, self.max_context, self.gaps, self._back = eng, eng.max_context, [], None

    def reset(self) -> None:
        self.eng.reset()

    def _start(self) -> None:
        if self._back is not None:
            self.gaps.append(time.perf_counter() - self._back)

    def forward(self, tokens, start):
        self._start()
        out = self.eng.forward(tokens, start)
        self._back = time.perf_counter()
        return out

    def submit(self, tokens, start) -> None:
        self._start()
        self.eng.submit(tokens, start)

    def collect(self, copy: bool = True):
        out = self.eng.collect(copy=copy)
        self._back = time.perf_counter()
        return out


class Copying(Timed):
    """As the generation loop ran before it sampled from the pinned buffer: a copy per step."""

    def collect(self):
        return super().collect(copy=True)


def generation(eng, n: int = 128) -> dict:
    from hipc.runtime.generate import Generation, GenerationRequest

    tok = eng.tokenizer
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tuple(tok.encode(tok.render_chat(chat, add_generation_prompt=True), False))
    req = GenerationRequest(prompt_ids=ids, max_tokens=n, ignore_eos=True)
    rates, gaps, copying = [], [], []
    for _ in range(3):
        for kind in (Timed, Copying):
            timed = kind(eng)
            gen = Generation(timed, tok, req)
            for _ in gen:
                pass
            if kind is Timed:
                rates.append(gen.result.decode_tokens_per_s)
                gaps.append(statistics.median(timed.gaps[1:]) * 1e6)
            else:
                copying.append(gen.result.decode_tokens_per_s)
    # the engine loop from the same position, with the same gap measured
    timed = Timed(eng)
    ids_list = list(ids)
    tok_id = int(timed.forward(ids_list, 0).argmax())
    t = time.perf_counter()
    for i in range(n):
        tok_id = int(timed.forward([tok_id], len(ids_list) + i).argmax())
    loop = n / (time.perf_counter() - t)
    return {
        "prompt": len(ids),
        "generate": statistics.median(rates),
        "generate_copying": statistics.median(copying),
        "generate_gap_us": statistics.median(gaps),
        "loop_same_pos": loop,
        "loop_gap_us": statistics.median(timed.gaps[1:]) * 1e6,
    }


def measure(art: Path, positions: list[int], gen: bool) -> dict:
    from profile_gpu_decode import kernel_times, replay_ms

    from hipc.runtime.engine import load_engine

    eng = load_engine(art, target="cuda")
    r: dict = {"kernels": len(eng.backend.gpu.decode), "layers": 0}
    for p in positions:
        r[f"loop@{p}"] = engine_loop(eng, p)
    for p in positions:
        per_kind, launches = kernel_times(eng, p)
        r[f"prof@{p}"] = per_kind
        r[f"replay@{p}"] = replay_ms(eng, p)
        r["layers"] = sum(1 for x in launches if "decode" in x.kernel and "attention" in x.kernel)
    if gen:
        r.update(generation(eng))
    eng.close()
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--meta", type=Path, help="bench_gpu_quant.py --prep-smol's folder (smol_q4_1)")
    # smol_bf16 only when asked: a call of ~150 s fits the other two, both forms
    ap.add_argument("--models", default="l8_q4_0,smol_q4_1", help=f"of {','.join(MODELS)}")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--positions", default="512,2048")
    ap.add_argument("--l8-layers", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hipc-declat"))
    ap.add_argument("--prebuild", action="store_true", help="compile only (fills HIPC_CACHE_DIR)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    positions = [int(x) for x in args.positions.split(",")]
    rows, notes = [], []
    for model in args.models.split(","):
        src = make_source(model, args.work, args)
        for form in args.forms.split(","):
            art = compile_model(src, form, args.work)
            if args.prebuild:
                continue
            r = measure(art, positions, gen=model == "smol_q4_1")
            L = r["layers"]
            row = [model, form, str(r["kernels"])]
            for p in positions:
                prof = r[f"prof@{p}"]
                att = sum(v for k, v in prof.items() if "attention" in k and "decode" in k)
                with_copies, alone = r[f"replay@{p}"]
                row += [f"{r[f'loop@{p}']:,.1f}", f"{alone:.3f}", f"{att / L * 1e6:.1f}"]
                top = sorted(prof.items(), key=lambda kv: -kv[1])
                notes.append(
                    f"{model} {form} @{p}: replay {alone:.3f} ms (with copies {with_copies:.3f}), "
                    f"kernels back to back {sum(prof.values()) * 1e3:.3f} ms: "
                    + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in top)
                )
            if "generate" in r:
                row.append(
                    f"{r['generate']:,.1f} (copying {r['generate_copying']:,.1f}; loop "
                    f"{r['loop_same_pos']:,.1f}; host gap {r['generate_gap_us']:.0f} / "
                    f"{r['loop_gap_us']:.0f} us)"
                )
                notes.append(f"{model} {form}: generation {r}")
            else:
                row.append("")
            rows.append(row)
            log(" | ".join(row))
            for note in notes[len(notes) - len(positions) - ("generate" in r) :]:
                log(note)
    if args.prebuild:
        return
    head = ["model", "attention", "kernels"]
    for p in positions:
        head += [f"tok/s @{p}", f"graph ms @{p}", f"attn us/layer @{p}"]
    head.append(
        "generate tok/s (copying: a copy per step; loop: forward() from the same position; host gap generate / loop)"
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(notes) + "\n\n" + "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
