"""The batch step's own kernels alone on a real GPU, against NumPy in float64.

Run with `pytest -m gpu` on the GPU machine (skipped where no NVIDIA GPU is found). The
weights-once GEMV (templates/hip/linear_gemvm.hip.j2, compiler/kernels/linear.py batch_gemv)
for each size class of rows (n tiles 1, 2, 4, 8), rows not a multiple of 8, outputs not a
multiple of the block's rows, K not a multiple of the 32-deep chunk, every epilogue, with and
without the norm's _xb pass; launched with the overlap flag as the batch plans launch it.
Outputs are poisoned with NaN; rows past T must keep what they held. The bar is 1e-4 relative
against a reference that rounds x (after the norm) to bf16 as the kernel does: a wrong fragment
is off by O(1), x rounded differently by ~3e-3.

The row top-k (templates/hip/topk.hip.j2) at the Llama-3 vocabulary, 64 rows (with ties at
the top, values on a coarse grid, masked rows), k 1, 40 and 64, against an argsort by value
then id; its row max and sum of exp against NumPy; and the several-block kernels (k = 1:
greedy, k 2-64: split; the last of a row's blocks merging them) on the same rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.base.launch_plan import TOPK_MAX
from hipc.compiler.codegen.hip import GREEDY_BLOCK, TOPK_BLOCK, TOPK_KERNEL, greedy_geometry
from hipc.compiler.kernels.linear import (
    GEMVM_DEFAULT,
    GEMVM_MEASURED,
    LinearParams,
    batch_gemv,
    batch_gemv_split,
    gemvm_eligible,
    gemvm_kernel,
)
from hipc.compiler.reference.executor import round_bf16
from hipc.compiler.targets import GpuTarget
from hipc.runtime.backends.gpu_common import PackedArgs

from gpu_kernels import DeviceKernels, pack
from support import assert_drawn, rel_err

pytestmark = pytest.mark.gpu
EPS = 1e-5
VOCAB = 128256  # the row top-k cases: Llama-3's vocabulary
# name: (T rows, n tiles, N weight rows, K, epilogue, norm prologue, bias)
CASES = {
    "glu_norm_t3_k4096": (3, 1, 2 * 1000, 4096, "glu", True, False),
    "residual_t8_k14336": (8, 1, 4096, 14336, "residual", False, False),
    "none_norm_bias_t13_k1000": (13, 2, 1030, 1000, "none", True, True),
    "glu_bias_t27_k200": (27, 4, 2 * 333, 200, "glu", False, True),
    "residual_norm_t45_k4104": (45, 8, 517, 4104, "residual", True, True),
    "none_t64_k4096": (64, 8, 6144, 4096, "none", False, False),
}
# the shared-x variant (linear_gemvs, batch_gemv_split) at 8B-like shapes and odd edges:
# (T, n tiles, N, K, epilogue, norm, bias, geometry); each launched twice (its column counters)
# fmt: off
SPLIT_CASES = {
    "split_residual_t64_k4096_s8": (64, 8, 4096, 4096, "residual", False, False,
                                    dict(warps=4, mt=2, unroll=4, splits=8)),
    "split_residual_t29_k14336_s8": (29, 4, 4096, 14336, "residual", False, True,
                                     dict(warps=8, mt=1, unroll=4, splits=8)),
    "split_glu_norm_t16_k4096_s2": (16, 2, 2 * 1000, 4096, "glu", True, False,
                                    dict(warps=4, mt=2, unroll=4, splits=2)),
    "split_none_norm_t8_k4104_s6": (8, 1, 6150, 4104, "none", True, True,
                                    dict(warps=4, mt=2, unroll=8, splits=6)),
    "split_none_t45_k200_s3": (45, 8, 517, 200, "none", False, False,
                               dict(warps=2, mt=2, unroll=2, splits=3)),
    # x double-buffered by cp.async: float32 rows, and bf16 rows from _xb
    "split_async_residual_t64_k14336_s8": (64, 8, 4096, 14336, "residual", False, True,
                                           dict(warps=4, mt=2, unroll=2, splits=8, piece=2,
                                                xasync=True)),
    "split_async_glu_norm_t32_k4096_s2": (32, 4, 2 * 1000, 4096, "glu", True, False,
                                          dict(warps=4, mt=2, unroll=4, splits=2, xasync=True)),
    "split_async3_residual_t64_k14336_s4": (64, 8, 4096, 14336, "residual", False, False,
                                            dict(warps=4, mt=2, unroll=1, splits=4, xasync=3)),
    "split_async3_glu_xb_t30_k4096_s1": (30, 4, 2 * 1000, 4096, "glu", False, True,
                                         dict(warps=8, mt=1, unroll=2, splits=1, xasync=3, xb=True)),
}
# fmt: on
# the geometries the compiler picks (GEMVM_DEFAULT, GEMVM_MEASURED's gate/up) through
# gemvm_kernel, at 8B-like shapes; o's kind with x in bf16 as the attention hands it over
GLU = (28672, 4096, "glu")
# fmt: off
DEFAULT_CASES = {
    "default_residual_t8_k14336": (8, 1, 4096, 14336, "residual", False, False, GEMVM_DEFAULT[1]),
    "default_residual_t13_k4096": (13, 2, 4096, 4096, "residual", False, True, GEMVM_DEFAULT[2]),
    "default_residual_xb_t20_k4096": (20, 4, 4096, 4096, "residual", False, False,
                                      {**GEMVM_DEFAULT[4], "xb": True}),
    "default_none_norm_t29_k1000": (29, 4, 1030, 1000, "none", True, True, GEMVM_DEFAULT[4]),
    # (bf16 x from an _xb pass without the norm: a norm's float32 sum may round a few x the
    # other way than the reference's, ~1e-4 off where a wrong fragment is O(1))
    "default_glu_xb_t16_k4096": (16, 2, 2 * 1000, 4096, "glu", False, False,
                                 {**GEMVM_MEASURED[GLU][2], "xb": True}),
    "default_glu_xb_t27_k4096": (27, 4, 2 * 1000, 4096, "glu", False, True,
                                 {**GEMVM_MEASURED[GLU][4], "xb": True}),
}
# fmt: on
ALL = {**CASES, **SPLIT_CASES, **DEFAULT_CASES}


def _params(case) -> LinearParams:
    _, _, N, K, epilogue, norm, bias = case[:7]
    return LinearParams(wtype="bfloat16", N=N, K=K, norm_eps=EPS if norm else 0.0,
                        epilogue=epilogue, bias=bias)  # fmt: skip


def kernel_specs(arch: str, specs: dict) -> list:
    """The module's kernels for `arch` (also what docs/benchmarks/*_check.sh prebuild), the
    batch GEMVs by case name into `specs`."""
    target = GpuTarget(arch)
    per_thread = greedy_geometry(VOCAB)[1]
    topk = {"max_k": TOPK_MAX, "wave": target.wave, "greedy_block": GREEDY_BLOCK,
            "greedy_per_thread": per_thread}  # fmt: skip
    out = [(TOPK_KERNEL, "topk", topk, 0)]
    for i, (name, case) in enumerate(ALL.items()):
        p = _params(case)
        if not gemvm_eligible(p, target):
            continue
        if name in SPLIT_CASES:
            k = batch_gemv_split(f"b{i}", p, target, [name], case[1], **case[7])
        elif name in DEFAULT_CASES:
            k = gemvm_kernel(f"b{i}", p, target, [name], case[1], case[7])
        else:
            k = batch_gemv(f"b{i}", p, target, [name], case[1])
        specs[name] = k
        out.append((k.fn, k.template, k.ctx, 0))  # with its _xb kernel, found by name
    return out


@pytest.fixture(scope="module")
def kernels():
    specs = {}

    def build(arch):
        return kernel_specs(arch, specs)

    from hipc.runtime.backends import cuda

    if cuda.probe()[0] is None:
        pytest.skip("no NVIDIA GPU")
    dk = DeviceKernels(build)
    dk.specs = specs
    yield dk
    dk.close()


@pytest.mark.parametrize("name", list(ALL))
def test_batch_gemv_matches_numpy(kernels, name):
    T, nt, N, K, epilogue, norm, bias = ALL[name][:7]
    if name not in kernels.specs:
        pytest.skip(f"{kernels.arch} has no batch GEMV")
    k = kernels.specs[name]
    n_out = N // 2 if epilogue == "glu" else N
    rows = 8 * nt
    rng = np.random.default_rng(list(CASES).index(name) if name in CASES else 7 + len(name))
    x = (rng.standard_normal((T, K)) * 10.0 ** rng.uniform(-1, 1, (T, 1))).astype(np.float32)
    w_bits, w = pack(0.05 * rng.standard_normal((N, K)), "bfloat16")
    g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    r = rng.standard_normal((rows, n_out)).astype(np.float32)
    x64 = x.astype(np.float64)
    inv = (1 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + EPS)).astype(np.float32)
    xn = x * inv * g if norm else x
    acc = round_bf16(xn).astype(np.float64) @ w.T + (b if bias else 0.0)
    if epilogue == "glu":
        want = acc[:, :n_out] / (1 + np.exp(-acc[:, :n_out])) * acc[:, n_out:]
    else:
        want = acc + (r[:T] if epilogue == "residual" else 0.0)
    xs = np.full((rows, K), np.nan, np.float32)  # rows past T: NaN, never to be read
    xs[:T] = x
    y0 = r.copy() if epilogue == "residual" else np.full((rows, n_out), np.nan, np.float32)
    try:
        px, pw, pg, pb = (kernels.upload(a) for a in (xs, w_bits, g, b))
        pr, py = kernels.upload(r), kernels.upload(y0)
        pxb = kernels.upload(np.full(rows * K, 0xFFFF, np.uint16))
        if k.ctx["xb"]:  # bf16 rows (normalized where the linear has a norm)
            kernels.launch(f"{k.fn}_xb", [T], 256, [("u64", px), ("u64", pg), ("u64", pxb)])
        args = [("u64", pxb if k.ctx["xb"] else px), ("i32", T), ("u64", pw), ("u64", 0), ("u64", 0),
                ("u64", pb if bias else 0), ("u64", pr), ("u64", py)]  # fmt: skip
        packed = PackedArgs(args)
        grid = (k.grid[0], k.grid[1] if len(k.grid) > 1 else 1, 1)
        # the split variant twice, its outputs poisoned between (its column counters reset)
        poison = y0.copy()
        poison[:T] = np.nan
        for _ in range(1 if name in CASES else 2):
            kernels.d.h2d(py, poison.ctypes.data, poison.nbytes)
            kernels.d.launch(kernels.function(k.fn), grid, (k.threads, 1, 1), 0, packed.address,
                             overlap=kernels.d.overlap_launches)  # fmt: skip
            got = kernels.read(py, (rows, n_out))
    finally:
        kernels.free()
    assert not np.isnan(got[:T]).any(), (name, "outputs left unwritten")
    np.testing.assert_array_equal(got[T:], y0[T:])
    assert rel_err(got[:T], want) <= 1e-4, (name, rel_err(got[:T], want))


def _logits(rows: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    x[0, rng.choice(vocab, 70, replace=False)] = x[0].max() + 1  # 70 tied at the top
    x[1] = np.round(x[1])  # ties everywhere
    x[2, 100:] = -np.inf  # a masked row: 100 finite values
    return x


def _assert_top(x: np.ndarray, k: int, got_v, got_i, stats) -> None:
    """[rows, k] values and ids as an argsort by value then id ranks them, [rows, 2] row stats
    (max, sum of exp) as NumPy's."""
    order = np.lexsort((np.broadcast_to(np.arange(x.shape[1]), x.shape), -x), axis=1)[:, :k]
    np.testing.assert_array_equal(got_i, order)
    np.testing.assert_array_equal(got_v, np.take_along_axis(x, order, 1))
    m = x.max(axis=1)
    np.testing.assert_array_equal(stats[:, 0], m)
    s = np.exp(x.astype(np.float64) - m[:, None]).sum(axis=1)
    np.testing.assert_allclose(stats[:, 1], s, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 40, 64])
