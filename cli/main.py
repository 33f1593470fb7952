"""The `hipc` command line.

Every command imports what it needs when it runs, so `hipc serve` on a GPU box never
loads the compiler, and a typo in a flag costs no import time. User mistakes surface
as HipcError: one line on stderr, exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence

from hipc.base.errors import HipcError


class _Parser(argparse.ArgumentParser):
    """argparse with hipc's error shape: one line, `hipc: error: ...`, exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        choice = re.match(
            r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)", message
        )
        if choice:
            options = re.findall(r"'([^']*)'", choice.group(3))
            message = f"argument {choice.group(1)}: invalid choice {choice.group(2)!r}"
            message += (
                _did_you_mean(choice.group(2), options) or f" (choose from {', '.join(options)})"
            )
        hint = "" if message.endswith(")") else f" (see {self.prog} --help)"
        self.exit(2, f"hipc: error: {message}{hint}\n")


def _did_you_mean(word: str, options: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _unrecognized(parser: argparse.ArgumentParser, args, extras: list[str]) -> str:
    """One line for arguments no option took, naming the closest flag of that command."""
    sub = parser._subcommands.get(getattr(args, "command", None))  # type: ignore[attr-defined]
    flags = [
        f
        for a in (sub or parser)._actions
        if a.help != argparse.SUPPRESS
        for f in a.option_strings
        if f.startswith("--")
    ]
    flag = next((e for e in extras if e.startswith("-")), None)
    prog = sub.prog if sub else parser.prog
    if flag is None:
        return f"{prog}: unexpected argument {extras[0]!r} (see {prog} --help)"
    name = flag.split("=", 1)[0]
    return f"{prog}: unknown option {name}" + (
        _did_you_mean(name, flags) or f" (see {prog} --help)"
    )


def _parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise HipcError(f"--tokens: expected comma-separated integers, got {text!r}") from None
    if not tokens:
        raise HipcError("--tokens: no token ids given")
    return tokens


def _load(model_ref: str):
    from hipc.graphs import load_model

    return load_model(model_ref)


def _prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        prompt = tokenizer.render_chat(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        return tokenizer.encode(prompt, add_special_tokens=False)
    return tokenizer.encode(text)


def _is_artifact(ref: str) -> bool:
    from hipc.runtime.artifact import is_artifact

    return is_artifact(ref)


def _engine(args):
    """The engine for MODEL: an artifact as is, a raw model compiled (cached) first, or the reference."""
    if args.reference:
        if _is_artifact(args.model):
            raise HipcError(
                "--reference runs a model, not a compiled artifact; pass the model instead"
            )
        from hipc.compiler.reference.engine import ReferenceEngine

        return ReferenceEngine(_load(args.model), args.max_context)
    from hipc.runtime.engine import load_engine

    if _is_artifact(args.model):
        return load_engine(
            args.model, threads=getattr(args, "threads", None), max_context=args.max_context
        )
    return load_engine(_compiled(args.model, args), threads=getattr(args, "threads", None))


def _compiled(model_ref: str, args) -> str:
    """Compile a raw model for the default target once, into the cache's artifact folder."""
    from hipc.compiler.cached import cached_artifact
    from hipc.compiler.options import CompileOptions

    return str(cached_artifact(model_ref, CompileOptions(max_context=args.max_context)))


def _model_not_artifact(args) -> None:
    """verify and compile read a model; an artifact is the output of compile."""
    if not _is_artifact(args.model):
        return
    source = ""
    try:
        with open(os.path.join(args.model, "manifest.json"), encoding="utf-8") as f:
            ref = json.load(f).get("model", {}).get("ref")
        source = f"; this one was compiled from {ref}" if isinstance(ref, str) and ref else ""
    except (OSError, ValueError, AttributeError):
        pass
    raise HipcError(
        f"{args.model}: a compiled artifact, but `hipc {args.command}` takes a model "
        f"(HF folder, .gguf file, local HF id or alias){source}"
    )


# tables the compiler computes into an artifact's weights (RoPE's cos/sin): not parameters
_COMPUTED_WEIGHTS = ("rope.",)


def _artifact_info(path: str) -> dict:
    """What `hipc info` says of a compiled artifact: its source, options and targets from the
    manifest, its weights from the plan (merged projections count their rows once each)."""
    from hipc.graphs.config import ModelConfig
    from hipc.runtime.artifact import load_artifact

    art = load_artifact(path)
    weights = [w for w in art.plan["weights"] if not w["name"].startswith(_COMPUTED_WEIGHTS)]
    params, by_dtype = 0, {}
    for w in weights:
        params += math.prod(w["shape"])
        by_dtype[w["dtype"]] = by_dtype.get(w["dtype"], 0) + 1
    info = {
        "artifact": {
            "path": str(art.path),
            "hipc_version": art.manifest.get("hipc_version"),
            "targets": art.targets,
            "options": art.manifest.get("options"),
        },
        "source": art.manifest.get("model", {}),
        "config": art.config,
        "weights": {"tensors": len(weights), "parameters": params, "weight_dtypes": by_dtype},
    }
    config = ModelConfig.from_json(art.config)
    if config.is_moe:
        from hipc.graphs.moe import moe_summary

        info["moe"] = moe_summary(config, params)
    return info


def cmd_info(args) -> int:
    from hipc.graphs import build_graph

    if _is_artifact(args.model):
        print(json.dumps(_artifact_info(args.model), indent=2))
        return 0
    model = _load(args.model)
    graph = build_graph(model, args.max_context)
    params, by_dtype = 0, {}
    for ref in graph.weight_refs().values():
        n = 1
        for d in ref.shape:
            n *= d
        params += n
        by_dtype[ref.dtype] = by_dtype.get(ref.dtype, 0) + 1
    info = {
        "source": {
            "ref": args.model,
            "format": model.source.format,
            "path": str(model.source.path),
        },
        "config": model.config.to_json(),
        "graph": {
            "nodes": len(graph),
            "ops": graph.op_histogram(),
            "weights": len(graph.weight_refs()),
            "parameters": params,
            "weight_dtypes": by_dtype,
            "max_context": graph.metadata["max_ctx"],
        },
    }
    if model.config.is_moe:
        from hipc.graphs.moe import moe_summary

        info["moe"] = moe_summary(model.config, params)
    if "linear_attention" in model.config.layer_types:
        from hipc.graphs.hybrid import hybrid_summary

        info["hybrid"] = hybrid_summary(model.config)
    print(json.dumps(info, indent=2))
    return 0


def _tokenizer(model_ref: str):
    if _is_artifact(model_ref):
        from hipc.runtime.artifact import load_artifact

        return load_artifact(model_ref).tokenizer()
    return _load(model_ref).source.tokenizer()


def cmd_tokenize(args) -> int:
    tokenizer = _tokenizer(args.model)
    print(json.dumps(_prompt_ids(tokenizer, args.text, args.chat)))
    return 0


def cmd_logits(args) -> int:
    import numpy as np

    tokens = _parse_tokens(args.tokens)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise HipcError(f"--out: directory {out_dir} does not exist")
    engine = _engine(args)
    vocab = engine.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise HipcError(f"--tokens: token id {bad[0]} is out of vocabulary (size {vocab})")
    if len(tokens) > engine.max_context:
        raise HipcError(
            f"--tokens: {len(tokens)} tokens exceed the context of {engine.max_context}"
        )
    logits = np.asarray(engine.logits(tokens, 0), dtype=np.float32)
    tmp = f"{args.out}.tmp-{os.getpid()}.npy"
    try:
        np.save(tmp, logits)
        os.replace(tmp, args.out)
    except OSError as e:
        raise HipcError(f"--out: cannot write {args.out} ({e.strerror})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"wrote {args.out}: float32 {list(logits.shape)}", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    from hipc.runtime.generate import Generation, GenerationRequest
    from hipc.runtime.sampler import SamplingParams

    engine = _engine(args)
    tokenizer = engine.tokenizer
    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    if args.max_tokens is not None and args.max_tokens < 1:
        raise HipcError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    request = GenerationRequest(
        prompt_ids=tuple(_prompt_ids(tokenizer, args.prompt, args.chat)),
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )
    gen = Generation(engine, tokenizer, request)
    for delta in gen:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.json:
        print(json.dumps(gen.result.to_json(), ensure_ascii=False))
    return 0


def cmd_serve(args) -> int:
    from hipc.runtime.server.config import OPTIONS, Config
    from hipc.runtime.server.serve import serve

    config = Config.from_sources({o.field: getattr(args, o.field) for o in OPTIONS})
    return serve(config)


def cmd_chat(args) -> int:
    from hipc.runtime.sampler import SamplingParams
    from hipc.runtime.server.terminal_chat import run_chat

    if not _is_artifact(args.artifact):
        raise HipcError(
            f"{args.artifact}: not a compiled artifact (make one with: hipc compile MODEL -o NAME.hipc)"
        )
    if args.max_tokens is not None and args.max_tokens < 1:
        raise HipcError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise HipcError(f"--chat-template {args.chat_template}: {e.strerror}") from None
    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    from hipc.runtime.engine import load_engine

    engine = load_engine(args.artifact, threads=args.threads)
    return run_chat(
        engine,
        sampling=sampling,
        max_tokens=args.max_tokens,
        system=args.system,
        chat_template=template,
        reasoning=args.reasoning,
        show_reasoning=args.show_reasoning,
    )


def cmd_compile(args) -> int:
    from hipc.compiler.options import CompileOptions
    from hipc.compiler.pipeline import compile_model, explain
    from hipc.compiler.toolchains.detect import resolve_targets

    _model_not_artifact(args)
    chunk = args.prefill_chunk
    if args.old_max_tokens is not None:
        if chunk is not None and chunk != args.old_max_tokens:
            raise HipcError("--max-tokens and --prefill-chunk disagree; pass only --prefill-chunk")
        chunk = args.old_max_tokens
        print(
            "hipc: warning: `hipc compile --max-tokens` is deprecated: it sets the prefill "
            "chunk, so it is now --prefill-chunk (generate's --max-tokens counts generated tokens)",
            file=sys.stderr,
        )
    options = CompileOptions(
        targets=resolve_targets(tuple(args.target or ["cpu"])),
        max_context=args.max_context,
        max_tokens=chunk,
        activations=args.activations,
        kv_storage=args.kv_storage,
        quant=args.quant,
        prefill_precision=args.prefill_precision,
    )
    out = args.output or f"{_default_name(args.model)}.hipc"
    result = compile_model(
        args.model,
        out,
        options,
        dump_dir=args.dump,
        verbose=not args.quiet,
        export_gguf=args.export_gguf,
    )
    if args.explain:
        print(explain(result.fusion), end="")
    hits = ", ".join(
        f"{t}: {'cache hit' if h else 'compiled'}" for t, h in result.cache_hits.items()
    )
    total = sum(result.seconds.values())
    print(f"wrote {result.artifact} ({hits}; {total:.1f} s)", file=sys.stderr)
    return 0


def _default_name(model_ref: str) -> str:
    from pathlib import Path

    name = Path(model_ref.rstrip("/")).name
    return name.removesuffix(".gguf") or "model"


def cmd_verify(args) -> int:
    from hipc.compiler.verify_compiled import verify_model

    _model_not_artifact(args)
    report = verify_model(
        args.model,
        target=args.target,
        text=args.text,
        max_context=args.max_context,
        rtol=args.rtol,
        min_top1=args.min_top1,
        quant=args.quant,
        prefill_precision=args.prefill_precision,
    )
    print(report.table())
    return 0 if report.ok else 1


def cmd_cache(args) -> int:
    from hipc.cache import KernelCache

    cache = KernelCache()
    if args.action == "clear":
        import shutil

        from hipc.compiler.scratch import sweep_pending, sweep_tool_dirs
        from hipc.runtime.integrity import stamp_dir

        before = cache.info()["total_bytes"]
        # what killed compiles left: their artifact scratch (wherever -o was) and temp dirs
        swept = sweep_pending(cache.root) + sweep_tool_dirs()
        shutil.rmtree(stamp_dir(), ignore_errors=True)  # artifacts are hashed again on load
        artifacts = cache.clear_artifacts()
        kernels = cache.clear()
        freed = max(before - cache.info()["total_bytes"], 0)
        print(
            f"removed {kernels} kernels and {artifacts} cached artifacts "
            f"({freed / 2**20:.1f} MiB) from {cache.root}"
        )
        if swept:
            print(f"removed {len(swept)} leftovers of killed compiles")
    else:
        print(json.dumps(cache.info(), indent=2, default=str))
    return 0


def _sampling_flags(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0 = greedy, deterministic (default 0)",
    )
    sp.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus sampling mass (default 1: off)",
    )
    sp.add_argument(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="sample among the K likeliest (default 0: off)",
    )
    sp.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        metavar="P",
        help="drop tokens below P x the top probability (default 0: off)",
    )
    sp.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="R",
        help="penalize tokens of the prompt and output, HF-style: a logit is divided by R, "
        "or multiplied when negative (default 1: off)",
    )
    sp.add_argument(
        "--seed", type=int, default=None, metavar="S", help="sampling seed (default: random)"
    )


