"""A compiled artifact's quantized decode GEMVs re-rendered with another geometry, so that a
geometry is timed inside the decode graph without compiling the model again
(profile_gpu_decode.py --ablate --swap KIND=GEOMETRY): an 8B compile is ~50 s of weights on
the GPU machine, a handful of variant kernels a second or two of nvcc.

KIND is a launch's kernel name without its hash, as the profiles print it
(linear_q4_0_4096x4096_residual_gemv); GEOMETRY is QuantGemv's fields
"waves,rows,unroll,max_blocks,min_blocks,stages,xq_chunk[,k64][,pN][,r][,l]" (HIPC_QUANT_GEMV_TABLE's form).
The variant takes the same arguments as the kernel it replaces; its output is not checked.
"""

from __future__ import annotations

import dataclasses

from profile_gpu_decode import kind_of  # this folder (sys.path[0] when run as a script)

from hipc.compiler.codegen.environment import render
from hipc.compiler.codegen.hip import program_source
from hipc.compiler.kernels.linear import LinearParams, QuantGemv, decode_gemv, parse_geometry
from hipc.compiler.targets import GpuTarget


def parse_swap(text: str) -> tuple[str, QuantGemv]:
    """KIND=GEOMETRY -> (KIND, QuantGemv)."""
    kind, _, geometry = text.partition("=")
    g = parse_geometry(geometry)
    if not kind or g is None:
        raise SystemExit(
            f"--swap {text!r}: KIND=waves,rows,unroll,max_blocks,min_blocks,stages,xq_chunk[,k64][,pN][,r][,l]"
        )
    return kind, g


def swap_kernels(artifact, launches, kind: str, geometry: QuantGemv, arch: str):
    """(the variant kernels' program source, `launches` with KIND's pointing at them,
    {variant kernel: dynamic shared bytes})."""
    kernels = artifact.plan["kernels"]
    options = artifact.manifest["options"]
    layout = "gguf" if "cpu" in artifact.targets else "split"
    rendered, shared, out = {}, {}, []
    for launch in launches:
        if kind_of(launch.kernel) != kind:
            out.append(launch)
            continue
        base = launch.kernel.removesuffix("_gemv")
        spec = kernels.get(base)
        if spec is None or spec["kind"] != "linear":
            raise SystemExit(f"--swap {kind}: {launch.kernel} is not a linear's GEMV")
        p = LinearParams(**spec["params"])
        k = decode_gemv(f"{base}_swap", p, GpuTarget(arch), [base], geometry,
                        options["activations"], layout)  # fmt: skip
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


def swapped(eng, launches, kind: str, geometry: QuantGemv) -> list:
    """`launches` with KIND's GEMVs replaced by `geometry`'s, compiled and loaded into the
    engine's context (a second module; the first stays loaded)."""
    from hipc.compiler.toolchains.gpu import gpu_toolchain

    b = eng.backend
    arch = b.gpu.target
    source, out, shared = swap_kernels(eng.artifact, launches, kind, geometry, arch)
    d = b._driver
    d.load_module(gpu_toolchain(arch).compile(source))
    for fn, nbytes in shared.items():
        handle = d.get_function(fn)
        if nbytes > 48 * 1024:
            d.set_dynamic_shared(handle, nbytes)
        b._functions[fn] = handle
    return out
