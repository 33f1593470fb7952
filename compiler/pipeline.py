"""hipc compile, top to bottom: model -> graph -> passes -> kernels -> code object -> artifact.

Each step is a named call; `dump_dir` (or $HIPC_DUMP_DIR) writes what every stage
produced, so a user can see what the compiler did.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hipc.base.safetensors_file import LazyTensor
from hipc.base.version import ABI_VERSION, HIPC_VERSION
from hipc.cache import CacheKey, KernelCache, max_bytes_from_env
from hipc.compiler.artifact import TargetBuild, sha256_file, write_artifact
from hipc.compiler.codegen.cpu import render_cpu_program
from hipc.compiler.codegen.hip import render_hip_program
from hipc.compiler.ir import Constant, Graph, PackedWeight
from hipc.compiler.ir.verify import verify
from hipc.compiler.onnx_export import export_onnx, onnx_available
from hipc.compiler.options import CompileOptions
from hipc.compiler.passes.canonicalize import canonicalize
from hipc.compiler.passes.fuse import Fusion, fuse
from hipc.compiler.passes.memory import plan_memory
from hipc.compiler.passes.repack import SPLIT_BLOCKS, merge_parallel_linears, split_quant_blocks
from hipc.compiler.passes.select import select_kernels, weight_order
from hipc.compiler.source.reader import WeightReader
from hipc.compiler.toolchains.cpu import CpuToolchain, cpu_flags
from hipc.compiler.toolchains.gpu import gpu_toolchain
from hipc.graphs import Model, build_graph, load_model


@dataclass
class CompileResult:
    artifact: Path
    fusion: Fusion
    cache_hits: dict[str, bool] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


class Stages:
    """Times each stage, reports progress on a terminal, and dumps stage outputs."""

    def __init__(self, dump_dir: Path | None, verbose: bool) -> None:
        self.dump_dir = dump_dir
        self.verbose = verbose
        self.seconds: dict[str, float] = {}
        if dump_dir:
            dump_dir.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, fn: Callable, *args):
        if self.verbose:
            print(f"hipc: {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        out = fn(*args)
        self.seconds[name] = time.perf_counter() - t0
        return out

    def bar(self, label: str) -> Callable[[int, int], None] | None:
        """A one-line byte progress bar, only on a terminal (logs get the stage lines)."""
        if not (self.verbose and sys.stderr.isatty()):
            return None

        def show(done: int, total: int) -> None:
            frac = done / total if total else 1.0
            filled = int(30 * frac)
            end = "\n" if done >= total else ""
            print(
                f"\rhipc: {label} [{'#' * filled}{'.' * (30 - filled)}] {frac:4.0%} "
                f"{done / 1e9:.2f}/{total / 1e9:.2f} GB",
                end=end,
                file=sys.stderr,
                flush=True,
            )

        return show

    def dump_graph(self, stage: str, graph: Graph) -> None:
        if not self.dump_dir:
            return
        (self.dump_dir / f"{stage}.graph.json").write_text(graph.dumps())
        if onnx_available():
            export_onnx(graph, self.dump_dir / f"{stage}.onnx")

    def dump_text(self, name: str, text: str) -> None:
        if self.dump_dir:
            (self.dump_dir / name).write_text(text)


def compile_model(
    model_ref: str | os.PathLike,
    out: str | os.PathLike,
    options: CompileOptions,
    *,
    dump_dir: str | os.PathLike | None = None,
    cache: KernelCache | None = None,
    verbose: bool | None = None,
) -> CompileResult:
    dump = dump_dir or os.environ.get("HIPC_DUMP_DIR")
    cache_bound = max_bytes_from_env()  # a bad value fails now, not after the compile
    st = Stages(Path(dump) if dump else None, sys.stderr.isatty() if verbose is None else verbose)
    reader = WeightReader()

    model: Model = st.run("load model", load_model, model_ref)
    max_ctx = options.resolved_max_context(model.config.max_position_embeddings)
    if max_ctx < model.config.max_position_embeddings and options.max_context is None:
        # NOTE: said even with -q: a context shorter than the model's is a silent limit otherwise
        print(
            f"hipc: max context capped at {max_ctx} for {', '.join(options.targets)} (the model "
            f"allows {model.config.max_position_embeddings}; --max-context N sets it)",
            file=sys.stderr,
        )
    max_tokens = options.resolved_max_tokens(max_ctx)
    # The unfused graph is the specification; the reference executor runs it.
    graph = st.run("build graph", build_graph, model, max_ctx)
    st.dump_graph("0-built", graph)
    # Linear/Embedding/SiLU forms read weights in their storage types.
    graph = verify(st.run("canonicalize", canonicalize, graph, reader))
    st.dump_graph("1-canonical", graph)
    # One wide Linear for q/k/v and for gate/up: activations read once, fewer kernels.
    graph = verify(st.run("repack weights", merge_parallel_linears, graph, reader))
    st.dump_graph("2-repacked", graph)
    # Prologues, epilogues, attention: the kernels that will run, with reasons.
    fusion = st.run("fuse", fuse, graph)
    st.dump_text("3-fusion.txt", explain(fusion))
    # One arena for activations; the KV cache lives outside it.
    memory = st.run("plan memory", plan_memory, fusion, max_tokens)
    # Template + specialization + argument bindings per group.
    launches = st.run("select kernels", select_kernels, fusion)

    builds, hits = [], {}
    gpu_sections: dict[str, dict] = {}
    cache = cache or KernelCache()
    for target in options.targets:
        # Render this target's source; its hash keys the code-object cache.
        if target == "cpu":
            toolchain, ext = CpuToolchain(), "cpp"
            program = st.run(
                f"render {target}",
                render_cpu_program,
                model.name,
                launches,
                memory,
                list(graph.states),
                max_ctx,
                model.config.vocab_size,
                HIPC_VERSION,
                target,
                options.activations,
            )
            info = {"cpu_features": list(cpu_flags()), "abi_version": ABI_VERSION}
        else:
            toolchain, ext = gpu_toolchain(target), "hip"
            program = st.run(
                f"render {target}",
                render_hip_program,
                model.name,
                launches,
                memory,
                list(graph.states),
                HIPC_VERSION,
                target,
                max_ctx,
                options.resolved_kv_storage(),
                options.quant_layout,
            )
            gpu_sections[target] = program.gpu
            info = {"wave": program.gpu["wave"]}
        st.dump_text(f"4-{target}.{ext}", program.source)
        key = CacheKey.for_source(
            program.source,
            toolchain=toolchain.identity,
            flags=toolchain.flags,
            target=toolchain.target_id,
            hipc_version=HIPC_VERSION,
        )
        binary, hits[target] = st.run(
            f"compile {target}",
            cache.get_or_build,
            key,
            functools.partial(toolchain.compile, program.source),
            {"model": model.name},
        )
        builds.append(
            TargetBuild(
                target,
                binary,
                program.source,
                {
                    **info,
                    "toolchain": toolchain.identity,
                    "flags": list(toolchain.flags),
                    "target_id": toolchain.target_id,
                    "cache_key": key.digest,
                },
            )
        )

    weights = [
        _lazy_weight(name, graph.initializers[name], reader, options.quant_layout)
        for name in weight_order(launches)
    ]
    plan = {
        "entry": "hipc_forward",
        "abi_version": ABI_VERSION,
        "max_context": max_ctx,
        "max_tokens": max_tokens,
        "vocab_size": model.config.vocab_size,
        "memory": memory.to_json(),
        "weights": [
            {
                "name": w.name,
                "dtype": graph.values[w.name].dtype,
                "shape": list(graph.values[w.name].shape),
                "stored_shape": list(w.shape),
                **_layout_record(graph.values[w.name].dtype, options.quant_layout),
            }
            for w in weights
        ],
        "states": [
            {
                "name": s,
                "dtype": options.resolved_kv_storage(),
                "shape": [max_ctx if d == "max_ctx" else d for d in graph.states[s].shape],
            }
            for s in program.states
        ],
        "kernels": {
            lt.kernel.fn: {"template": lt.kernel.template, "params": dict(lt.kernel.params)}
            for lt in launches
        },
        "launches": [lt.to_json() for lt in launches],
        "gpu": gpu_sections,
    }
    tokenizer = st.run("tokenizer", _optional_tokenizer, model)
    manifest = {
        "model": _model_record(model),
        "config": model.config.to_json(),
        "options": {**options.to_json(), "max_context": max_ctx, "max_tokens": max_tokens},
    }
    st.run(
        "write artifact",
        lambda: write_artifact(
            Path(out),
            manifest=manifest,
            plan=plan,
            fusion=_fusion_json(fusion),
            builds=builds,
            weights=weights,
            tokenizer_json=tokenizer.to_json() if tokenizer else None,
            tokenizer_meta=tokenizer.to_dict() if tokenizer else None,
            generation=model.source.generation_defaults(),
            on_progress=st.bar("writing weights"),
        ),
    )
    # The cache folder stays within its bound; the artifact just written is never evicted.
    _swept, evicted = cache.trim(cache_bound, keep=[Path(out)])
    if evicted:
        print(
            f"hipc: cache over HIPC_CACHE_MAX_BYTES ({cache_bound / 2**30:.1f} GiB): removed "
            f"{evicted} least recently used entries from {cache.root}",
            file=sys.stderr,
        )
    return CompileResult(Path(out), fusion, hits, st.seconds)


def _optional_tokenizer(model: Model):
    """The model's tokenizer; a folder without tokenizer.json still compiles (token ids only)."""
    if (
        model.source.format == "safetensors"
        and not (model.source.path / "tokenizer.json").is_file()
    ):
        print(
            f"hipc: note: {model.source.path} has no tokenizer.json; the artifact takes token ids only",
            file=sys.stderr,
        )
        return None
    return model.source.tokenizer()