def test_row_top_k_matches_numpy(kernels, k):
    rows, vocab = 64, VOCAB
    x = _logits(rows, vocab, k)
    vals = np.full((rows, k), np.nan, np.float32)
    ids = np.full((rows, k), -7, np.int32)
    try:
        px = kernels.upload(x)
        pv, pi, ps = kernels.upload(vals), kernels.upload(ids), kernels.poisoned((rows, 2))
        kernels.launch(TOPK_KERNEL, [rows], TOPK_BLOCK, [("u64", px), ("i32", vocab), ("i32", k),
                       ("u64", pv), ("u64", pi), ("u64", ps)])  # fmt: skip
        got_v = kernels.read(pv, (rows, k))
        got_i = kernels.read(pi, (rows, k), np.int32)
        stats = kernels.read(ps, (rows, 2))
    finally:
        kernels.free()
    _assert_top(x, k, got_v, got_i, stats)


@pytest.mark.parametrize("drawn", [False, True], ids=["greedy", "drawn"])
def test_pick_matches_numpy(kernels, drawn):
    """The pick kernel (k = 1 on several blocks a row, as the runtime launches it for the
    Llama-3 vocabulary), twice on the same counters (the last block of each row resets its
    own): at 1 / temperature 0 the row top-k's k = 1 results; drawn (temperatures 0.2-5, u
    spread over [0, 1), every fourth row greedy) the host sampler's inverse_cdf token for
    the same u but at a float32 rounding boundary (support.assert_drawn)."""
    rows, vocab = 64, VOCAB
    blocks = greedy_geometry(vocab)[0]
    x = _logits(rows, vocab, 1)
    rng = np.random.default_rng(2)
    draws = np.zeros((rows, 2), np.float32)
    if drawn:
        draws[:, 0] = 1 / rng.uniform(0.2, 5.0, rows)
        draws[::4, 0] = 0.0
        draws[:, 1] = rng.random(rows)
        draws[1, 1], draws[5, 1] = 0.0, np.nextafter(np.float32(1), np.float32(0))
    try:
        px, counters = kernels.upload(x), kernels.upload(np.zeros(rows, np.uint32))
        parts, pd = kernels.poisoned((rows, blocks, 5)), kernels.upload(draws)
        for _ in range(2):
            pv, pi, ps = kernels.poisoned(rows), kernels.poisoned(rows), kernels.poisoned((rows, 2))
            kernels.launch(f"{TOPK_KERNEL}_pick", [blocks, rows], GREEDY_BLOCK,
                           [("u64", px), ("i32", vocab), ("u64", pv), ("u64", pi), ("u64", ps),
                            ("u64", parts), ("u64", counters), ("u64", pd)])  # fmt: skip
            got_v, got_i = kernels.read(pv, rows), kernels.read(pi, rows, np.int32)
            stats = kernels.read(ps, (rows, 2))
            left = kernels.read(counters, rows, np.uint32)
            assert not left.any()
            greedy = draws[:, 0] == 0
            _assert_top(x[greedy], 1, got_v[greedy, None], got_i[greedy, None], stats[greedy])
            np.testing.assert_array_equal(got_v, x[np.arange(rows), got_i])
            for r in np.flatnonzero(~greedy):
                assert_drawn(x[r], float(draws[r, 0]), float(draws[r, 1]), int(got_i[r]))
            if drawn:  # draws, not argmaxes
                assert (got_i[~greedy] != x[~greedy].argmax(axis=1)).sum() > 10
    finally:
        kernels.free()


