"""The sm_90a GEMM's short-step tiles at Llama-3-8B's layer shapes on a real GPU, against NumPy.

Run with `pytest -m gpu` on an sm_90 GPU (skipped elsewhere: the tiles are wgmma's). Batch
steps of 33-64 rows (and 17-32 where a linear leaves the batch GEMV) run the GEMM with the
64-token tiles of WGMMA_VARIANTS and whatever WGMMA_SHORT selects: here each of them on the
four 8B shapes (qkv with the norm prologue, o and down with the residual, gate/up with norm +
SiLU*mul) at 32, 37 (a partial token tile) and 64 tokens, through test_prefill_gemm's kernels
and float64 reference (outputs NaN-poisoned first, the residual added in place). The real K
(4096, 14336) is what the K splits 2-8 ways divide; their outputs must also be the same bits
on a second run.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_prefill_gemm import Kernels

from hipc.compiler.kernels.linear import (
    WGMMA_BY_NAME,
    WGMMA_SHORT,
    WGMMA_TILES,
    WGMMA_VARIANTS,
)

from support import rel_err

pytestmark = pytest.mark.gpu

H, F = 4096, 14336
SHAPES = {  # name: (N weight rows, K, epilogue, norm prologue, bias)
    "qkv": (6144, H, "none", True, False),
    "o": (H, H, "residual", False, False),
    "gate_up": (2 * F, H, "glu", True, False),
    "down": (H, F, "residual", False, False),
}
STEPS = (32, 37, 64)
CASES = {f"{s}_t{t}": (t, *shape) for s, shape in SHAPES.items() for t in STEPS}
SHORT = {t.name for t in WGMMA_TILES + WGMMA_VARIANTS if t.bm == 64}
SHORT |= {v for by_step in WGMMA_SHORT.values() for v in by_step.values()}
VARIANTS = {v: (False, False, WGMMA_BY_NAME[v]) for v in sorted(SHORT)}


class ShortKernels(Kernels):
    """test_prefill_gemm's kernels for the short tiles; one weight matrix per shape (the
    8B's are 10^8 values), its step sizes' x the first rows of one 64-row x."""

    def reference(self, case, seed: int, bf16: bool) -> tuple:
        T, *shape = case
        key = ("full", *shape, bf16)
        if key not in self.data:
            self.data[key] = Kernels.reference((max(STEPS), *shape), seed, bf16)
        x32, wbits, g32, b32, r32, want = self.data[key]
        return x32[:T], wbits, g32, b32, r32[:T], want[:T]


@pytest.fixture(scope="module")
def kernels():
    k = ShortKernels(CASES, VARIANTS)
    if k.arch != "sm_90":
        k.close()
        pytest.skip(f"{k.arch}: the short tiles are sm_90a's")
    yield k
    k.close()


def _run(kernels, name: str, variant: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    case = CASES[name]
    bufs, want = kernels.setup(case, seed=seed, bf16=True)
    try:
        kernels.run(kernels.launches(name, case, variant, bufs))
        return kernels.read(bufs["y"], want.shape), want
    finally:
        kernels.free()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_short_tiles_match_numpy(kernels, name, variant):
    got, want = _run(kernels, name, variant, seed=sorted(SHAPES).index(name.rsplit("_t", 1)[0]))
    assert not np.isnan(got).any(), (name, variant, "outputs left unwritten")
    assert rel_err(got, want) <= 1e-4, (name, variant, rel_err(got, want))


SPLIT = sorted(v for v, (_, _, t) in VARIANTS.items() if t.sk > 1)


@pytest.mark.parametrize("variant", SPLIT)
@pytest.mark.parametrize("name", ["down_t37", "gate_up_t37"])
def test_short_split_k_is_deterministic(kernels, name, variant):
    """Two runs of a K split over 4 or 8 CTAs on the same input give the same bits."""
    seed = sorted(SHAPES).index(name.rsplit("_t", 1)[0])
    first, want = _run(kernels, name, variant, seed)
    second, _ = _run(kernels, name, variant, seed)
    assert rel_err(first, want) <= 1e-4
    assert np.array_equal(first.view(np.uint32), second.view(np.uint32)), (name, variant)