def _lazy_weight(name: str, init, reader: WeightReader, quant_layout: str) -> LazyTensor:
    """A weight for weights.safetensors in its storage form (quantized blocks as uint8 rows,
    split into quants and scales when `quant_layout` is "split")."""
    if isinstance(init, Constant):
        arr = np.ascontiguousarray(init.array, dtype=np.float32)
        return LazyTensor(name, arr.dtype, arr.shape, lambda: arr)
    refs = init.parts if isinstance(init, PackedWeight) else (init,)
    parts = [reader.stored(r) for r in refs]  # memory-mapped: nothing is read yet
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    if quant_layout == "split" and init.dtype in SPLIT_BLOCKS:
        return LazyTensor(
            name, parts[0].dtype, shape, lambda: split_quant_blocks(reader.stored(init), init.dtype)
        )
    return LazyTensor(name, parts[0].dtype, shape, lambda: reader.stored(init))


def _layout_record(dtype: str, quant_layout: str) -> dict:
    """plan.json's note of how a quantized weight's blocks are stored."""
    if dtype not in SPLIT_BLOCKS:
        return {}
    return {"layout": "split" if quant_layout == "split" else "gguf"}


def _model_record(model: Model) -> dict:
    src = model.source
    files = sorted({Path(r.path) for r in (src.weight_ref(n) for n in src.tensor_names)})
    return {
        "ref": src.ref,
        "format": src.format,
        "path": str(src.path),
        "files": [
            {"name": f.name, "size": f.stat().st_size, "sha256": sha256_file(f)} for f in files
        ],
    }


