"""quantize: float weights -> GGML blocks at compile time (`hipc compile --quant`).

A recipe names a type per weight matrix (compiler/quant_recipes.py); this stage
quantizes those matrices into a GGUF file of their own (the *store*, kept in the cache
folder and keyed by the source tensors and the recipe, so `hipc verify` and a recompile
reuse it) and points the graph's initializers at it. From here on the graph is an
ordinary quantized graph: the reference executor dequantizes the stored blocks with
gguf-py, repack and the kernels read them as they read a GGUF's, and the artifact holds
the same bytes. Norms, biases and other 1-D weights stay as they are. MoE experts become
one 3-D tensor each ([E, rows, row bytes], GGUF's stacked layout), quantized one expert at
a time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from hipc.base.errors import HipcError
from hipc.cache import default_cache_dir
from hipc.compiler.codegen.environment import KERNEL_WTYPES
from hipc.compiler.ir import Graph, StackedWeight, WeightRef, quant_row_bytes
from hipc.compiler.passes.rewrite import Rewriter
from hipc.compiler.quant_recipes import TensorChoice, choose_types
from hipc.compiler.quantize import QUANTIZABLE, quantize
from hipc.compiler.source.gguf_file import GGUFFile
from hipc.compiler.source.reader import WeightReader


@functools.cache
def _quantizer_digest() -> str:
    """A hash of the quantizers' source: a store made by other quantizers is not reused."""
    import hipc.compiler.quantize as q

    h = hashlib.sha256()
    for f in sorted(Path(q.__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


def quantize_weights(
    graph: Graph,
    recipe: str | None,
    reader: WeightReader | None = None,
    *,
    targets: Sequence[str] = (),
    store_dir: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> Graph:
    """The graph with the recipe's matrices read from a quantized store (no recipe: as is).

    The store lives in `store_dir`, by default the cache folder's quantized/. A recipe
    that gives a matrix a type one of `targets` has no kernel for is refused first:
    quantizing a large model takes minutes.
    """
    if recipe is None:
        return graph
    reader = reader or WeightReader()
    store_dir = store_dir or default_cache_dir() / "quantized"
    choices = choose_types(graph, recipe)
    todo = {name: c for name, c in choices.items() if c.dtype != c.ref.dtype}
    for target in targets:
        types = KERNEL_WTYPES["cpu" if target == "cpu" else "hip"]
        for c in todo.values():
            if c.dtype not in types:
                raise HipcError(
                    f"--quant {recipe}: {c.ref.name} would be {c.dtype}, which has no kernel "
                    f"for {target} yet (it has: {', '.join(types)})"
                )
    missing = sorted({c.dtype for c in todo.values()} - set(QUANTIZABLE))
    if missing:
        raise HipcError(
            f"--quant {recipe}: no quantizer for {', '.join(missing)} yet "
            f"(have: {', '.join(QUANTIZABLE)})"
        )
    if not todo:
        return graph
    store = _store_path(store_dir, recipe, todo)
    if not _store_ok(store, todo):
        _write_store(store, todo, reader, on_progress)
    refs = {
        name: WeightRef(str(store), c.ref.name, c.dtype, c.ref.shape, "gguf")
        for name, c in todo.items()
    }
    out = _point_at(graph, refs)
    # what --dump shows: each matrix's type and the rule that chose it
    out.metadata["quant"] = {
        "recipe": recipe,
        "store": str(store),
        "tensors": {name: f"{c.dtype}: {c.why}" for name, c in sorted(choices.items())},
    }
    return out


def _store_path(store_dir: Path, recipe: str, todo: dict[str, TensorChoice]) -> Path:
    """A name that changes with any source tensor's file, the chosen types or the quantizers."""
    stamp = []
    for name, c in sorted(todo.items()):
        for ref in _parts(c.ref):
            st = os.stat(ref.path)
            stamp.append([name, ref.path, st.st_size, st.st_mtime_ns, c.ref.dtype, c.dtype])
    blob = json.dumps([_quantizer_digest(), recipe, stamp]).encode()
    return store_dir / f"{recipe}-{hashlib.sha256(blob).hexdigest()[:24]}.gguf"


def _store_ok(store: Path, todo: dict[str, TensorChoice]) -> bool:
    """A store that opens and holds every tensor in its type and shape; anything else
    (absent, truncated, damaged) is rewritten, never read."""
    if not store.is_file():
        return False
    try:
        entries = GGUFFile(store).entries
    except HipcError:
        return False
    return all(
        (e := entries.get(c.ref.name)) is not None and (e.dtype, e.shape) == (c.dtype, c.ref.shape)
        for c in todo.values()
    )


def _write_store(
    store: Path,
    todo: dict[str, TensorChoice],
    reader: WeightReader,
    on_progress: Callable[[int, int], None] | None,
) -> None:
    """One tensor at a time (never the whole model in memory), into a temp file renamed last."""
    import gguf
    import numpy as np

    try:
        store.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HipcError(f"cache: cannot create {store.parent} ({e.strerror})") from None
    tmp = store.with_name(f".{store.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "hipc-quantized")
    order = sorted(todo)
    total = sum(_nbytes(todo[n].ref, reader) for n in order)
    done = 0
    for name in order:
        c = todo[name]
        *lead, rows, k = c.ref.shape
        qt = gguf.GGMLQuantizationType[c.dtype.upper()]
        shape = (*lead, rows, quant_row_bytes(c.dtype, k))
        nbytes = int(np.prod(shape))
        writer.add_tensor_info(c.ref.name, shape, np.dtype(np.uint8), nbytes, qt)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name in order:
            c = todo[name]
            rows = c.ref.shape[-2]
            blocks = [
                np.frombuffer(quantize(m, c.dtype), np.uint8).reshape(rows, -1)
                for m in _matrices(c.ref, reader)
            ]
            data = blocks[0] if len(c.ref.shape) == 2 else np.stack(blocks)
            writer.write_tensor_data(data)
            done += _nbytes(c.ref, reader)
            if on_progress:
                on_progress(done, total)
        writer.close()
        os.replace(tmp, store)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def _parts(init: WeightRef | StackedWeight) -> tuple[WeightRef, ...]:
    return init.parts if isinstance(init, StackedWeight) else (init,)


def _nbytes(init: WeightRef | StackedWeight, reader: WeightReader) -> int:
    """Stored bytes, without reading them (each part is memory-mapped)."""
    return sum(reader.stored(p).nbytes for p in _parts(init))


def _matrices(init: WeightRef | StackedWeight, reader: WeightReader):
    """A weight's 2-D matrices, one expert at a time for a 3-D one (read lazily)."""
    if isinstance(init, StackedWeight):
        yield from (reader.value(p) for p in init.parts)
    elif len(init.shape) == 3:
        whole = reader.value(init)  # GGUF tensors are memory-mapped: a slice reads its expert
        yield from (whole[e] for e in range(init.shape[0]))
    else:
        yield reader.value(init)


def _point_at(graph: Graph, refs: dict[str, WeightRef]) -> Graph:
    """Swap initializers for quantized refs; their float views become hipc::Dequantize."""
    rw = Rewriter(graph)
    for name, ref in refs.items():
        rw.keep_initializer(name, ref)
    view: dict[str, str] = {}  # quantized initializer -> its float32 value
    for node in graph.nodes:
        ins = node.inputs
        if node.op == "Cast" and ins[0] in refs and node.attrs.get("to") == "float32":
            rw.emit("Dequantize", [ins[0]], node.outputs, node.name, domain="hipc")
            view[ins[0]] = node.outputs[0]
            continue
        for i in ins:
            # a float32 weight was read directly; it now needs a Dequantize of its own
            if i in refs and i not in view:
                view[i] = rw.emit(
                    "Dequantize", [i], [f"{i}.f32"], f"{i}.f32", domain="hipc"
                ).outputs[0]
        rw.emit(
            node.op_type,
            [view.get(i, i) for i in ins],
            node.outputs,
            node.name,
            dict(node.attrs),
            node.domain,
        )
    return rw.finish()
