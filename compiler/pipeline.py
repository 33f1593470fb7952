"""hipc compile, top to bottom: model -> graph -> passes -> kernels -> code object -> artifact.

`stages()` lists the steps in order, each a named function over one Compilation record;
`dump_dir` (or $HIPC_DUMP_DIR) writes what every stage produced (graphs, fusion, memory
plan, kernel selection, sources, launch plan), so a user can see what the compiler did.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hipc.base.errors import HipcError
from hipc.base.launch_plan import (
    LAUNCH_PLAN_FORMAT,
    LAUNCH_PLAN_VERSION,
    StateSpec,
    check_launch_plan,
)
from hipc.base.progress import byte_progress
from hipc.base.safetensors_file import LazyTensor
from hipc.base.version import HIPC_VERSION
from hipc.cache import CacheKey, KernelCache, max_bytes_from_env
from hipc.compiler.artifact import TargetBuild, sha256_file, write_artifact
from hipc.compiler.codegen.environment import check_weight_types
from hipc.compiler.export_gguf import export_gguf as write_gguf
from hipc.compiler.ir import Constant, Graph, PackedWeight, StackedWeight
from hipc.compiler.ir.verify import verify
from hipc.compiler.onnx_export import export_onnx, onnx_available
from hipc.compiler.options import CompileOptions
from hipc.compiler.passes.canonicalize import canonicalize
from hipc.compiler.passes.fuse import Fusion, fuse
from hipc.compiler.passes.lanes import fifth_form, lane_types, lanes_weights, lay_out_lanes
from hipc.compiler.passes.memory import MemoryPlan, plan_memory
from hipc.compiler.passes.quantize import quantize_weights
from hipc.compiler.passes.repack import (
    FIFTH_TYPES,
    SPLIT_BLOCKS,
    lane_quant_blocks,
    merge_parallel_linears,
    split_quant_blocks,
    split_residual_sums,
)
from hipc.compiler.passes.select import SelectedKernel, select_kernels, weight_order
from hipc.compiler.source.reader import WeightReader
from hipc.compiler.targets import Program, Target, target
from hipc.compiler.toolchains.cpu import cpu_flags
from hipc.graphs import Model, build_graph, load_model


@dataclass
class CompileResult:
    artifact: Path
    fusion: Fusion
    cache_hits: dict[str, bool] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class Compilation:
    """What the stages read and write, filled in top to bottom."""

    model_ref: str | os.PathLike
    out: Path
    options: CompileOptions
    targets: list[Target]
    cache: KernelCache
    reader: WeightReader = field(default_factory=WeightReader)
    model: Model | None = None
    max_ctx: int = 0
    max_tokens: int = 0
    graph: Graph | None = None
    fusion: Fusion | None = None
    memory: MemoryPlan | None = None
    kernels: list[SelectedKernel] = field(default_factory=list)
    lane_fifth: str = "masks"  # how the lanes weights' fifth bits are arranged (passes/lanes.py)
    programs: dict[str, Program] = field(default_factory=dict)
    builds: list[TargetBuild] = field(default_factory=list)
    cache_hits: dict[str, bool] = field(default_factory=dict)
    states: list[StateSpec] = field(default_factory=list)
    weights: list[LazyTensor] = field(default_factory=list)
    plan: dict | None = None
    cache_bound: int = 0
    export_gguf: Path | None = None
    verbose: bool = False
    on_progress: Callable[[int, int], None] | None = None

    @property
    def kv_storage(self) -> str:
        return self.options.resolved_kv_storage()


@dataclass(frozen=True)
class Stage:
    """One named step; `dump` writes what it produced (`--dump DIR`, $HIPC_DUMP_DIR)."""

    name: str
    run: Callable[[Compilation], None]
    dump: Callable[[Compilation, Dumper], None] | None = None


def stages(targets: list[Target]) -> list[Stage]:
    """The pipeline, top to bottom. Render and compile repeat per target."""
    return [
        Stage("load model", _load_model),
        # The unfused graph is the specification; the reference executor runs it.
        Stage("build graph", _build_graph, _dump_graph("0-built")),
        # --quant: float matrices -> GGML blocks (cached); the graph reads those from here on.
        Stage("quantize", _quantize, _dump_quantized),
        # --export-gguf: the same tensors as a GGUF file for llama.cpp (and hipc) to load
        Stage("export gguf", _export_gguf),
        # Linear/Embedding/SiLU forms read weights in their storage types.
        Stage("canonicalize", _canonicalize, _dump_graph("1-canonical")),
        # One wide Linear for q/k/v and for gate/up: activations read once, fewer kernels.
        Stage("repack weights", _repack, _dump_graph("2-repacked")),
        # Prologues, epilogues, attention: the kernels that will run, with reasons.
        Stage("fuse", _fuse, lambda c, d: d.text("3-fusion.txt", explain(c.fusion))),
        # One arena for activations; the KV cache lives outside it.
        Stage(
            "plan memory", _plan_memory, lambda c, d: d.json("4-memory.json", c.memory.to_json())
        ),
        # Per-sequence states by kind (KV cache, recurrent): sizing, reset and reuse rules.
        Stage("plan states", _plan_states),
        # Template + specialization + argument bindings per group; a CPU-only artifact's
        # quantized matrices in row lanes where the kernels reading them can take it.
        Stage("select kernels", _select, lambda c, d: d.json("5-kernels.json", _kernels_json(c))),
        *(
            stage
            for t in targets
            for stage in (
                # This target's source; its hash keys the code-object cache.
                Stage(f"render {t.name}", _render(t), _dump_source(t)),
                Stage(f"compile {t.name}", _compile(t)),
            )
        ),
        Stage("launch plan", _launch_plan, lambda c, d: d.json("7-plan.json", c.plan)),
        Stage("write artifact", _write),
        # The cache folder stays within its bound; the artifact just written is never evicted.
        Stage("trim cache", _trim_cache),
    ]


# ops the GPU targets have no kernel for yet -> what to tell the user (none today: Gated
# DeltaNet's has landed; a kernel kind refuses the shapes it cannot cover with a FusionError)
NO_KERNEL_YET: dict[str, str] = {}


def refuse_ops_without_kernels(graph: Graph, targets: tuple[str, ...]) -> None:
    """One clear line naming the first such node, before any pass trips over it."""
    cpu_only = all(t == "cpu" for t in targets)
    for node in graph.nodes:
        if node.op in NO_KERNEL_YET and not cpu_only:
            raise HipcError(f"{node.name}: {NO_KERNEL_YET[node.op]}")


def compile_model(
    model_ref: str | os.PathLike,
    out: str | os.PathLike,
    options: CompileOptions,
    *,
    dump_dir: str | os.PathLike | None = None,
    cache: KernelCache | None = None,
    verbose: bool | None = None,
    export_gguf: str | os.PathLike | None = None,
) -> CompileResult:
    dump = dump_dir or os.environ.get("HIPC_DUMP_DIR")
    dumper = Dumper(Path(dump) if dump else None)
    verbose = sys.stderr.isatty() if verbose is None else verbose
    targets = [target(t) for t in options.targets]
    c = Compilation(model_ref, Path(out), options, targets, cache or KernelCache())
    c.cache_bound = max_bytes_from_env()  # a bad value fails now, not after the compile
    c.export_gguf = Path(export_gguf) if export_gguf else None
    c.verbose = verbose
    c.on_progress = byte_progress("writing weights", verbose)
    seconds: dict[str, float] = {}
    for stage in stages(targets):
        if verbose:
            print(f"hipc: {stage.name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        stage.run(c)
        seconds[stage.name] = time.perf_counter() - t0
        if stage.dump and dumper.dir:
            stage.dump(c, dumper)
    return CompileResult(c.out, c.fusion, c.cache_hits, seconds)


# -- the stages ------------------------------------------------------------------------


def _load_model(c: Compilation) -> None:
    c.model = load_model(c.model_ref)
    cfg = c.model.config
    limit = cfg.max_position_embeddings
    types = cfg.layer_types or ("full_attention",) * cfg.num_layers
    kv_share = sum(t != "linear_attention" for t in types) / len(types)
    c.max_ctx = c.options.resolved_max_context(limit, kv_share)
    if c.max_ctx < limit and c.options.max_context is None:
        # NOTE: said even with -q: a context shorter than the model's is a silent limit otherwise
        print(
            f"hipc: max context capped at {c.max_ctx} for {', '.join(c.options.targets)} (the "
            f"model allows {limit}; --max-context N sets it)",
            file=sys.stderr,
        )
    c.max_tokens = c.options.resolved_max_tokens(c.max_ctx)


def _build_graph(c: Compilation) -> None:
    c.graph = build_graph(c.model, c.max_ctx)
    refuse_ops_without_kernels(c.graph, c.options.targets)


def _quantize(c: Compilation) -> None:
    bar = byte_progress("quantizing", c.verbose)
    c.graph = verify(
        quantize_weights(
            c.graph, c.options.quant, c.reader, targets=c.options.targets, on_progress=bar
        )
    )


def _export_gguf(c: Compilation) -> None:
    if c.export_gguf:
        write_gguf(c.model, c.graph, c.export_gguf, c.options.quant, c.reader)


def _canonicalize(c: Compilation) -> None:
    c.graph = verify(canonicalize(c.graph, c.reader))


def _repack(c: Compilation) -> None:
    c.graph = verify(merge_parallel_linears(verify(split_residual_sums(c.graph)), c.reader))


def _fuse(c: Compilation) -> None:
    c.fusion = fuse(c.graph)


def _plan_memory(c: Compilation) -> None:
    c.memory = plan_memory(c.fusion, c.max_tokens)


def _select(c: Compilation) -> None:
    c.kernels = select_kernels(c.fusion)
    flags = cpu_flags()
    types = lane_types(c.options.targets, flags)
    if types:
        c.lane_fifth = fifth_form(flags)
        values = {name: c.graph.values[name] for name in weight_order(c.kernels)}
        c.kernels = lay_out_lanes(
            c.kernels,
            {n: v.dtype for n, v in values.items()},
            {n: tuple(int(d) for d in v.shape) for n, v in values.items()},
            types,
        )


def _render(t: Target) -> Callable[[Compilation], None]:
    def run(c: Compilation) -> None:
        # a weight type without a kernel here: one line naming the tensor, before rendering
        check_weight_types(c.kernels, c.graph.initializers, t.family)
        c.programs[t.name] = t.render(c)

    return run


def _compile(t: Target) -> Callable[[Compilation], None]:
    def run(c: Compilation) -> None:
        program = c.programs[t.name]
        toolchain = t.toolchain()
        key = CacheKey.for_source(
            program.source,
            toolchain=toolchain.identity,
            flags=toolchain.flags,
            target=toolchain.target_id,
            hipc_version=HIPC_VERSION,
        )
        binary, c.cache_hits[t.name] = c.cache.get_or_build(
            key, functools.partial(toolchain.compile, program.source), {"model": c.model.name}
        )
        info = {
            **program.info,
            "toolchain": toolchain.identity,
            "flags": list(toolchain.flags),
            "target_id": toolchain.target_id,
            "cache_key": key.digest,
        }
        c.builds.append(TargetBuild(t, binary, program.source, info))

    return run


def _plan_states(c: Compilation) -> None:
    c.states = []
    for name, t in c.graph.states.items():
        kind = _state_kind(t)
        dtype = c.kv_storage if kind == "kv" else "float32"
        shape = tuple(c.max_ctx if d == "max_ctx" else int(d) for d in t.shape)
        c.states.append(StateSpec(name, kind, dtype, shape))


def _state_kind(t) -> str:
    """A state indexed by position along its first axis is a KV cache; any other state is
    a fixed-size per-sequence recurrent one."""
    return "kv" if t.shape and t.shape[0] == "max_ctx" else "recurrent"


def _launch_plan(c: Compilation) -> None:
    graph = c.graph
    # in their storage form: the plan records the shapes the runtime will map
    lanes = lanes_weights(c.kernels)
    layouts = {
        name: "lanes" if name in lanes else c.options.quant_layout
        for name in weight_order(c.kernels)
    }
    c.weights = [
        _lazy_weight(name, graph.initializers[name], c.reader, layout, c.lane_fifth)
        for name, layout in layouts.items()
    ]
    c.plan = {
        "format": LAUNCH_PLAN_FORMAT,
        "version": LAUNCH_PLAN_VERSION,
        "max_context": c.max_ctx,
        "max_tokens": c.max_tokens,
        "vocab_size": c.model.config.vocab_size,
        "weights": [
            {
                "name": w.name,
                "dtype": graph.values[w.name].dtype,
                "shape": list(graph.values[w.name].shape),
                "stored_shape": list(w.shape),
                **_layout_record(graph.values[w.name].dtype, layouts[w.name], c.lane_fifth),
            }
            for w in c.weights
        ],
        "states": [s.to_json() for s in c.states],
        "memory": c.memory.to_json(),
        "kernels": {k.fn: {"kind": k.kind.name, "params": k.params.to_json()} for k in c.kernels},
        # the kernel selection (graph values bound by name): what runtime/integrity.py checks
        # the states and weights against
        "groups": [k.to_json() for k in c.kernels],
        "targets": {name: p.plan for name, p in c.programs.items()},
    }
    check_launch_plan(c.plan, "the launch plan just built")  # a compiler bug, caught before writing


def _write(c: Compilation) -> None:
    model = c.model
    tokenizer = _optional_tokenizer(model)
    manifest = {
        "model": _model_record(model),
        "config": model.config.to_json(),
        "options": {
            **c.options.to_json(),
            "max_context": c.max_ctx,
            "max_tokens": c.max_tokens,
        },
    }
    write_artifact(
        c.out,
        manifest=manifest,
        plan=c.plan,
        fusion=_fusion_json(c.fusion),
        builds=c.builds,
        weights=c.weights,
        tokenizer_json=tokenizer.to_json() if tokenizer else None,
        tokenizer_meta=tokenizer.to_dict() if tokenizer else None,
        generation=model.source.generation_defaults(),
        on_progress=c.on_progress,
    )


def _trim_cache(c: Compilation) -> None:
    _swept, evicted = c.cache.trim(c.cache_bound, keep=[c.out])
    if evicted:
        print(
            f"hipc: cache over HIPC_CACHE_MAX_BYTES ({c.cache_bound / 2**30:.1f} GiB): removed "
            f"{evicted} least recently used entries from {c.cache.root}",
            file=sys.stderr,
        )


# -- dumps ------------------------------------------------------------------------------


class Dumper:
    def __init__(self, dir: Path | None) -> None:
        self.dir = dir
        if dir:
            dir.mkdir(parents=True, exist_ok=True)

    def text(self, name: str, text: str) -> None:
        (self.dir / name).write_text(text)

    def json(self, name: str, obj) -> None:
        self.text(name, json.dumps(obj, indent=1))

    def graph(self, stage: str, graph: Graph) -> None:
        self.text(f"{stage}.graph.json", graph.dumps())
        if onnx_available():
            export_onnx(graph, self.dir / f"{stage}.onnx")


def _dump_graph(stage: str) -> Callable[[Compilation, Dumper], None]:
    return lambda c, d: d.graph(stage, c.graph)


def _dump_quantized(c: Compilation, d: Dumper) -> None:
    if c.options.quant:
        d.graph("0-quantized", c.graph)


def _dump_source(t: Target) -> Callable[[Compilation, Dumper], None]:
    return lambda c, d: d.text(f"6-{t.name}.{t.source_ext}", c.programs[t.name].source)


def _kernels_json(c: Compilation) -> dict:
    return {
        "kernels": {k.fn: {"kind": k.kind.name, "params": k.params.to_json()} for k in c.kernels},
        "groups": [k.to_json() for k in c.kernels],
    }


def _optional_tokenizer(model: Model):
    """The model's tokenizer; a folder without tokenizer.json still compiles (token ids only)."""
    src = model.source
    if (src.format == "safetensors" and not (src.path / "tokenizer.json").is_file()) or (
        src.format == "gguf" and src.raw_config.get("tokenizer.ggml.model") == "none"
    ):
        print(
            f"hipc: note: {src.path} has no tokenizer; the artifact takes token ids only",
            file=sys.stderr,
        )
        return None
    return model.source.tokenizer()


