"""A compiled artifact's quantized decode GEMVs re-rendered with another geometry, so that a
geometry is timed inside the decode graph without compiling the model again
(profile_gpu_decode.py --ablate --swap KIND=GEOMETRY): an 8B compile is ~50 s of weights on
the GPU machine, a handful of variant kernels a second or two of nvcc.

KIND is a launch's kernel name without its hash, as the profiles print it
(linear_q4_0_4096x4096_residual_gemv); GEOMETRY is QuantGemv's fields
"waves,rows,unroll,max_blocks,min_blocks,stages,xq_chunk[,k64][,pN][,r][,l]" (HIPC_QUANT_GEMV_TABLE's form).
The variant takes the same arguments as the kernel it replaces; its output is not checked.

KIND=GEOMETRY@MB: the variant also pulls the first MB MiB of the next quantized GEMV's weights
(the next launch after it that reads a weight through a linear's GEMV) towards L2 before its
wait, in the order that GEMV reads them (a GLU: the heads of its gate and up halves), its
quants' region only (the split layout's: a GPU-only artifact). The spans are offsets from the variant's own W (the artifact's weights are
one block on the device, in the order the kernels first use them): one variant per distance.
"""

from __future__ import annotations

import dataclasses

from profile_gpu_decode import kind_of  # this folder (sys.path[0] when run as a script)

from hipc.compiler.codegen.environment import render
from hipc.compiler.codegen.hip import program_source
from hipc.compiler.kernels.linear import (
    QUANT_TYPES,
    WEIGHT_SUFFIX,
    LinearParams,
    QuantGemv,
    decode_gemv,
    parse_geometry,
)
from hipc.compiler.targets import GpuTarget


def parse_swap(text: str) -> tuple[str, QuantGemv, float]:
    """KIND=GEOMETRY[@MB] -> (KIND, QuantGemv, MiB of the next GEMV's weights to prefetch)."""
    kind, _, geometry = text.partition("=")
    geometry, _, mb = geometry.partition("@")
    g = parse_geometry(geometry)
    try:
        next_mb = float(mb or 0)
    except ValueError:
        next_mb = -1
    if not kind or g is None or next_mb < 0:
        raise SystemExit(
            f"--swap {text!r}: KIND=waves,rows,unroll,max_blocks,min_blocks,stages,xq_chunk"
            "[,k64][,pN][,r][,l][@MB]"
        )
    return kind, g, next_mb


def _weight_arg(launch) -> int | None:
    """The index of the weight a GEMV launch reads as W (its first weight argument)."""
    return next((a["index"] for a in launch.args if a["kind"] == "weight"), None)


def next_spans(artifact, bases, launches, i: int, mb: float) -> tuple[tuple[int, int], ...]:
    """(offset from launch i's W, bytes) spans of the first `mb` MiB the next linear GEMV
    after launch i reads: its quants' region, the heads of both halves for a GLU."""
    if mb <= 0:
        return ()
    kernels = artifact.plan["kernels"]
    for nxt in launches[i + 1 :]:
        spec = kernels.get(nxt.kernel.removesuffix("_gemv"))
        if nxt.kernel.endswith("_gemv") and spec is not None and spec["kind"] == "linear":
            break
    else:
        raise SystemExit(f"--swap ...@{mb}: no linear GEMV after {launches[i].kernel}")
    p = LinearParams(**spec["params"])
    qt = QUANT_TYPES[WEIGHT_SUFFIX[p.wtype]]
    start = bases.weights[_weight_arg(nxt)] - bases.weights[_weight_arg(launches[i])]
    nbytes = int(mb * (1 << 20)) // 256 * 256
    quants = p.N * (p.K // qt.block_values) * qt.quant_bytes  # never past the region
    if p.epilogue != "glu":
        return ((start, min(nbytes, quants)),)
    half = quants // 2
    return ((start, min(nbytes // 2, half)), (start + half, min(nbytes // 2, half)))


def swap_kernels(artifact, launches, kind: str, geometry: QuantGemv, arch: str, bases=None,
                 next_mb: float = 0):  # fmt: skip
    """(the variant kernels' program source, `launches` with KIND's pointing at them,
    {variant kernel: dynamic shared bytes}); `next_mb`: each variant also prefetches that much
    of the next GEMV's weights (next_spans; `bases` are the engine's)."""
    kernels = artifact.plan["kernels"]
    options = artifact.manifest["options"]
    layout = "gguf" if "cpu" in artifact.targets else "split"
    rendered, shared, out, spans = {}, {}, [], {}
    for i, launch in enumerate(launches):
        if kind_of(launch.kernel) != kind:
            out.append(launch)
            continue
        base = launch.kernel.removesuffix("_gemv")
        spec = kernels.get(base)
        if spec is None or spec["kind"] != "linear":
            raise SystemExit(f"--swap {kind}: {launch.kernel} is not a linear's GEMV")
        p = LinearParams(**spec["params"])
        # a variant per distance to the next GEMV (a model's last layer has the LM head next)
        span = next_spans(artifact, bases, launches, i, next_mb)
        v = spans.setdefault(span, len(spans))
        k = decode_gemv(f"{base}_swap{v}", p, GpuTarget(arch), [base], geometry,
                        options["activations"], layout, span)  # fmt: skip
        if k.fn not in rendered:
            rendered[k.fn] = render(f"hip/{k.template}.hip.j2", fn=k.fn, **k.ctx)
            shared[k.fn] = k.shared
        grid = (*k.grid, *(1,) * (3 - len(k.grid)))
        out.append(dataclasses.replace(launch, kernel=k.fn, grid=grid, block=(k.threads, 1, 1),
                                       shared=k.shared))  # fmt: skip
    if not rendered:
        raise SystemExit(f"--swap {kind}: no decode launch of that kind")
    source = program_source("swap", "0", arch, list(rendered.values()), layout)
    return source, out, shared


def swapped(eng, launches, kind: str, geometry: QuantGemv, next_mb: float = 0) -> list:
    """`launches` with KIND's GEMVs replaced by `geometry`'s (and `next_mb` MiB of the next
    GEMV's weights prefetched), compiled and loaded into the engine's context (a second
    module; the first stays loaded)."""
    from hipc.compiler.toolchains.gpu import gpu_toolchain

    b = eng.backend
    arch = b.gpu.target
    source, out, shared = swap_kernels(
        eng.artifact, launches, kind, geometry, arch, b.bases, next_mb
    )
    d = b._driver
    d.load_module(gpu_toolchain(arch).compile(source))
    for fn, nbytes in shared.items():
        handle = d.get_function(fn)
        if nbytes > 48 * 1024:
            d.set_dynamic_shared(handle, nbytes)
        b._functions[fn] = handle
    return out
