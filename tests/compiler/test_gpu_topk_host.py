"""The row top-k kernel (templates/hip/topk.hip.j2) run on the host: each block's threads as
host threads, one block per row. Against NumPy (an argsort by value, then id: not the runtime's
top_of_logits, which is checked against the same sort here too). Outputs poisoned; rows with
ties at the k-th value (the selection goes on into the id bits), a row shorter than k, -inf
entries (masked logits), k of 1 (greedy) and of the most (64).
"""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest

from hipc.base.launch_plan import TOPK_MAX
from hipc.compiler.codegen.environment import render
from hipc.runtime.topk import top_of_logits

from support import assert_drawn

THREADS = 128  # the kernel takes any multiple of the wave (1024 on devices)
GREEDY_THREADS, GREEDY_PER_THREAD = 64, 3  # (256 and 8+ on devices: codegen's greedy_geometry)


def _build(tmp_path_factory, wave: int):
    code = render(
        "hip/topk.hip.j2",
        fn="topk",
        wave=wave,
        max_k=TOPK_MAX,
        greedy_block=GREEDY_THREADS,
        greedy_per_thread=GREEDY_PER_THREAD,
    ) + (
        'extern "C" void run(const float* l, int rows, int vocab, int k, float* v, int* i, '
        "float* s) {\n"
        f"  grid(rows, 1, {THREADS}, [=] {{ topk(l, vocab, k, v, i, s); }});\n}}\n"
        'extern "C" void run_pick(const float* l, int rows, int vocab, int blocks, float* v, '
        "int* i, float* s, float* parts, unsigned* counters, const float* draw) {\n"
        f"  grid(blocks, rows, {GREEDY_THREADS}, "
        "[=] { topk_pick(l, vocab, v, i, s, parts, counters, draw); });\n}\n"
        'extern "C" void run_split(const float* l, int rows, int vocab, int k, int blocks, '
        "float* v, int* i, float* s, float* parts, unsigned* counters) {\n"
        f"  grid(blocks, rows, {GREEDY_THREADS}, "
        "[=] { topk_split(l, vocab, k, v, i, s, parts, counters); });\n}"
    )
    return host_simt.build(tmp_path_factory.mktemp("topk"), f"topk_host{wave}", code, wave)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return _build(tmp_path_factory, 32)


@pytest.fixture(scope="module")
def lib64(tmp_path_factory):
    """At AMD gfx9's wave of 64 (the pick kernel's scans run over the wave's lanes)."""
    return _build(tmp_path_factory, 64)


