"""Quantized weights' long prefill steps on sm_90a: the dequantize pass (linear_dequant) and
the bf16 wgmma GEMM over its output, as a plan launches them (_dq, _xb, the GEMM), on a real
GPU against NumPy in float64.

Run with `pytest -m gpu` on an sm_90 GPU (skipped elsewhere). Every quantized type the GPU
reads: its blocks made by tests/gpu_kernels.pack (the K-quants as random bytes), the expected
weights by gguf-py's dequantize of the same blocks in GGUF's order, rounded to bf16 as the pass
rounds them; x rounded to bf16 (after the norm) as the _xb kernel does. The pass's output and
the GEMM's start as NaN. Bars: the pass within one bf16 step of gguf-py (equal to its bf16
rounding for 99.9% of the weights), the GEMM 1e-4 relative as tests/gpu/test_prefill_gemm.py's.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from hipc.compiler.kernels.linear import (
    QUANT_TYPES,
    LinearParams,
    dequant_kernel,
    prefill_gemm,
    select_wgmma,
)
from hipc.compiler.targets import GpuTarget
from hipc.runtime.backends.gpu_common import PackedArgs

from gpu_kernels import DeviceKernels, bf16_round, pack
from support import rel_err

pytestmark = pytest.mark.gpu
EPS = 1e-5
# wtype: (T, N weight rows, K, epilogue, norm prologue, bias)
CASES = {
    "q4_0": (300, 2 * 344, 1536, "glu", True, False),
    "q4_1": (130, 200, 512, "residual", False, True),
    "q8_0": (257, 1000, 4096, "none", True, True),
    "q5_0": (128, 96, 768, "none", False, False),
    "q5_1": (389, 333, 1024, "residual", True, False),
    "q4_k": (300, 2 * 256, 2048, "glu", True, False),
    "q5_k": (200, 128, 512, "none", False, True),
    "q6_k": (513, 4096, 4096, "residual", False, False),
    "iq4_nl": (200, 2 * 160, 1024, "glu", True, True),
    "iq4_xs": (257, 300, 2048, "residual", False, False),
    "q3_k": (300, 2 * 200, 1024, "glu", True, False),
    "q2_k": (257, 300, 2048, "residual", False, False),
}
assert set(CASES) == set(QUANT_TYPES)


def _params(wtype: str) -> LinearParams:
    _, N, K, epilogue, norm, bias = CASES[wtype]
    return LinearParams(
        wtype=wtype, N=N, K=K, norm_eps=EPS if norm else 0.0, epilogue=epilogue, bias=bias
    )


class Kernels(DeviceKernels):
    def __init__(self) -> None:
        self.specs = {}

        def build(arch):
            if arch != "sm_90":
                pytest.skip(f"{arch}: the dequantize + wgmma prefill is sm_90a's")
            target = GpuTarget(arch)
            for wtype, case in CASES.items():
                p = _params(wtype)
                tile = select_wgmma(p, case[0])
                gemm = prefill_gemm(f"q_{wtype}", p, target, [wtype], wgmma=tile)
                self.specs[wtype] = (dequant_kernel(f"q_{wtype}", p), gemm, tile)
            return [(k.fn, k.template, k.ctx, k.shared) for s in self.specs.values() for k in s[:2]]

        super().__init__(build)


@pytest.fixture(scope="module")
def kernels():
    k = Kernels()
    yield k
    k.close()


@pytest.mark.parametrize("wtype", sorted(CASES))
def test_dequantized_prefill_matches_numpy(kernels, wtype):
    T, N, K, epilogue, norm, bias = CASES[wtype]
    n_out = N // 2 if epilogue == "glu" else N
    dq, gemm, tile = kernels.specs[wtype]
    rng = np.random.default_rng(sorted(CASES).index(wtype))
    w = 0.05 * rng.standard_normal((N, K)) * 10.0 ** rng.uniform(-2, 1, (N, 1))
    stored, _ = pack(w, wtype)
    raw, _ = pack(w, wtype, "gguf")
    qt = getattr(gguf.GGMLQuantizationType, wtype.upper())
    want_w = gguf.quants.dequantize(raw, qt).reshape(N, K).astype(np.float64)
    x = (rng.standard_normal((T, K)) * 10.0 ** rng.uniform(-1, 1, (T, 1))).astype(np.float32)
    g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    r = rng.standard_normal((T, n_out)).astype(np.float32)

    xn = x
    if norm:
        inv = 1 / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + EPS)
        xn = x * inv.astype(np.float32) * g

    try:
        W = kernels.upload(stored)
        wb = kernels.upload(np.full((N, K), 0xFFFF, np.uint16))  # bf16 NaNs until _dq writes
        xb = kernels.upload(np.full((T, K), 0xFFFF, np.uint16))
        y = kernels.upload(r) if epilogue == "residual" else kernels.poisoned((T, n_out))
        xd, gd = kernels.upload(x), kernels.upload(g) if norm else 0
        bd = kernels.upload(b) if bias else 0
        kernels.launch(dq.fn, dq.grid, dq.threads, [("u64", W), ("u64", wb)])
        kernels.launch(f"{gemm.fn}_xb", [T], 256, [("u64", xd), ("u64", gd), ("u64", xb)])
        got_w = kernels.read(wb, (N, K), np.uint16)
        xmap = kernels.d.tensor_map(xb, K, T, 64, tile.bm // tile.cm)
        wmap = kernels.d.tensor_map(wb, K, N, 64, tile.bn // 2)
        res = y if epilogue == "residual" else 0
        args = PackedArgs(
            [("tmap", xmap), ("tmap", wmap), ("i32", T), ("u64", bd), ("u64", res), ("u64", y)]
        )
        grid = tile.grid(T, n_out, epilogue == "glu")
        kernels.d.launch(kernels.function(gemm.fn), grid, (gemm.threads, 1, 1), gemm.shared,
                         args.address, overlap=tile.pdl)  # fmt: skip
        got = kernels.read(y, (T, n_out))
        got_x = kernels.read(xb, (T, K), np.uint16)
    finally:
        kernels.free()
    got_w = (got_w.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    # x as the GEMM took it: NumPy's rounding but where the norm's 1 / rms differs by an ulp
    # (a summation order) and a value sits at a rounding edge; the output bound then covers
    # the GEMM alone (Q3_K's random blocks, sums of large weights that cancel, showed 1.5e-4
    # against NumPy's own rounding of x)
    got_x = (got_x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    want_x = bf16_round(xn)
    assert np.all(np.abs(got_x - want_x) <= np.abs(want_x) * 2.0**-7), wtype
    assert np.mean(got_x == want_x) >= 0.999, wtype
    assert not np.isnan(got_w).any(), (wtype, "weights left unwritten")
    assert np.all(np.abs(got_w - want_w) <= np.abs(want_w) * 2.0**-8), wtype
    assert np.mean(got_w == bf16_round(want_w)) >= 0.999, wtype
    acc = got_x @ bf16_round(want_w).T + (b if bias else 0.0)
    if epilogue == "glu":
        want = acc[:, :n_out] / (1 + np.exp(-acc[:, :n_out])) * acc[:, n_out:]
    else:
        want = acc + (r if epilogue == "residual" else 0.0)
    assert not np.isnan(got).any(), (wtype, "outputs left unwritten")
    assert rel_err(got, want) <= 1e-4, (wtype, rel_err(got, want))
