"""The float32 prefill GEMM (templates/hip/linear_sgemm.hip.j2) run on the host: rendered as
compiler/kernels/linear.py renders it, compiled by a plain C++ compiler with HIPC_HOST_SIMT
(tests/host_simt.py: each block's threads in step as host threads, blocks one after another),
its K splits as grid z and its _sum pass after them. Against NumPy in float64 on outputs
poisoned with NaN: partial tiles in T and N, K not a multiple of the 16-deep slice nor of the
split, every epilogue (residual in place, gated residual, GLU), the norm prologue and bias.
tests/gpu/test_sgemm.py runs the same kernels on a GPU at the router's shapes.
"""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest

from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.linear import LinearParams, SgemmTile, prefill_gemm
from hipc.compiler.targets import GpuTarget

from support import rel_err

EPS = 1e-5
LDG = 3  # the gate logit is a column of a wider buffer
# name: (T, N weight rows, K, epilogue, norm, bias, gated, tile)
CASES = {
    "norm_k520_split4": (37, 65, 520, "none", True, False, False, SgemmTile(splits=4)),
    "glu_bias": (70, 2 * 40, 192, "glu", False, True, False, SgemmTile()),
    "glu_norm_split2": (5, 2 * 72, 256, "glu", True, False, False, SgemmTile(splits=2)),
    "gated_bias_split2": (9, 33, 136, "residual", False, True, True, SgemmTile(splits=2)),
    "residual_t65": (65, 70, 64, "residual", False, False, False, SgemmTile()),
    # the other tile shapes the benchmark times
    "tall_t130_split2": (130, 65, 96, "none", True, True, False, SgemmTile(128, 64, 2)),
    "narrow_glu_t33": (33, 2 * 20, 80, "glu", False, False, False, SgemmTile(64, 32)),
}


def _params(case) -> LinearParams:
    _, N, K, epilogue, norm, bias, gated, _ = case
    return LinearParams("float32", N, K, EPS if norm else 0.0, epilogue, bias, gated=gated)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    target = GpuTarget("sm_90")
    kernels, wrappers, specs = [], [], {}
    for i, (name, case) in enumerate(CASES.items()):
        p = _params(case)
        g = prefill_gemm(f"s{i}", p, target, [name], sgemm=case[-1])
        assert g.template == "linear_sgemm", (name, g.template)
        specs[name] = g
        kernels.append(render(f"hip/{g.template}.hip.j2", fn=g.fn, **g.ctx))
        T, splits = case[0], case[-1].splits
        grid = f"{-(-p.n_out // g.block_outputs)}, {-(-T // g.block_tokens)}, {splits}"
        gate = ", gate, ldg" if p.gated else ""
        part = ", part" if splits > 1 else ""
        call = f"grid3({grid}, {g.threads}, [=] {{ {g.fn}(x, {T}, w, nw, inv, b, res, y{gate}{part}); }});"
        if splits > 1:
            call += f"\n  grid({T}, 1, 256, [=] {{ {g.fn}_sum({T}, part, b, res, y{gate}); }});"
        wrappers.append(
            f'extern "C" void run_{g.fn}(const float* x, const void* w, const float* nw, '
            f"const float* inv, const float* b, const float* res, float* y, const float* gate, "
            f"int ldg, float* part) {{\n  {call}\n}}"
        )
    code = "\n".join(kernels) + "\n" + "\n".join(wrappers)
    handle = host_simt.build(tmp_path_factory.mktemp("sgemm"), "sgemm_host", code)
    handle.specs = specs
    return handle


@pytest.mark.parametrize("name", list(CASES))
def test_float32_gemm_on_the_host(lib, name):
    T, N, K, epilogue, norm, bias, gated, tile = CASES[name]
    n_out = N // 2 if epilogue == "glu" else N
    rng = np.random.default_rng(list(CASES).index(name))
    x = (rng.standard_normal((T, K)) * 10.0 ** rng.uniform(-1, 1, (T, 1))).astype(np.float32)
    w = (0.05 * rng.standard_normal((N, K))).astype(np.float32)
    g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    r = rng.standard_normal((T, n_out)).astype(np.float32)
    gl = (2 * rng.standard_normal((T, LDG))).astype(np.float32)
    x64 = x.astype(np.float64)
    inv = (1 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + EPS)).astype(np.float32)
    xn = x64 * inv * g if norm else x64
    acc = xn @ w.astype(np.float64).T + (b if bias else 0.0)
    if epilogue == "glu":
        want = acc[:, :n_out] / (1 + np.exp(-acc[:, :n_out])) * acc[:, n_out:]
    elif gated:
        want = r + acc / (1 + np.exp(-gl[:, LDG - 1 : LDG].astype(np.float64)))
    else:
        want = acc + (r if epilogue == "residual" else 0.0)
    # the residual is added in place, as the plans bind it; other outputs start as NaN, and so
    # do the partial sums
    y = r.copy() if epilogue == "residual" else np.full((T, n_out), np.nan, np.float32)
    part = np.full((tile.splits, T, N), np.nan, np.float32)
    ptr = ctypes.c_void_p
    args = [x, w, g, inv[:, 0].copy(), b, r, y]
    getattr(lib, f"run_{lib.specs[name].fn}")(
        *(a.ctypes.data_as(ptr) for a in args),
        gl[:, LDG - 1 :].ctypes.data_as(ptr),
        ctypes.c_int(LDG),
        part.ctypes.data_as(ptr),
    )
    assert not np.isnan(y).any(), (name, "outputs left unwritten")
    # float32 sums: a wrong tile edge, split bound or epilogue is O(1)
    assert rel_err(y, want) <= 1e-5, (name, rel_err(y, want))
