"""lanes: store the CPU's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrices in row lanes.

The CPU kernels on the file's blocks spend their time rearranging bytes: a decode GEMV turns
16 blocks of a row into vpdpbusd operands with ~20 byte permutes, then sums each row's lanes.
The lanes layout (repack.lane_quant_blocks, templates/cpu/linear_lanes.h) does that
rearranging once, at compile time: a 16-row block unpacks with a nibble split, and lane r
accumulates row r. SmolLM2's 576-wide Q5_0 GEMVs read ~1.4x faster (docs/benchmarks/
bench_cpu_lanes.py), at the core's read rate.

Only for an artifact whose one target is the CPU (one copy of the weights serves every
target, and the GPU kernels read other layouts) on a machine with AVX512-VNNI (the layout's
kernels exist there only; -march=native builds for the compiling machine), and only for a
weight every reader of which can take it: Linear kernels, and the embedding gather (a tied
output matrix is both).
"""

from __future__ import annotations

from dataclasses import replace

from hipc.compiler.kernels.base import SelectedKernel
from hipc.compiler.passes.repack import LANE_BLOCKS

# the kinds with a lanes form, and the argument that holds the weight
READERS = {"linear": "w", "embedding": "w"}
AVX512_VNNI = ({"avx512f"}, {"avx512bw"}, {"avx512vl"}, {"avx512vnni", "avx512_vnni"})


def lanes_available(targets: tuple[str, ...], cpu_flags: tuple[str, ...]) -> bool:
    """The CPU is the only target and its build machine has linear_lanes.h's instructions."""
    return tuple(targets) == ("cpu",) and all(
        any(f in cpu_flags for f in need) for need in AVX512_VNNI
    )


def lay_out_lanes(kernels: list[SelectedKernel], dtypes: dict[str, str]) -> list[SelectedKernel]:
    """The kernels, those reading a lanes-eligible weight (a type of LANE_BLOCKS, read only by
    READERS, at least one of them a Linear) switched to its lanes form. `dtypes`: each weight's
    storage type."""
    readers: dict[str, list[tuple[SelectedKernel, str]]] = {}
    for k in kernels:
        for arg, (what, ref) in k.refs.items():
            if what == "weight":
                readers.setdefault(ref, []).append((k, arg))
    lanes = {
        w
        for w, rs in readers.items()
        if dtypes[w] in LANE_BLOCKS
        and all(READERS.get(k.kind.name) == arg for k, arg in rs)
        and any(k.kind.name == "linear" for k, _ in rs)
    }
    return [
        replace(k, params=replace(k.params, layout="lanes"))
        if k.kind.name in READERS and k.refs[READERS[k.kind.name]][1] in lanes
        else k
        for k in kernels
    ]


def lanes_weights(kernels: list[SelectedKernel]) -> set[str]:
    """The weights lay_out_lanes moved to row lanes."""
    return {
        k.refs[READERS[k.kind.name]][1]
        for k in kernels
        if getattr(k.params, "layout", None) == "lanes"
    }