def _lazy_weight(
    name: str, init, reader: WeightReader, quant_layout: str, fifth: str = "masks"
) -> LazyTensor:
    """A weight for weights.safetensors in its storage form (quantized blocks as uint8 rows,
    split into quants and scales when `quant_layout` is "split", in 16-row lanes when
    "lanes")."""
    if isinstance(init, Constant):
        arr = np.ascontiguousarray(init.array, dtype=np.float32)
        return LazyTensor(name, arr.dtype, arr.shape, lambda: arr)
    if isinstance(init, StackedWeight) and not (
        quant_layout == "split" and init.dtype in SPLIT_BLOCKS
    ):
        # HF's per-expert tensors: written one expert at a time, never all in memory at once
        first = reader.stored(init.parts[0])
        form = (
            (lambda a: _lanes(a, init.dtype, fifth)) if quant_layout == "lanes" else (lambda a: a)
        )
        return LazyTensor(
            name,
            first.dtype,
            init.shape[:1] + first.shape,
            lambda: form(reader.stored(init)),
            chunks=lambda: (form(reader.stored(p))[None] for p in init.parts),
        )
    refs = init.parts if isinstance(init, PackedWeight) else (init,)
    parts = [reader.stored(r) for r in refs]  # memory-mapped: nothing is read yet
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    if quant_layout == "split" and init.dtype in SPLIT_BLOCKS:
        return LazyTensor(
            name, parts[0].dtype, shape, lambda: split_quant_blocks(reader.stored(init), init.dtype)
        )
    if quant_layout == "lanes":
        if len(shape) == 2:
            shape = (-(-shape[0] // 16) * 16, shape[1])  # whole groups of 16 rows
        return LazyTensor(
            name, parts[0].dtype, shape, lambda: _lanes(reader.stored(init), init.dtype, fifth)
        )
    return LazyTensor(name, parts[0].dtype, shape, lambda: reader.stored(init))


def _lanes(stored: np.ndarray, dtype: str, fifth: str) -> np.ndarray:
    """A matrix in row lanes; stacked experts each in lanes of its own (passes/lanes.py takes
    only those of whole 16-row groups, so every expert keeps the file's offset)."""
    if stored.ndim == 2:
        return lane_quant_blocks(stored, dtype, fifth)
    return np.stack([lane_quant_blocks(e, dtype, fifth) for e in stored])


def _layout_record(dtype: str, quant_layout: str, fifth: str) -> dict:
    """plan.json's note of how a quantized weight's blocks are stored (lanes of a type with
    fifth bits: their arrangement too, repack.FIFTH_FORMS)."""
    if dtype not in SPLIT_BLOCKS:
        return {}
    if quant_layout == "lanes" and dtype in FIFTH_TYPES:
        return {"layout": "lanes", "fifth": fifth}
    return {"layout": quant_layout if quant_layout in ("split", "lanes") else "gguf"}


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