def _threads_flag(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads (default: $OMP_NUM_THREADS, else every core this process may use)",
    )


def _numerics_flags(sp: argparse.ArgumentParser) -> None:
    """What compile and verify both take: the GPU prefill precision and the quantization."""
    sp.add_argument(
        "--prefill-precision",
        choices=["bf16", "split"],
        default="bf16",
        help="GPU prefill GEMMs on bf16 weights: activations rounded to bf16 once (default, "
        "as peers do) or split into bf16 hi + lo (twice the matrix work, float32-class logits)",
    )
    sp.add_argument(
        "--quant",
        metavar="RECIPE",
        default=None,
        help="quantize float weights at compile time, as llama-quantize's file type of that "
        "name: q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, iq4_xs, q2_k, q3_k, q4_k, q5_k, q6_k, "
        "q3_k_m, q3_k_l, q4_k_m, q5_k_m",
    )


def build_parser() -> argparse.ArgumentParser:
    from hipc.base.version import HIPC_VERSION

    p = _Parser(prog="hipc", description="Ahead-of-time LLM compiler for HIP.")
    p.add_argument("--version", action="version", version=f"hipc {HIPC_VERSION}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p._subcommands = sub.choices  # type: ignore[attr-defined]

    def model_cmd(name: str, help: str, fn, artifact_ok: bool = False) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        what = "HF folder, .gguf file, local HF id, or alias (smollm2-135m)"
        sp.add_argument(
            "model",
            metavar="MODEL|ARTIFACT" if artifact_ok else "MODEL",
            help=f"{what}, or an artifact (NAME.hipc/)" if artifact_ok else what,
        )
        sp.add_argument(
            "--max-context",
            type=int,
            default=None,
            metavar="N",
            help="KV-cache length (default: the model's limit, at most 4096 compiling for cpu"
            + ("; an artifact's compiled length)" if artifact_ok else ")"),
        )
        sp.set_defaults(fn=fn)
        return sp

    model_cmd(
        "info",
        "print the normalized config and graph statistics (of an artifact: its weights)",
        cmd_info,
        artifact_ok=True,
    )

    sp = model_cmd(
        "compile", "compile MODEL ahead of time into an artifact (NAME.hipc/)", cmd_compile
    )
    sp.add_argument(
        "-o", "--output", metavar="NAME.hipc", help="artifact directory (default: ./MODEL.hipc)"
    )
    sp.add_argument(
        "--target",
        action="append",
        help="cpu, sm_80/sm_89/sm_90, gfx90a/gfx942/gfx1100/gfx1101/gfx1151/gfx1201, or auto (repeatable; default cpu)",
    )
    sp.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="tokens per forward step: longer prompts are prefilled in chunks of N "
        "(default 256 for cpu, 2048 for GPUs, at most --max-context; a larger N lets a "
        "served batch prefill several prompts in one step)",
    )
    # NOTE: the old spelling, easy to mistake for generate's --max-tokens; kept working
    sp.add_argument("--max-tokens", dest="old_max_tokens", type=int, help=argparse.SUPPRESS)
    sp.add_argument(
        "--activations",
        choices=["int16", "int8"],
        default="int16",
        help="how quantized matmuls round activations: int16 (near-exact, default) or int8 (faster)",
    )
    sp.add_argument(
        "--kv-storage",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="KV-cache element type (default auto: bfloat16 for GPU targets, float32 for cpu)",
    )
    _numerics_flags(sp)
    sp.add_argument(
        "--export-gguf",
        metavar="PATH",
        default=None,
        help="also write the (quantized) model as a GGUF file llama.cpp loads",
    )
    sp.add_argument(
        "--dump", metavar="DIR", help="write every stage (graphs, fusion, sources) to DIR"
    )
    sp.add_argument(
        "--explain", action="store_true", help="print the fusions made and refused, with reasons"
    )
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    sp = model_cmd(
        "verify", "compile MODEL and compare its logits with the reference executor", cmd_verify
    )
    sp.add_argument("--target", default="cpu", help="the target to compile and run (default cpu)")
    _numerics_flags(sp)
    sp.add_argument(
        "--text", default=None, help="text to teacher-force (default: a built-in mixed sample)"
    )
    sp.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="max relative logit error (default: by weight type)",
    )
    sp.add_argument(
        "--min-top1", type=float, default=None, help="min top-1 agreement (default: by weight type)"
    )

    sp = sub.add_parser("cache", help="inspect or clear the compiled-kernel cache")
    sp.add_argument(
        "action",
        choices=["info", "clear"],
        help="info: entries and bytes (JSON); clear: remove kernels, cached artifacts, leftovers",
    )
    sp.set_defaults(fn=cmd_cache)

    sp = model_cmd("tokenize", "print token ids as JSON", cmd_tokenize, artifact_ok=True)
    sp.add_argument("--text", required=True, help="the text to tokenize")
    sp.add_argument(
        "--chat", action="store_true", help="wrap the text as a user turn in the chat template"
    )

    sp = model_cmd(
        "logits",
        "teacher-forced float32 logits [n_tokens, vocab] to a .npy file",
        cmd_logits,
        artifact_ok=True,
    )
    sp.add_argument("--tokens", required=True, help="comma-separated token ids")
    sp.add_argument("--out", required=True, metavar="FILE.npy")
    sp.add_argument("--reference", action="store_true", help="run the NumPy reference executor")

    sp = model_cmd("generate", "generate text, streamed to stdout", cmd_generate, artifact_ok=True)
    sp.add_argument("--prompt", required=True, help="the prompt text")
    sp.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user turn in the chat template"
    )
    sp.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens to generate at most (default: until EOS or the context is full)",
    )
    _sampling_flags(sp)
    sp.add_argument(
        "--stop",
        action="append",
        metavar="STR",
        help="stop before this text (repeatable; default: none)",
    )
    sp.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens"
    )
    sp.add_argument(
        "--json",
        action="store_true",
        help="print a JSON summary (ids, finish reason, tokens/s) as the last line",
    )
    sp.add_argument(
        "--reference",
        action="store_true",
        help="run the NumPy reference executor (MODEL only; slow, the oracle)",
    )
    _threads_flag(sp)

    from hipc.runtime.server.config import add_arguments

    help = "serve ARTIFACT over an OpenAI-compatible HTTP API (every flag also as HIPC_*)"
    sp = sub.add_parser("serve", help=help, description=help)
    add_arguments(sp)
    sp.set_defaults(fn=cmd_serve)

    help = "chat with ARTIFACT in the terminal, streamed (/reset, /exit)"
    sp = sub.add_parser("chat", help=help, description=help)
    sp.add_argument("artifact", metavar="ARTIFACT", help="a compiled artifact (NAME.hipc/)")
    sp.add_argument("--system", default=None, help="a system message to start with (default: none)")
    sp.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens per reply at most (default: until EOS or the context is full)",
    )
    _sampling_flags(sp)
    _threads_flag(sp)
    sp.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja template instead of the model's (default: the model's)",
    )
    sp.add_argument(
        "--reasoning",
        choices=["auto", "on", "off"],
        default="auto",
        help="split <think> spans off the reply (default auto: if the model knows <think>)",
    )
    sp.add_argument("--show-reasoning", action="store_true", help="print reasoning when piped, too")
    sp.set_defaults(fn=cmd_chat)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        print(f"hipc: error: {_unrecognized(parser, args, extras)}", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except HipcError as e:
        print(f"hipc: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
