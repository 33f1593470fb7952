"""lanes: store the CPU's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q3_K / Q4_K / Q5_K / Q6_K matrices
in row lanes.

The CPU kernels on the file's blocks spend their time rearranging bytes: a decode GEMV turns
16 blocks of a row into vpdpbusd operands with ~20 byte permutes, then sums each row's lanes.
The lanes layout (repack.lane_quant_blocks, templates/cpu/linear_lanes.h) does that
rearranging once, at compile time: a 16-row block unpacks with a nibble split, and lane r
accumulates row r. SmolLM2's 576-wide Q5_0 GEMVs read ~1.4x faster (docs/benchmarks/
bench_cpu_lanes.py), at the core's read rate. The K-quants' (linear_lanes_k.h) take a
super-block of 16 rows a unit at a time with no permutes or horizontal sums.

Only for an artifact whose one target is the CPU (one copy of the weights serves every
target, and the GPU kernels read other layouts), for the types the build machine has the
layout's kernels for (-march=native builds for the compiling machine): every type of
LANE_TYPES with AVX512-VNNI or AVX2 (linear_lanes_avx2.h; docs/benchmarks/
cpu-amd-epyc-avx2.md); and only for a weight every reader of which can take it: Linear kernels, MoE
experts (each expert's matrix in lanes of its own), and the embedding gather (a tied output
matrix is both).
"""

from __future__ import annotations

import os
from dataclasses import replace

from hipc.compiler.kernels.base import SelectedKernel
from hipc.compiler.passes.repack import LANE_TYPES

# the kinds with a lanes form: which of their weight arguments, and the parameter that says
# the argument's weight is in lanes (a MoE kernel's gate and up share one)
READERS = {
    "linear": {"w": "layout"},
    "embedding": {"w": "layout"},
    "moe": {"gate": "layout", "up": "layout", "down": "down_layout"},
}
# the kinds that multiply by a weight (an embedding alone gathers rows: no gain)
MULTIPLIERS = ("linear", "moe")
AVX512_VNNI = ({"avx512f"}, {"avx512bw"}, {"avx512vl"}, {"avx512vnni", "avx512_vnni"})
AVX2 = ({"avx2"}, {"fma"}, {"f16c"})
# HIPC_CPU_LANES=0 at compile time (benchmarks: bench_cpu_kquant_lanes.sh): every matrix keeps
# the file's blocks
LANES_ENV = "HIPC_CPU_LANES"


def _has(cpu_flags: tuple[str, ...], need: tuple[set[str], ...]) -> bool:
    return all(any(f in cpu_flags for f in alts) for alts in need)


def lane_types(targets: tuple[str, ...], cpu_flags: tuple[str, ...]) -> tuple[str, ...]:
    """The weight types the CPU may store in row lanes: none unless the CPU is the only target
    (and HIPC_CPU_LANES is not 0); every type of LANE_TYPES where the build machine has
    AVX512-VNNI (linear_lanes.h, linear_lanes_k.h) or AVX2 (linear_lanes_avx2.h)."""
    if os.environ.get(LANES_ENV, "1") == "0" or tuple(targets) != ("cpu",):
        return ()
    return LANE_TYPES if _has(cpu_flags, AVX512_VNNI) or _has(cpu_flags, AVX2) else ()


def fifth_form(cpu_flags: tuple[str, ...]) -> str:
    """How the CPU kernels built for these flags read a Q5 lanes block's fifth bits
    (repack.FIFTH_FORMS; linear_lanes.h kLaneFifthBytes decides the same from the ISA macros):
    "masks" for the AVX512-VNNI kernels, "bytes" for the AVX2 ones."""
    return "masks" if _has(cpu_flags, AVX512_VNNI) else "bytes"


def lay_out_lanes(
    kernels: list[SelectedKernel],
    dtypes: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    types: tuple[str, ...] = LANE_TYPES,
) -> list[SelectedKernel]:
    """The kernels, those reading a lanes-eligible weight switched to its lanes form: a type of
    `types` (lane_types), read only through READERS' arguments, by a Linear or MoE kernel at
    least, and (stacked experts) whole groups of 16 rows an expert, so the experts' offsets stay the
    file's. `dtypes` / `shapes`: each weight's storage type and logical shape."""
    readers: dict[str, list[tuple[SelectedKernel, str]]] = {}
    for k in kernels:
        for arg, (what, ref) in k.refs.items():
            if what == "weight":
                readers.setdefault(ref, []).append((k, arg))
    lanes = {
        w
        for w, rs in readers.items()
        if dtypes[w] in types
        and all(arg in READERS.get(k.kind.name, {}) for k, arg in rs)
        and any(k.kind.name in MULTIPLIERS for k, _ in rs)
        and (len(shapes[w]) == 2 or shapes[w][-2] % 16 == 0)
    }
    out = []
    for k in kernels:
        fields: dict[str, list[bool]] = {}
        for arg, field in READERS.get(k.kind.name, {}).items():
            fields.setdefault(field, []).append(k.refs.get(arg, ("none", None))[1] in lanes)
        switched = {f: "lanes" for f, moved in fields.items() if all(moved)}
        out.append(replace(k, params=replace(k.params, **switched)) if switched else k)
    return out


def lanes_weights(kernels: list[SelectedKernel]) -> set[str]:
    """The weights lay_out_lanes moved to row lanes."""
    return {
        k.refs[arg][1]
        for k in kernels
        for arg, field in READERS.get(k.kind.name, {}).items()
        if getattr(k.params, field, None) == "lanes" and arg in k.refs
    }
