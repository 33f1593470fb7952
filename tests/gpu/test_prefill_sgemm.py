"""The float32 prefill GEMM (templates/hip/linear_sgemm.hip.j2) on a real GPU, against NumPy
in float64.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). Each case is
rendered as compiler/kernels/linear.py renders a float32 linear's prefill kernel (prefill_gemm:
the tile and K split select_sgemm picks for 512-token steps, and the same tile unsplit), built
into one code object and launched as the plans launch it: the _stats kernel where there is a
norm, the GEMM over (outputs, tokens, K splits), then the _sum pass where K is split. The cases
are the MoE routers' shapes (Qwen3.5-35B-A3B's 256 experts + the shared expert's gate over
2048 inputs with the norm prologue, Qwen3-30B-A3B's 128 + 1, K 4096) and odd ones: 1, 37, 513
tokens, 1 and 65 outputs, K not a multiple of the 16-deep slice, the residual (in place), gated
residual and GLU epilogues with bias. Outputs start as NaN.

The bar is 1e-5 relative (largest error over largest value): float32 sums of float32
products (the split sums are float32 too), where W rounded to bf16 would be ~3e-3 off.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.kernels.linear import LinearParams, SgemmTile, prefill_gemm

from gpu_kernels import DeviceKernels
from support import rel_err

pytestmark = pytest.mark.gpu

EPS = 1e-6
LDG = 3  # the gate logit is a column of a wider buffer
# name: (T, N weight rows, K, epilogue, norm prologue, bias, gated)
CASES = {
    "router_257x2048_t512": (512, 257, 2048, "none", True, False, False),
    "router_129x2048_t512": (512, 129, 2048, "none", True, False, False),
    "router_257x4096_t513": (513, 257, 4096, "none", True, False, False),
    "one_token_n1": (1, 1, 2048, "none", True, False, False),
    "residual_bias_n65_t37_k4096": (37, 65, 4096, "residual", False, True, False),
    "glu_norm_bias_t513": (513, 2 * 65, 2048, "glu", True, True, False),
    "gated_bias_t37": (37, 33, 2048, "residual", False, True, True),
    "residual_k1028_t100": (100, 70, 1028, "residual", False, False, False),
}
VARIANTS = ("selected", "unsplit")


def _params(case) -> LinearParams:
    _, N, K, epilogue, norm, bias, gated = case
    return LinearParams("float32", N, K, EPS if norm else 0.0, epilogue, bias, gated=gated)


def gemms(arch: str) -> dict:
    """(case, variant) -> the rendered kernel (also what the GPU request script prebuilds)."""
    from hipc.compiler.targets import GpuTarget

    out = {}
    for i, (name, case) in enumerate(CASES.items()):
        p = _params(case)
        g = prefill_gemm(f"sg{i}", p, GpuTarget(arch), [name])
        assert g.template == "linear_sgemm", (name, g.template)
        out[name, "selected"] = g
        tile = SgemmTile(g.ctx["bm"], g.ctx["bn"], 1)
        out[name, "unsplit"] = prefill_gemm(f"sg{i}", p, GpuTarget(arch), [name], sgemm=tile)
    return out


def specs(arch: str) -> list:
    return [(g.fn, g.template, g.ctx, None) for g in gemms(arch).values()]


class Kernels(DeviceKernels):
    def __init__(self) -> None:
        self.gemms = {}

        def build(arch):
            self.gemms = gemms(arch)
            return [(g.fn, g.template, g.ctx, None) for g in self.gemms.values()]

        super().__init__(build)

    def run(self, name: str, variant: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """One run on fresh data: (the output, the float64 reference)."""
        T, N, K, epilogue, norm, bias, gated = case = CASES[name]
        p, g = _params(case), self.gemms[name, variant]
        n_out, splits = p.n_out, g.ctx["splits"]
        rng = np.random.default_rng(seed)
        # activations over four decades and a few outlier channels; router-like weights
        x = rng.standard_normal((T, K)) * 10.0 ** rng.uniform(-2, 2, (T, 1))
        x[:, rng.integers(0, K, 3)] *= 30
        x = x.astype(np.float32)
        w = (0.05 * rng.standard_normal((N, K))).astype(np.float32)
        gw = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
        b = rng.standard_normal(N).astype(np.float32)
        r = rng.standard_normal((T, n_out)).astype(np.float32)
        gl = (2 * rng.standard_normal((T, LDG))).astype(np.float32)

        x64 = x.astype(np.float64)
        xn = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + EPS) * gw if norm else x64
        acc = xn @ w.astype(np.float64).T + (b if bias else 0.0)
        if epilogue == "glu":
            want = acc[:, :n_out] / (1 + np.exp(-acc[:, :n_out])) * acc[:, n_out:]
        elif gated:
            want = r + acc / (1 + np.exp(-gl[:, LDG - 1 : LDG].astype(np.float64)))
        else:
            want = acc + (r if epilogue == "residual" else 0.0)

        try:
            # the residual is added in place, as the plans bind it; other outputs start as
            # NaN, and so do the partial sums and 1 / rms
            y = self.upload(r) if epilogue == "residual" else self.poisoned((T, n_out))
            xs, inv = self.upload(x), self.poisoned((T,))
            part = self.poisoned((splits, T, N)) if splits > 1 else 0
            gate = self.upload(gl) + 4 * (LDG - 1) if gated else 0
            if norm:
                self.launch(f"{g.fn}_stats", [T], 256, [("u64", xs), ("i32", T), ("u64", inv)])
            ptrs = [self.upload(w), self.upload(gw) if norm else 0, inv if norm else 0]
            ptrs += [self.upload(b) if bias else 0, y if epilogue == "residual" else 0, y]
            args = [("u64", xs), ("i32", T), *(("u64", q) for q in ptrs)]
            tail = [("u64", gate), ("i32", LDG)] if gated else []
            grid = [-(-n_out // g.block_outputs), -(-T // g.block_tokens), splits]
            self.launch(g.fn, grid, g.threads, args + tail + ([("u64", part)] if part else []))
            if splits > 1:
                sargs = [("i32", T), ("u64", part), *(("u64", q) for q in ptrs[3:])]
                self.launch(f"{g.fn}_sum", [T], 256, sargs + tail)
            got = self.read(y, (T, n_out))
        finally:
            self.free()
        return got, want


@pytest.fixture(scope="module")
def kernels():
    k = Kernels()
    yield k
    k.close()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(CASES))
def test_float32_gemm_matches_numpy(kernels, name, variant):
    got, want = kernels.run(name, variant, seed=list(CASES).index(name))
    assert not np.isnan(got).any(), (name, variant, "outputs left unwritten")
    err = rel_err(got, want)
    print(f"{name} {variant} {kernels.gemms[name, variant].fn}: rel err {err:.2e}")
    assert err <= 1e-5, (name, variant, err)


@pytest.mark.parametrize("name", ["router_257x2048_t512", "glu_norm_bias_t513"])
def test_k_split_is_deterministic(kernels, name):
    """Two runs of the K-split GEMM on the same input give the same bits (the parts are
    added in split order by the _sum pass, never by atomics)."""
    assert kernels.gemms[name, "selected"].ctx["splits"] > 1, "these shapes split K"
    a, want = kernels.run(name, "selected", seed=7)
    b, _ = kernels.run(name, "selected", seed=7)
    assert rel_err(a, want) <= 1e-5
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), name
