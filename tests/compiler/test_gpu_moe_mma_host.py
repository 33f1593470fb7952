"""The GPU MoE prefill's grouping and grouped GEMMs on the matrix instructions
(templates/hip/moe_prefill.hip.j2's _group and _combine, moe_mma.hip.j2's _gate_up and
_down) run on the host: HIPC_HOST_SIMT with mma.sync emulated (HIPC_MMA_HOST), for every
tile height compiler/kernels/moe.py has on NVIDIA, x as bf16 hi + lo (--prefill-precision
split) or rounded to bf16 once (bf16, the default). Routes are given: experts no pair picks
(their weights NaN: a tile that reads one shows), experts with more rows than several
tiles, odd token counts; experts in 32-weight blocks, bf16 and K-quant/IQ4_XS blocks with a
down type of their own. Outputs and scratch start as NaN; against NumPy in float64.
"""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest

from hipc.compiler.codegen.environment import render
from hipc.compiler.ir import Node
from hipc.compiler.kernels.moe import (
    COMBINE,
    GATE_UP,
    GROUP,
    MOE_SHORT_TILES,
    PREFILL_DOWN,
    ROUTING,
    SHORT_TILES_ENV,
    TILE,
    MoEParams,
    gpu_kernels,
    tile_rows,
)
from hipc.compiler.passes.repack import split_quant_blocks
from hipc.compiler.reference.ops import IMPLS
from hipc.compiler.targets import GpuTarget

from gpu_kernels import experts_bf16_once, pack
from support import rel_err

MAX_TOKENS = 13
# name: (experts' type, E, k, H, F)
CASES = {
    "q4_0": ("q4_0", 6, 3, 64, 64),
    "q4_1": ("q4_1", 5, 2, 96, 64),
    "bf16": ("bfloat16", 4, 2, 32, 64),
    # llama-quantize's Q4_K_M experts: Q4_K (offsets) with Q6_K downs (none), and the reverse
    "q4_k_q6_k": ("q4_k", 5, 2, 256, 256),
    "iq4_xs_q5_k": ("iq4_xs", 4, 3, 256, 256),
    # an expert width that is no whole super-block: Q8_0 downs (llama.cpp's fallback)
    "q4_k_q8_0": ("q4_k", 4, 2, 256, 96),
    # Q3_K gate/up (no offsets) with Q4_K downs: llama-quantize's Q3_K_M experts
    "q3_k_q4_k": ("q3_k", 4, 2, 256, 256),
    # Q2_K gate/up and downs (offsets per 16)
    "q2_k": ("q2_k", 4, 2, 256, 256),
}
# the down experts' type where it differs from gate/up's
DOWN = {"q4_k_q6_k": "q6_k", "iq4_xs_q5_k": "q5_k", "q4_k_q8_0": "q8_0", "q3_k_q4_k": "q4_k"}
ROWS = sorted({TILE, *MOE_SHORT_TILES["sm_90"]})


def params(name: str) -> MoEParams:
    wtype, E, k, H, F = CASES[name]
    return MoEParams(wtype, E, k, H, F, False, False, True, down_wtype=DOWN.get(name, ""))


def wrapper(fn: str, sig, shared: int = 0) -> str:
    names = ", ".join(a.name for a in sig.args)
    return (
        f'extern "C" void run_{fn}(int gx, int gy, int nt, {sig.render(0)}) {{\n'
        f"  grid(gx, gy, nt, [=] {{ {fn}({names}); }}, {shared});\n}}"
    )


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    parts = [
        "#define __launch_bounds__(...)",
        render(f"hip/{ROUTING.template}.hip.j2", fn=ROUTING.fn),
    ]
    wrappers, kernels = [], {}
    for i, name in enumerate(CASES):
        for rows, split in [(r, True) for r in ROWS] + [(16, False), (TILE, False)]:
            m = gpu_kernels(f"h{i}_{rows}_{int(split)}", params(name), GpuTarget("sm_90"), [name],
                            MAX_TOKENS, rows=rows, split=split)  # fmt: skip
            assert m.mma is not None and m.prefill.ctx["bm"] == rows
            kernels[name, rows, split] = m
            for k in (m.prefill, m.mma):
                parts.append(render(f"hip/{k.template}.hip.j2", fn=k.fn, **k.ctx))
            pre = m.prefill.fn
            wrappers += [
                wrapper(f"{pre}_group", GROUP),
                wrapper(m.gate_up.kernel, GATE_UP, m.gate_up.shared),
                wrapper(m.down.kernel, PREFILL_DOWN, m.down.shared),
                wrapper(f"{pre}_combine", COMBINE),
            ]
    # the prefill template's _route is left unused here: routes are given
    code = "\n".join(parts) + "\n" + "\n".join(wrappers)
    handle = host_simt.build(
        tmp_path_factory.mktemp("moemma"), "moe_mma_host", code, 32, "HIPC_MMA_HOST"
    )
    handle.kernels = kernels
    return handle


