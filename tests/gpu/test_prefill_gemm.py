"""The prefill GEMM kernels alone on a real GPU, against NumPy in float64.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). Each case is
rendered the way codegen/hip.py renders a linear's prefill kernel for the device's arch
(compiler/kernels/linear.py's prefill_gemm + program_source), every case's kernels go into one code object built by the
arch's toolchain, and they are launched through the backends' driver layer with
gpu_common.PackedArgs: no model, no plan. The cases cover partial tiles in T and N, K that is
and is not a multiple of the K slice (576, 1536, 4096; 48, 200, 4160), and every epilogue, for
every kernel a bf16 linear may prefill on: the sm_90a wgmma GEMM (each tile of WGMMA_TILES and
each variant of WGMMA_VARIANTS -- x or W multicast, K split 2 to 8 ways, the launch
overlapping _xb --, x through its _xb kernel and tensor maps), the mma GEMM with bf16
activations and with the hi + lo split, and, as a control, the SIMT one on the same data. The
K-split variants are also run twice on the same input: the two outputs must be equal bit for bit
(their halves are added in a fixed pairing, never by atomics).

The bar is 1e-4 relative (largest error over largest value), against a reference that rounds x
(after the norm) to bf16 the way the kernel does for the bf16 variants, and exact x for the
split and SIMT ones: a wrong fragment layout is off by O(1), and activations rounded to bf16
where the reference does not (or the reverse) by ~3e-3.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.kernels.linear import (
    WGMMA_TILES,
    WGMMA_VARIANTS,
    LinearParams,
    prefill_gemm,
    wgmma_gemm,
)
from hipc.compiler.reference.executor import round_bf16
from hipc.compiler.targets import GpuTarget
from hipc.runtime.backends.gpu_common import PackedArgs

from gpu_kernels import DeviceKernels
from support import rel_err

pytestmark = pytest.mark.gpu

# name: (T, N weight rows, K, epilogue, norm prologue, bias)
CASES = {
    "one_token": (1, 96, 64, "none", False, False),
    "residual_k576": (37, 200, 576, "residual", False, True),
    "glu_norm_k1536": (130, 2 * 344, 1536, "glu", True, False),
    "norm_bias_k4096": (300, 1000, 4096, "none", True, True),
    "glu_bias_k48": (5, 2 * 40, 48, "glu", False, True),
    "residual_norm_k4096": (257, 4096, 4096, "residual", True, False),
    "glu_norm_k200": (70, 2 * 200, 200, "glu", True, True),
    "glu_k4096_t513": (513, 2 * 1536, 4096, "glu", False, False),
    # odd T over several token blocks, K = 65 slices (a K split of 33 + 32), odd outputs
    "residual_bias_k4160_t389": (389, 333, 4160, "residual", False, True),
}
# variant -> (simt, split, wgmma tile)
VARIANTS = {
    "simt": (True, False, None),
    "mma": (False, False, None),
    "mma_split": (False, True, None),
    **{t.name: (False, False, t) for t in WGMMA_TILES + WGMMA_VARIANTS},
}
EPS = 1e-5


def _params(case) -> LinearParams:
    _, N, K, epilogue, norm, bias = case
    return LinearParams(
        wtype="bfloat16", N=N, K=K, norm_eps=EPS if norm else 0.0, epilogue=epilogue, bias=bias
    )


class Kernels(DeviceKernels):
    """Every case's kernels (matrix-instruction and SIMT; `variants`: VARIANTS' form) in one
    code object."""

    def __init__(self, cases: dict, variants: dict = VARIANTS) -> None:
        self.gemms = {}
        self.variants = variants

        def build(arch):
            target = GpuTarget(arch)
            for i, (name, case) in enumerate(cases.items()):
                p = _params(case)
                for v, (simt, split, tile) in variants.items():
                    if tile is not None and not wgmma_gemm(p, target, False, False):
                        continue
                    # sm_90's bf16 linears prefill on wgmma; its mma kernel (sm_80/89's) is the
                    # same source and runs there too, so it is tested there
                    t = GpuTarget("sm_89") if arch == "sm_90" and tile is None else target
                    g = prefill_gemm(f"case{i}_{v}", p, t, [name], simt, split, wgmma=tile)
                    self.gemms[name, v] = g
            return [(g.fn, g.template, g.ctx, g.shared) for g in self.gemms.values()]

        super().__init__(build)
        self.data: dict = {}

    @staticmethod
    def reference(case, seed: int, bf16: bool) -> tuple:
        T, N, K, epilogue, norm, bias = case
        n_out = N // 2 if epilogue == "glu" else N
        rng = np.random.default_rng(seed)
        # activations over four decades, a few outlier channels: what the hi/lo split is for
        x = rng.standard_normal((T, K)) * 10.0 ** rng.uniform(-2, 2, (T, 1))
        x[:, rng.integers(0, K, 3)] *= 30
        wbits = (
            (0.05 * rng.standard_normal((N, K))).astype(np.float32).view(np.uint32) >> 16
        ).astype(np.uint16)
        w = (wbits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        g = 1 + 0.2 * rng.standard_normal(K)
        b = rng.standard_normal(N)
        r = rng.standard_normal((T, n_out))
        x32, g32, b32, r32 = (a.astype(np.float32) for a in (x, g, b, r))

        xn = x32.astype(np.float64)
        if norm:
            inv = 1 / np.sqrt(np.mean(xn * xn, axis=1, keepdims=True) + EPS)
            xn = xn * inv * g32
            if bf16:
                xn = x32 * inv.astype(np.float32) * g32
        if bf16:
            xn = round_bf16(xn.astype(np.float32)).astype(np.float64)
        acc = xn @ w.T + (b32 if bias else 0.0)
        if epilogue == "glu":
            gate, up = acc[:, :n_out], acc[:, n_out:]
            want = gate / (1 + np.exp(-gate)) * up
        else:
            want = acc + (r32 if epilogue == "residual" else 0.0)

        return x32, wbits, g32, b32, r32, want

    def setup(self, case, seed: int, bf16: bool) -> tuple[dict, np.ndarray]:
        """Device buffers for one case, and the float64 reference (`bf16`: with the normalized
        x rounded to bf16, in float32 arithmetic as the kernels do)."""
        T, N, K, epilogue, norm, bias = case
        n_out = N // 2 if epilogue == "glu" else N
        key = (case, seed, bf16)  # the same data for every variant: the reference made once
        if key not in self.data:
            self.data[key] = self.reference(case, seed, bf16)
        x32, wbits, g32, b32, r32, want = self.data[key]
        # the residual is added in place, as the plans bind it; other outputs start as NaN
        y = self.upload(r32) if epilogue == "residual" else self.poisoned((T, n_out))
        bufs = dict(
            x=self.upload(x32),
            w=self.upload(wbits),
            g=self.upload(g32) if norm else 0,
            inv=self.upload(np.zeros(T, np.float32)) if norm else 0,
            b=self.upload(b32) if bias else 0,
            y=y,
            xb=self.upload(np.full((T, K), 0xFFFF, np.uint16)),  # bf16 NaNs until _xb writes
        )
        return bufs, want

    def launches(self, name: str, case, variant: str, bufs: dict) -> list:
        T, N, K, epilogue, norm, _ = case
        n_out = N // 2 if epilogue == "glu" else N
        g = self.gemms[name, variant]
        out = []
        res = bufs["y"] if epilogue == "residual" else 0  # in place, as the plans bind it
        if g.template == "linear_wgmma":
            args = PackedArgs([("u64", bufs["x"]), ("u64", bufs["g"]), ("u64", bufs["xb"])])
            out.append((self.function(f"{g.fn}_xb"), (T, 1, 1), (256, 1, 1), 0, args, False))
            bm, bn, cm = g.ctx["bm"], g.ctx["bn"], g.ctx["cm"]
            tile = self.variants[variant][2]
            xmap = self.d.tensor_map(bufs["xb"], K, T, 64, bm // cm)
            wmap = self.d.tensor_map(bufs["w"], K, N, 64, bn // 2)
            ptrs = [bufs["b"], res, bufs["y"]]
            args = PackedArgs(
                [("tmap", xmap), ("tmap", wmap), ("i32", T), *(("u64", p) for p in ptrs)]
            )
            grid = tile.grid(T, n_out, epilogue == "glu")
            out.append((self.function(g.fn), grid, (g.threads, 1, 1), g.shared, args, tile.pdl))
            return out
        if norm:
            args = PackedArgs([("u64", bufs["x"]), ("i32", T), ("u64", bufs["inv"])])
            out.append((self.function(f"{g.fn}_stats"), (T, 1, 1), (256, 1, 1), 0, args, False))
        ptrs = [bufs["w"], bufs["g"], bufs["inv"], bufs["b"], res, bufs["y"]]
        args = PackedArgs([("u64", bufs["x"]), ("i32", T), *(("u64", p) for p in ptrs)])
        grid = (-(-n_out // g.block_outputs), -(-T // g.block_tokens), 1)
        out.append((self.function(g.fn), grid, (g.threads, 1, 1), g.shared, args, False))
        return out

    def run(self, launches: list) -> None:
        for fn, grid, block, shared, args, pdl in launches:
            # pdl: the GEMM is launched to overlap its _xb kernel, as the plans launch it
            self.d.launch(fn, grid, block, shared, args.address, overlap=pdl)


@pytest.fixture(scope="module")
def kernels():
    k = Kernels(CASES)
    yield k
    k.close()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_gemm_matches_numpy(kernels, name, variant):
    case = CASES[name]
    g = kernels.gemms.get((name, variant))
    if g is None or (variant != "simt" and g.template == "linear_gemm"):
        pytest.skip(f"{kernels.d.arch} has no {variant} GEMM")
    bf16 = g.template == "linear_wgmma" or variant == "mma"
    bufs, want = kernels.setup(case, seed=sorted(CASES).index(name), bf16=bf16)
    try:
        kernels.run(kernels.launches(name, case, variant, bufs))
        got = kernels.read(bufs["y"], want.shape)
    finally:
        kernels.free()
    assert not np.isnan(got).any(), (name, variant, "outputs left unwritten")
    assert rel_err(got, want) <= 1e-4, (name, rel_err(got, want))


SPLIT = sorted(v for v, (_, _, t) in VARIANTS.items() if t is not None and t.sk > 1)


@pytest.mark.parametrize("variant", SPLIT)
@pytest.mark.parametrize("name", ["residual_bias_k4160_t389", "glu_norm_k1536"])
def test_split_k_is_deterministic(kernels, name, variant):
    """Two runs of a K-split GEMM on the same input give the same bits."""
    case = CASES[name]
    if (name, variant) not in kernels.gemms:
        pytest.skip(f"{kernels.d.arch} has no {variant} GEMM")
    outs = []
    for _ in range(2):
        bufs, want = kernels.setup(case, seed=7, bf16=True)
        try:
            kernels.run(kernels.launches(name, case, variant, bufs))
            outs.append(kernels.read(bufs["y"], want.shape))
        finally:
            kernels.free()
    assert rel_err(outs[0], want) <= 1e-4
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), name