def _rows(rng, rows: int, vocab: int) -> np.ndarray:
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    x[0, rng.choice(vocab, 5, replace=False)] = x[0].max() + 1  # a 5-way tie at the top
    x[1] = np.round(x[1] * 2) / 2  # many ties everywhere (values on a grid of 0.5)
    x[2, : vocab // 2] = -np.inf  # masked logits
    return x


def _sorted(x: np.ndarray, k: int):
    order = np.lexsort((np.arange(x.shape[1])[None, :].repeat(len(x), 0), -x), axis=1)[:, :k]
    return np.take_along_axis(x, order, 1), order


def _check(x: np.ndarray, k: int, vals: np.ndarray, ids: np.ndarray, stats: np.ndarray):
    """[rows, k] vals and ids (past the vocabulary: -inf, -1) and [rows, 2] stats as NumPy's."""
    kk = min(k, x.shape[1])
    want_v, want_i = _sorted(x, kk)
    np.testing.assert_array_equal(ids[:, :kk], want_i)
    np.testing.assert_array_equal(vals[:, :kk], want_v)
    assert (ids[:, kk:] == -1).all() and (vals[:, kk:] == -np.inf).all()
    m = x.max(axis=1)
    np.testing.assert_array_equal(stats[:, 0], m)
    s = np.exp(x.astype(np.float64) - m[:, None]).sum(axis=1)
    np.testing.assert_allclose(stats[:, 1], s, rtol=1e-5)


@pytest.mark.parametrize(
    ("rows", "vocab", "k"), [(4, 1000, 1), (3, 777, 64), (4, 300, 17), (3, 40, 64)]
)
def test_row_top_k_on_the_host(lib, rows, vocab, k):
    rng = np.random.default_rng(vocab + k)
    x = _rows(rng, rows, vocab)
    vals = np.full((rows, k), np.nan, np.float32)
    ids = np.full((rows, k), -7, np.int32)
    stats = np.full((rows, 2), np.nan, np.float32)
    ptr = ctypes.c_void_p
    lib.run(x.ctypes.data_as(ptr), rows, vocab, k, vals.ctypes.data_as(ptr),
            ids.ctypes.data_as(ptr), stats.ctypes.data_as(ptr))  # fmt: skip
    _check(x, k, vals, ids, stats)
    # the host selection the runtime falls back to gives the same
    host = top_of_logits(x, k)
    np.testing.assert_array_equal(host.ids, ids)
    np.testing.assert_array_equal(host.logits, vals)
    m = x.max(axis=1)
    s = np.exp(x.astype(np.float64) - m[:, None]).sum(axis=1)
    np.testing.assert_allclose(host.logsumexp, m + np.log(s), rtol=1e-6)


def _run_pick(lib, x: np.ndarray, blocks: int, draw: np.ndarray, counters: np.ndarray):
    """The pick kernel on rows x ([rows, 2] draw: 1 / temperature, u): vals, ids, stats."""
    rows, vocab = x.shape
    assert -(-vocab // blocks) <= GREEDY_THREADS * GREEDY_PER_THREAD
    ptr = ctypes.c_void_p
    parts = np.full(rows * blocks * 5, np.nan, np.float32)
    vals = np.full(rows, np.nan, np.float32)
    ids = np.full(rows, -7, np.int32)
    stats = np.full((rows, 2), np.nan, np.float32)
    draw = np.ascontiguousarray(draw, np.float32)
    lib.run_pick(x.ctypes.data_as(ptr), rows, vocab, blocks, vals.ctypes.data_as(ptr),
                 ids.ctypes.data_as(ptr), stats.ctypes.data_as(ptr), parts.ctypes.data_as(ptr),
                 counters.ctypes.data_as(ptr), draw.ctypes.data_as(ptr))  # fmt: skip
    return vals, ids, stats


@pytest.mark.parametrize(
    ("rows", "vocab", "blocks"),
    # a block's slice: up to the 192 values a block holds; 6 blocks of 2 for 10 values leave
    # the last empty; 3 blocks on 40: a slice of the masked half all -inf
    [(4, 1000, 6), (3, 777, 5), (3, 10, 6), (3, 40, 3), (3, 192, 1)],
)
def test_greedy_pick_on_blocks_of_a_row_on_the_host(lib, rows, vocab, blocks):
    """The pick kernel at temperature 0 writes what the row top-k writes for k = 1 (ties: the
    lower id), its row stats merged over the blocks' slices, and leaves the counters at zero."""
    rng = np.random.default_rng(vocab + blocks)
    first = _rows(rng, rows, vocab)
    counters = np.zeros(rows, np.uint32)
    draw = np.zeros((rows, 2), np.float32)
    draw[:, 1] = rng.random(rows)  # (u is read only at a temperature)
    for x in (first, first[::-1].copy()):  # twice: the counters the first launch left serve again
        vals, ids, stats = _run_pick(lib, x, blocks, draw, counters)
        _check(x, 1, vals[:, None], ids[:, None], stats)
        assert not counters.any()


@pytest.mark.parametrize(
    ("vocab", "blocks"),
    # slices of up to 192 values; the last of 6 slices empty (10 values); the masked half of a
    # row a whole slice of -inf (40 on 3); one block
    [(1000, 6), (777, 5), (10, 6), (40, 3), (192, 1)],
)
@pytest.mark.parametrize("wave", [32, 64])
def test_temperature_draw_on_blocks_of_a_row_on_the_host(request, vocab, blocks, wave):
    """At 1 / temperature > 0 each row's token is the host sampler's draw for the same u
    (runtime/sampler.py inverse_cdf over exp((x - max) / temperature)), but where u lies within
    float32 rounding of a boundary between two tokens: then the kernel's pick is one of the
    two. Rows: ties, a grid of values, a masked half; temperatures 0.3-3; u at 0, just below 1
    and between; rows at temperature 0 in the same launch stay greedy; the row stats are the
    raw logits' (not the temperature's). At waves of 32 and 64 lanes."""
    lib = request.getfixturevalue("lib" if wave == 32 else "lib64")
    rng = np.random.default_rng(vocab * blocks)
    checked = 0
    counters = np.zeros(6, np.uint32)
    for trial in range(12):
        x = np.concatenate([_rows(rng, 3, vocab), 2 * rng.standard_normal((3, vocab))]).astype(
            np.float32
        )
        inv_t = np.float32(1.0) / rng.uniform(0.3, 3.0, len(x)).astype(np.float32)
        inv_t[trial % len(x)] = 0.0  # a greedy row among the drawn ones
        u = rng.random(len(x)).astype(np.float32)
        u[0], u[1] = 0.0, np.nextafter(np.float32(1), np.float32(0))
        draw = np.stack([inv_t, u], axis=1)
        vals, ids, stats = _run_pick(lib, x, blocks, draw, counters)
        assert not counters.any()
        m = x.max(axis=1)
        np.testing.assert_array_equal(stats[:, 0], m)
        s = np.exp(x.astype(np.float64) - m[:, None]).sum(axis=1)
        np.testing.assert_allclose(stats[:, 1], s, rtol=1e-5)
        np.testing.assert_array_equal(vals, x[np.arange(len(x)), ids])
        for r in range(len(x)):
            if inv_t[r] == 0:
                assert ids[r] == _sorted(x[r : r + 1], 1)[1][0, 0]
            else:
                assert_drawn(x[r], float(inv_t[r]), float(u[r]), int(ids[r]))
                checked += 1
    assert checked > 40


@pytest.mark.parametrize(
    ("rows", "vocab", "k", "blocks"),
    # slices of 100 against k 17 and 64 (some shorter than k); 6 blocks on 40 values (slices
    # of 7, the last of 5) at k 64 > the vocabulary; 3 blocks on 300 with the top's ties and
    # the masked half spread over them; one block
    [(4, 1000, 17, 10), (3, 1000, 64, 10), (3, 40, 64, 6), (4, 300, 40, 3), (3, 777, 5, 1)],
)
def test_split_top_k_on_blocks_of_a_row_on_the_host(lib, rows, vocab, k, blocks):
    """The several-block top-k writes what the one-block kernel writes (ties at the k-th value
    by id, rows shorter than k padded), its stats merged over the blocks, counters left zero."""
    rng = np.random.default_rng(vocab + k + blocks)
    first = _rows(rng, rows, vocab)
    ptr = ctypes.c_void_p
    counters = np.zeros(rows, np.uint32)
    parts = np.full(rows * blocks * (2 * k + 2), np.nan, np.float32)
    for x in (first, first[::-1].copy()):  # twice: the counters the first launch left serve again
        vals = np.full((rows, k), np.nan, np.float32)
        ids = np.full((rows, k), -7, np.int32)
        stats = np.full((rows, 2), np.nan, np.float32)
        lib.run_split(x.ctypes.data_as(ptr), rows, vocab, k, blocks, vals.ctypes.data_as(ptr),
                      ids.ctypes.data_as(ptr), stats.ctypes.data_as(ptr),
                      parts.ctypes.data_as(ptr), counters.ctypes.data_as(ptr))  # fmt: skip
        _check(x, k, vals, ids, stats)
        assert not counters.any()