@pytest.mark.parametrize(("rows", "k"), [(1, 40), (8, 64), (3, 2)])
def test_split_top_k_matches_numpy(kernels, rows, k):
    """The several-block top-k (as the runtime launches it for a step's few sampled rows):
    the row top-k's results, twice on the same counters."""
    vocab, blocks = VOCAB, greedy_geometry(VOCAB)[0]
    x = _logits(max(rows, 3), vocab, 10 + k)[:rows]
    try:
        px, counters = kernels.upload(x), kernels.upload(np.zeros(rows, np.uint32))
        parts = kernels.poisoned((rows, blocks, 2 * k + 2))
        for _ in range(2):
            pv, pi = kernels.poisoned((rows, k)), kernels.poisoned((rows, k))
            ps = kernels.poisoned((rows, 2))
            kernels.launch(f"{TOPK_KERNEL}_split", [blocks, rows], GREEDY_BLOCK,
                           [("u64", px), ("i32", vocab), ("i32", k), ("u64", pv), ("u64", pi),
                            ("u64", ps), ("u64", parts), ("u64", counters)])  # fmt: skip
            got_v, got_i = kernels.read(pv, (rows, k)), kernels.read(pi, (rows, k), np.int32)
            stats = kernels.read(ps, (rows, 2))
            left = kernels.read(counters, rows, np.uint32)
            _assert_top(x, k, got_v, got_i, stats)
            assert not left.any()
    finally:
        kernels.free()