def routes(E: int, k: int, T: int, skew: bool, rng):
    """ids [T, k] (distinct per token) and weights. skew: every token picks experts 0 and 1
    first (rows past one tile of any height), expert E - 1 never (an empty expert)."""
    ids = np.empty((T, k), np.int32)
    for t in range(T):
        pool = np.arange(E - 1)
        if skew:
            rest = rng.permutation(pool[2:])[: k - 2]
            ids[t] = np.concatenate([[0, 1], rest])[:k]
        else:
            ids[t] = rng.permutation(pool)[:k]
    w = rng.uniform(0.1, 1, (T, k)).astype(np.float32)
    return ids, w


def experts(wtype: str, E: int, N: int, K: int, idle, rng):
    a = 0.1 * rng.standard_normal((E * N, K))
    raw, vals = pack(a, wtype, "gguf")
    raw = raw.reshape(E, N, -1).copy()
    if wtype == "bfloat16":
        raw[idle] = 0x7FC0
    else:
        raw[idle] = 0xFF  # scales f16 NaN
        raw = split_quant_blocks(raw.reshape(E * N, -1), wtype)
    return np.ascontiguousarray(raw.reshape(E * N, -1)), vals.reshape(E, N, K)


def ptr(a):
    return ctypes.c_void_p(a.ctypes.data)


def grid(names, rows, Ts):
    """(name, rows, T): the weight-type cases (DOWN's) on the 64-row tiles of the longer steps
    only (the tile heights are the same code for every type)."""
    return [
        (n, r, t) for n in names for r in rows for t in Ts if n not in DOWN or (r == TILE and t > 1)
    ]


@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize(("name", "rows", "T"), grid(sorted(CASES), ROWS, [1, 7, MAX_TOKENS]))
def test_grouped_gemms_on_the_host(lib, name, rows, T, skew):
    check(lib, name, rows, T, skew, True)


@pytest.mark.parametrize(("name", "rows", "T"), grid(sorted(CASES), [16, TILE], [7, MAX_TOKENS]))
def test_grouped_gemms_bf16_once_on_the_host(lib, name, rows, T):
    check(lib, name, rows, T, True, False)