def _fusion_json(fusion: Fusion) -> dict:
    return {
        "groups": [{"name": g.name, "kind": g.kind, "nodes": g.node_names} for g in fusion.groups],
        "decisions": [d.__dict__ for d in fusion.decisions],
    }


def explain(fusion: Fusion) -> str:
    """What --explain prints: kernels, fusions made (with bytes saved) and refused (with why).

    Layers repeat, so decisions are folded by their layer-independent form (l0.q -> l*.q),
    with a count.
    """

    def fold(decisions):
        rows: dict[tuple, int] = {}
        for d in decisions:
            key = (_layerless(d.node), _layerless(d.group), d.role, d.score, _layerless(d.reason))
            rows[key] = rows.get(key, 0) + 1
        return rows

    taken = fold(d for d in fusion.decisions if d.accepted)
    refused = fold(d for d in fusion.decisions if not d.accepted)
    lines = [
        f"{len(fusion.groups)} kernels from {len(fusion.graph)} nodes",
        f"\nfused ({sum(taken.values())}):",
    ]
    lines += [
        f"  {n:22s} -> {g:18s} {r:24s} saves {s} B/token  x{c}"
        for (n, g, r, s, _), c in taken.items()
    ]
    lines.append(f"\nrefused ({sum(refused.values())}):")
    lines += [
        f"  {n:22s} -> {g:18s} {r:24s} {why}  x{c}" for (n, g, r, _, why), c in refused.items()
    ]
    return "\n".join(lines) + "\n"


def _layerless(name: str) -> str:
    import re

    return re.sub(r"\bl\d+\.", "l*.", name)
