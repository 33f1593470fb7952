"""The batch step's weights-once GEMV (templates/hip/linear_gemvm.hip.j2) run on the host: each
block's 8 warps as host threads, mma.sync's fragments emulated by the prelude (HIPC_MMA_HOST).
Against NumPy in float64 with x rounded to bf16 as the kernel does (the prefill GEMM's
rounding); outputs poisoned with NaN, rows past T checked untouched. Rows not a multiple of 8
(every n-tile count), outputs not a multiple of the block's 16 (8 for GLU), K not a multiple of
the 32-deep chunk, every epilogue, with and without the norm's _xb pass, one and two 16-row
tiles per block, x loaded with the weights' batch or a batch ahead. The shared-x variant
(linear_gemvs.hip.j2, batch_gemv_split) the same way: K split across blocks (the last block
adding the partials), pieces that end inside a split, splits that end past K, several launches
in a row (the column counters reset).
"""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest

from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.linear import LinearParams, batch_gemv, batch_gemv_split
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
    # four 16-row tiles a block (each x fragment serves all four), x a batch ahead
    "residual_xpipe_mt4_t64": (64, 8, 72, 1000, "residual", False, True, 4, None, True),
}
# the shared-x variant: name: (T, n tiles, N, K, epilogue, norm, bias, batch_gemv_split geometry)
# fmt: off
SPLIT_CASES = {
    "split_residual_t13_s3": (13, 2, 40, 1064, "residual", False, True,
                              dict(warps=2, mt=1, unroll=2, splits=3, piece=4)),
    "split_glu_norm_t27_s2": (27, 4, 2 * 40, 520, "glu", True, True,
                              dict(warps=2, mt=2, unroll=2, splits=2)),
    "split_none_t64_s4": (64, 8, 70, 1000, "none", False, False,
                          dict(warps=2, mt=2, unroll=2, splits=4, piece=2)),
    "split_none_norm_t5_s1": (5, 1, 24, 200, "none", True, True,
                              dict(warps=1, mt=2, unroll=4, splits=1, piece=4)),
    "split_residual_xb_t45_s5": (45, 8, 36, 136, "residual", False, False,
                                 dict(warps=4, mt=1, unroll=1, splits=5, xb=True)),
    # x double-buffered by cp.async: float32 rows, and bf16 rows from _xb
    "split_async_residual_t29_s3": (29, 4, 40, 1064, "residual", False, True,
                                    dict(warps=2, mt=1, unroll=2, splits=3, piece=4, xasync=True)),
    "split_async_glu_norm_t64_s2": (64, 8, 2 * 20, 520, "glu", True, False,
                                    dict(warps=2, mt=2, unroll=2, splits=2, xasync=True)),
    # three buffers (one barrier a piece): pieces ending inside and past a split
    "split_async3_residual_t13_s2": (13, 2, 40, 1064, "residual", False, True,
                                     dict(warps=2, mt=1, unroll=2, splits=2, piece=2, xasync=3)),
    # (bf16 x through _xb without a norm: a norm's float32 sum rounds a few x the other way)
    "split_async3_glu_xb_t45_s1": (45, 8, 2 * 24, 456, "glu", False, True,
                                   dict(warps=2, mt=2, unroll=1, splits=1, xasync=3, xb=True)),
}
# fmt: on
ALL = {**CASES, **SPLIT_CASES}


def _params(case) -> LinearParams:
    _, _, N, K, epilogue, norm, bias = case[:7]
    return LinearParams(wtype="bfloat16", N=N, K=K, norm_eps=EPS if norm else 0.0,
                        epilogue=epilogue, bias=bias)  # fmt: skip


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    target = GpuTarget("sm_90")
    kernels, wrappers, specs = [], [], {}
    for i, (name, case) in enumerate(ALL.items()):
        T, nt = case[0], case[1]
        if name in SPLIT_CASES:
            k = batch_gemv_split(f"g{i}", _params(case), target, [name], nt, **case[7])
        else:
            mt = case[7] if len(case) > 7 else 1
            xb_pass = case[8] if len(case) > 8 else None
            xpipe = case[9] if len(case) > 9 else False
            k = batch_gemv(f"g{i}", _params(case), target, [name], nt, mt=mt, xb=xb_pass,
                           xpipe=xpipe)  # fmt: skip
        specs[name] = k
        kernels.append(render(f"hip/{k.template}.hip.j2", fn=k.fn, **k.ctx))
        nw = "nw" if case[5] else "nullptr"
        xb = f"  grid({T}, 1, 256, [=] {{ {k.fn}_xb(x, {nw}, xb); }});\n" if k.ctx["xb"] else ""
        src = "(const float*)xb" if k.ctx["xb"] else "x"
        # the split variant twice, the outputs poisoned between: its column counters must be
        # back at 0 after a launch
        n_out = case[2] // 2 if case[4] == "glu" else case[2]
        again = f"  for (int i = 0; i < {T * n_out}; ++i) y[i] = NAN;\n"
        gy = k.grid[1] if len(k.grid) > 1 else 1
        call = (f"  grid({k.grid[0]}, {gy}, {k.threads}, [=] {{ {k.fn}({src}, {T}, w, nw, "
                f"nullptr, b, res, y); }});\n")  # fmt: skip
        wrappers.append(
            f'extern "C" void run_{k.fn}(const float* x, const void* w, const float* nw, '
            f"uint16_t* xb, const float* b, const float* res, float* y) {{\n{xb}"
            + call
            + (again + call if name in SPLIT_CASES else "")
            + "}"
        )
    code = "\n".join(kernels) + "\n" + "\n".join(wrappers)
    handle = host_simt.build(tmp_path_factory.mktemp("gemvm"), "gemvm_host", code, 32,
                             "HIPC_MMA_HOST")  # fmt: skip
    handle.specs = specs
    return handle


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("name", list(ALL))
def test_batch_gemv_on_the_host(lib, name):
    T, nt, N, K, epilogue, norm, bias = ALL[name][:7]
    n_out = N // 2 if epilogue == "glu" else N
    rng = np.random.default_rng(list(ALL).index(name))
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