def check(lib, name, rows, T, skew, split):
    wtype, E, k, H, F = CASES[name]
    m = lib.kernels[name, rows, split]
    rng = np.random.default_rng(T * 7 + rows + skew)
    ids, w = routes(E, k, T, skew and k >= 2, rng)
    idle = np.setdiff1d(np.arange(E), ids)
    (g_raw, g), (u_raw, u), (d_raw, d) = (
        experts(t, E, n, kk, idle, rng)
        for t, n, kk in ((wtype, F, H), (wtype, F, H), (DOWN.get(name, wtype), H, F))
    )
    x = rng.standard_normal((T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32)
    pairs = T * k
    src, pos = np.full(pairs, -1, np.int32), np.full(pairs, -1, np.int32)
    tiles = np.full(3 * m.max_tiles + 1, -1, np.int32)
    act = np.full(pairs * F, np.nan, np.float32)
    out = np.full(pairs * H, np.nan, np.float32)
    y = res.copy()
    flat_ids, flat_w = np.ascontiguousarray(ids.reshape(-1)), np.ascontiguousarray(w.reshape(-1))
    pre, gu, dn = m.prefill.fn, m.gate_up, m.down
    getattr(lib, f"run_{pre}_group")(1, 1, 1024, ptr(flat_ids), T, ptr(src), ptr(pos), ptr(tiles))
    getattr(lib, f"run_{gu.kernel}")(gu.blocks_x, m.max_tiles, gu.threads, ptr(x), ptr(src),
                                     ptr(tiles), ptr(g_raw), ptr(u_raw), ptr(act))  # fmt: skip
    getattr(lib, f"run_{dn.kernel}")(dn.blocks_x, m.max_tiles, dn.threads, ptr(act), ptr(tiles),
                                     ptr(d_raw), ptr(out))  # fmt: skip
    getattr(lib, f"run_{pre}_combine")(T, 1, 256, ptr(out), ptr(pos), ptr(flat_w), ptr(y), ptr(y))
    counts = np.bincount(flat_ids, minlength=E)
    n = tiles[-1]
    assert n == sum(-(-c // rows) for c in counts) <= m.max_tiles
    got_tiles = tiles[: 3 * n].reshape(n, 3)
    assert (got_tiles[:, 2] - got_tiles[:, 1] <= rows).all() and (
        got_tiles[:, 2] > got_tiles[:, 1]
    ).all()
    np.testing.assert_array_equal(np.sort(src), np.arange(pairs))
    np.testing.assert_array_equal(src[pos], np.arange(pairs))
    node = Node("m", "Experts", ("x", "i", "w", "g", "u", "d"), ("y",), {}, "hipc")
    want = res + IMPLS["hipc::Experts"](node, [x.astype(np.float64), ids, w, g, u, d], None)[0]
    assert np.isfinite(y).all()
    if split:  # x and act as bf16 hi + lo: about 16 significant bits
        assert rel_err(y, want) <= 1e-4, rel_err(y, want)
        return
    # rounded once: as NumPy with x and each act row rounded to bf16 (the kernel's act, float32
    # sums, may round the other way at a tie's edge: one bf16 step in a few of them)
    once = experts_bf16_once(x, ids, w, g, u, d)
    assert rel_err(y, res + once) <= 2e-4, rel_err(y, res + once)
    assert rel_err(y, want) > 1e-5  # the rounding is seen: this is not the split path


def test_tile_rows_follow_the_rows_per_expert(monkeypatch):
    """By default 64 rows everywhere (MOE_SHORT_ROWS empty); a height listed there is taken on
    NVIDIA for steps whose average expert fills at most half of it (32 rows: Qwen3.5-35B at 512
    tokens, 16 rows an expert; not Qwen3-30B's 32), many rows keeping the 64-row tile and AMD
    keeping it always. Opted in (HIPC_MOE_SHORT_TILES=1), every height (16-row tiles for the
    shortest steps); opted out (=0), none."""
    from hipc.compiler.kernels import moe

    p30 = MoEParams("q4_0", 128, 8, 2048, 768, True, False, True)
    p35 = MoEParams("q4_0", 256, 8, 2048, 512, True, False, True)
    assert tile_rows(512, p35, "sm_90") == tile_rows(64, p35, "sm_90") == TILE
    monkeypatch.setattr(moe, "MOE_SHORT_ROWS", (32,))
    assert tile_rows(512, p35, "sm_90") == 32
    assert tile_rows(513, p35, "sm_90") == TILE
    assert tile_rows(512, p30, "sm_90") == TILE
    assert tile_rows(256, p30, "sm_90") == 32
    assert tile_rows(4096, p35, "sm_90") == TILE
    assert tile_rows(512, p35, "gfx942") == TILE
    monkeypatch.setenv(SHORT_TILES_ENV, "0")
    assert tile_rows(512, p35, "sm_90") == TILE
    monkeypatch.setenv(SHORT_TILES_ENV, "1")
    assert tile_rows(256, p35, "sm_90") == 16
    assert tile_rows(512, p35, "sm_90") == 32
    assert tile_rows(128, p30, "sm_90") == 16
    m = gpu_kernels("t", p35, GpuTarget("sm_90"), ["t"], 256)
    assert m.prefill.ctx["bm"] == m.mma.ctx["bm"] == 16
    assert m.max_tiles == 256 * 8 // 16 + 256


def test_expert_widths_the_gpu_kernels_take():
    """Each matrix's rows are whole blocks of its own type: Q4_K gate/up need a hidden width
    of 256s, a Q8_0 down an expert width of 32s (llama.cpp's fallback where the expert width
    is no whole super-block); anything else is refused naming the width and the type."""
    from hipc.compiler.kernels.base import FusionError

    def kernels(H, F, down=""):
        p = MoEParams("q4_k", 4, 2, H, F, False, False, True, down_wtype=down)
        return gpu_kernels("w", p, GpuTarget("sm_90"), ["l0.moe"], 8)

    assert kernels(256, 96, "q8_0").decode.ctx["dunit"] == "q8_0"
    with pytest.raises(FusionError, match="hidden width in multiples of 256 for q4_k"):
        kernels(128, 256)
    with pytest.raises(FusionError, match="expert width in multiples of 32 for q8_0"):
        kernels(256, 80, "q8_0")
    with pytest.raises(FusionError, match="expert width in multiples of 256 for q4_k"):
        kernels(256, 96)
