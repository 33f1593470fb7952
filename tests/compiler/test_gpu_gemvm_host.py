"""The batch step's weights-once GEMV (templates/hip/linear_gemvm.hip.j2) run on the host: each
block's 8 warps as host threads, mma.sync's fragments emulated by the prelude (HIPC_MMA_HOST).
Against NumPy in float64 with x rounded to bf16 as the kernel does (the prefill GEMM's
rounding); outputs poisoned with NaN, rows past T checked untouched. Rows not a multiple of 8
(every n-tile count), outputs not a multiple of the block's 16 (8 for GLU), K not a multiple of
the 32-deep chunk, every epilogue, with and without the norm's _xb pass, one and two 16-row
tiles per block, x loaded with the weights' batch or a batch ahead.
"""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest

from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.linear import LinearParams, batch_gemv
from hipc.compiler.reference.executor import round_bf16
from hipc.compiler.targets import GpuTarget

from support import rel_err

EPS = 1e-5
# name: (T rows, n tiles, N weight rows, K, epilogue, norm prologue, bias)
CASES = {
    "glu_norm_bias_t5": (5, 1, 2 * 20, 200, "glu", True, True),
    "residual_t13_k136": (13, 2, 40, 136, "residual", False, True),
    "none_norm_t27": (27, 4, 24, 72, "none", True, False),
    "residual_norm_t45": (45, 8, 18, 40, "residual", True, False),
    # several batches per warp (K over 2 x 8 warps x 32): the loads a batch ahead are used
    "none_t5_k2056": (5, 1, 24, 2056, "none", False, True),
    # two 16-row tiles per block (mt), x through the _xb pass without a norm
    "glu_mt2_t11": (11, 2, 2 * 40, 104, "glu", True, True, 2),
    "residual_mt2_xb_t6": (6, 1, 50, 72, "residual", False, False, 2, True),
    # x loaded a batch ahead (xpipe): float32 rows, and bf16 rows from _xb
    "residual_xpipe_t13": (13, 2, 40, 1064, "residual", False, True, 1, None, True),
    "glu_norm_xpipe_mt2_t27": (27, 4, 2 * 24, 1000, "glu", True, False, 2, None, True),
}


def _params(case) -> LinearParams:
    _, _, N, K, epilogue, norm, bias = case[:7]
    return LinearParams(wtype="bfloat16", N=N, K=K, norm_eps=EPS if norm else 0.0,
                        epilogue=epilogue, bias=bias)  # fmt: skip


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    target = GpuTarget("sm_90")
    kernels, wrappers, specs = [], [], {}
    for i, (name, case) in enumerate(CASES.items()):
        T, nt = case[0], case[1]
        mt = case[7] if len(case) > 7 else 1
        xb_pass = case[8] if len(case) > 8 else None
        xpipe = case[9] if len(case) > 9 else False
        k = batch_gemv(f"g{i}", _params(case), target, [name], nt, mt=mt, xb=xb_pass, xpipe=xpipe)
        specs[name] = k
        kernels.append(render(f"hip/{k.template}.hip.j2", fn=k.fn, **k.ctx))
        nw = "nw" if case[5] else "nullptr"
        xb = f"  grid({T}, 1, 256, [=] {{ {k.fn}_xb(x, {nw}, xb); }});\n" if k.ctx["xb"] else ""
        src = "(const float*)xb" if k.ctx["xb"] else "x"
        wrappers.append(
            f'extern "C" void run_{k.fn}(const float* x, const void* w, const float* nw, '
            f"uint16_t* xb, const float* b, const float* res, float* y) {{\n{xb}"
            f"  grid({k.grid[0]}, 1, {k.threads}, [=] {{ {k.fn}({src}, {T}, w, nw, nullptr, b, "
            f"res, y); }});\n}}"
        )
    code = "\n".join(kernels) + "\n" + "\n".join(wrappers)
    handle = host_simt.build(tmp_path_factory.mktemp("gemvm"), "gemvm_host", code, 32,
                             "HIPC_MMA_HOST")  # fmt: skip
    handle.specs = specs
    return handle


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("name", list(CASES))
def test_batch_gemv_on_the_host(lib, name):
    T, nt, N, K, epilogue, norm, bias = CASES[name][:7]
    n_out = N // 2 if epilogue == "glu" else N
    rng = np.random.default_rng(list(CASES).index(name))
    x = (rng.standard_normal((T, K)) * 10.0 ** rng.uniform(-1, 1, (T, 1))).astype(np.float32)
    w = (0.05 * rng.standard_normal((N, K))).astype(np.float32)
    w_bits = _bf16_bits(w)
    w = round_bf16(w)
    g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    rows = 8 * nt  # the buffers hold the whole n-tile: rows past T must stay as they were
    r = rng.standard_normal((rows, n_out)).astype(np.float32)
    x64 = x.astype(np.float64)
    inv = (1 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + EPS)).astype(np.float32)
    xn = x * inv * g if norm else x
    acc = round_bf16(xn).astype(np.float64) @ w.astype(np.float64).T
    acc += b if bias else 0.0
    if epilogue == "glu":
        want = acc[:, :n_out] / (1 + np.exp(-acc[:, :n_out])) * acc[:, n_out:]
    else:
        want = acc + (r[:T] if epilogue == "residual" else 0.0)
    xs = np.full((rows, K), np.nan, np.float32)  # rows past T are NaN: the kernel must skip them
    xs[:T] = x
    y = r.copy() if epilogue == "residual" else np.full((rows, n_out), np.nan, np.float32)
    before = y[T:].copy()
    xb = np.full(rows * K, 0xFFFF, np.uint16)  # NaN in bf16
    ptr = ctypes.c_void_p
    args = [xs, w_bits, g, xb, b, r, y]
    getattr(lib, f"run_{lib.specs[name].fn}")(*(a.ctypes.data_as(ptr) for a in args))
    assert not np.isnan(y[:T]).any(), (name, "outputs left unwritten")
    np.testing.assert_array_equal(y[T:], before)  # rows past T: not written
    # float32 sums of exact bf16 products: a wrong fragment, tile edge or k chunk is O(1)
    assert rel_err(y[:T], want) <= 1e-4, (name, rel_err(y[:T], want))
