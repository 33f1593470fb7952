"""prefetch: a quantized decode GEMV pulls the next GEMV's first weights towards L2.

On NVIDIA sm_90+ the decode kernels overlap (programmatic launch): a GEMV's blocks are
resident before the kernel ahead of it has finished, and issue their first loads then. Some
kernels leave the memory idle while they run (the decode attention at short contexts is a
chain of round trips), so a GEMV resident during one may also pull the weights the GEMV after
it reads first (its quants, in the order it reads them: for a gate/up pair the heads of both
halves) into L2 before its own wait; that GEMV's first loads then hit L2.

Which GEMVs do, and how many MiB, is NEXT_PREFETCH's by the prefetching GEMV's matrix class
(linear.gemv_class); `HIPC_GEMV_PREFETCH` (compile time, benchmarks) replaces entries:
"FAMILY:CLASS=MIB;...". The prefetching kernel takes the next one's weight as its `pf`
argument, so nothing depends on where the runtime places the weights.

CPU-only artifacts never get it (the row-lanes pass, passes/lanes.py, assumes a weight's
readers are its multipliers; this pass adds a reader).
"""

from __future__ import annotations

import os
from dataclasses import replace
from itertools import pairwise

from hipc.base.errors import HipcError
from hipc.compiler.codegen.environment import WEIGHT_SUFFIX
from hipc.compiler.kernels.base import SelectedKernel
from hipc.compiler.kernels.linear import QUANT_TYPES, LinearParams, gemv_class

# (family, class) of the prefetching GEMV -> MiB of the next GEMV's quants. Empty until
# measured on the H200 (profile_gpu_decode.py --ablate --swap KIND=GEOMETRY@MB).
NEXT_PREFETCH: dict[tuple[str, str], float] = {}
ENV = "HIPC_GEMV_PREFETCH"


def prefetch_table() -> dict[tuple[str, str], float]:
    table = dict(NEXT_PREFETCH)
    for item in filter(None, os.environ.get(ENV, "").split(";")):
        key, _, mib = item.partition("=")
        family, _, cls = key.strip().partition(":")
        try:
            table[family, cls] = float(mib)
        except ValueError:
            raise HipcError(f"{ENV}: bad entry {item!r} (FAMILY:CLASS=MIB)") from None
    return table


def next_spans(p: LinearParams, mib: float, quant_layout: str = "split") -> tuple[int, ...]:
    """The first `mib` MiB of the rows a GEMV of `p` reads, as (offset, bytes) pairs, flat:
    in the split layout its quants region (the scales follow all rows' quants), in the
    file's blocks whole rows; a GLU pairs gate row j with up row N/2 + j: both halves'
    heads."""
    qt = QUANT_TYPES[WEIGHT_SUFFIX[p.wtype]]
    per_block = qt.quant_bytes if quant_layout == "split" else qt.block_bytes
    rows = p.N * (p.K // qt.block_values) * per_block
    n = int(mib * (1 << 20)) // 256 * 256
    if p.epilogue != "glu":
        return (0, min(n, rows))
    half = rows // 2
    return (0, min(n // 2, half), half, min(n // 2, half))


def _quantized(k: SelectedKernel) -> bool:
    return k.kind.name == "linear" and WEIGHT_SUFFIX.get(k.params.wtype) in QUANT_TYPES


def link_prefetches(
    kernels: list[SelectedKernel],
    table: dict[tuple[str, str], float],
    quant_layout: str = "split",
) -> list[SelectedKernel]:
    """The kernels, each quantized Linear whose class has a budget in `table` given the next
    quantized Linear's weight (in launch order) to prefetch: params.next_pf, refs["pf"]."""
    out = list(kernels)
    if not table:
        return out
    linears = [i for i, k in enumerate(out) if _quantized(k)]
    for i, j in pairwise(linears):
        p: LinearParams = out[i].params
        mib = table.get(gemv_class(WEIGHT_SUFFIX[p.wtype], p.N, p.K, p.epilogue == "glu"), 0)
        if mib <= 0 or p.layout != "gguf":
            continue
        nxt = out[j]
        out[i] = replace(
            out[i],
            params=replace(p, next_pf=next_spans(nxt.params, mib, quant_layout)),
            refs={**out[i].refs, "pf": nxt.refs["w"]},
        )
    return out


def prefetch_available(targets: tuple[str, ...]) -> bool:
    """A GPU target whose decode kernels overlap (NVIDIA sm_90+)."""
    from hipc.compiler.targets import GpuTarget

    return any(t.startswith("sm_") and GpuTarget(t).sm >= 90 for t in targets)
