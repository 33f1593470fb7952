"""The GPU MoE kernels alone on a real GPU (compiler/kernels/moe.py), against NumPy.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). Each case renders
the decode pair (_up, _down) and the prefill chain (_route, _group, _gate_up, _down, _combine)
as codegen/hip.py does, for the device's arch. Outputs and scratch start as NaN, and every
expert no token is routed to has NaN weights (quantized: NaN f16 scales), so a value a kernel
forgot to write, or an expert it should not have read, shows. The reference is the
reference executor's own router and experts ops (compiler/reference/ops.py) in float64 on
the weights' exact values; routes with exact ties are compared with torch.topk.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.ir import Node
from hipc.compiler.kernels import moe as moe_kind
from hipc.compiler.kernels.linear import QUANT_TYPES
from hipc.compiler.kernels.moe import MOE_SHORT_TILES, ROUTING, TILE, MoEParams, gpu_kernels
from hipc.compiler.passes.repack import split_quant_blocks
from hipc.compiler.reference.ops import IMPLS
from hipc.compiler.targets import GpuTarget

from gpu_kernels import DeviceKernels, experts_bf16_once, pack
from support import rel_err

pytestmark = pytest.mark.gpu
QUANT = tuple(QUANT_TYPES)  # (their names as the IR's dtypes)
MAX_TOKENS = 40

# name: (wtype, E, k, H, F, normalize, fused gate_up, residual)
CASES = {
    "f32_e9_k2_norm": ("float32", 9, 2, 64, 40, True, False, True),
    "bf16_e13_k8_fused": ("bfloat16", 13, 8, 128, 48, False, True, True),
    # partial column blocks (200 = 3 x 64 + 8), 16 K slices, several tiles per expert at T = 40
    "bf16_e16_k4_wide": ("bfloat16", 16, 4, 512, 200, True, False, True),
    "f16_e5_k1": ("float16", 5, 1, 96, 32, False, False, False),
    "q4_0_qwen3_like": ("q4_0", 128, 8, 256, 96, True, False, True),
    "q4_1_e7_k2": ("q4_1", 7, 2, 128, 64, True, False, True),
    "q8_0_e64_k8": ("q8_0", 64, 8, 256, 64, False, False, True),
    "q8_0_e130_k1_rows_odd": ("q8_0", 130, 1, 96, 160, True, False, False),
    # llama-quantize's Q4_K_M experts (Q6_K downs: DOWN), K-quant and IQ4 blocks, Q5_0's
    "q4_k_q6_k_qwen3_like": ("q4_k", 128, 8, 256, 512, True, False, True),
    "q5_k_e9_k2_fused": ("q5_k", 9, 2, 256, 256, False, True, True),
    "iq4_xs_e16_k4": ("iq4_xs", 16, 4, 512, 256, True, False, True),
    "iq4_nl_q5_0_e7_k2": ("iq4_nl", 7, 2, 128, 96, True, False, True),
    # Q8_0 downs where the expert width is no whole super-block (llama.cpp's fallback)
    "q4_k_q8_0_e9_k2_f160": ("q4_k", 9, 2, 256, 160, True, False, True),
    # llama-quantize's Q3_K_M experts: Q3_K gate/up, Q4_K downs
    "q3_k_q4_k_e9_k2": ("q3_k", 9, 2, 256, 512, True, False, True),
    # Q2_K experts, gate/up and downs
    "q2_k_e9_k2": ("q2_k", 9, 2, 256, 512, True, False, True),
}
# the down experts' type where it differs from gate/up's
DOWN = {
    "q4_k_q6_k_qwen3_like": "q6_k",
    "iq4_nl_q5_0_e7_k2": "q5_0",
    "q4_k_q8_0_e9_k2_f160": "q8_0",
    "q3_k_q4_k_e9_k2": "q4_k",
}


# the router's matmul (and its RMSNorm) fused in: case name -> (router type, norm fused)
ROUTED = {
    "q4_0_qwen3_like": ("float32", True),
    "bf16_e13_k8_fused": ("bfloat16", True),
    "f16_e5_k1": ("float16", False),
    "q8_0_e130_k1_rows_odd": ("float32", True),
    "q4_k_q6_k_qwen3_like": ("float32", True),
}
ROUTED_INT8 = ("q4_0_qwen3_like",)  # ... also compiled with int8 activations
ROUTED_LOCAL = ("q4_0_qwen3_like", "bf16_e13_k8_fused")  # ... and with MOE_ROUTE_LOCAL
EPS = 1e-6
# cases whose prefill also runs at each tile height (compiler/kernels/moe.py, tile_rows)
TILED = ("q4_0_qwen3_like", "bf16_e16_k4_wide", "q4_1_e7_k2", "q4_k_q6_k_qwen3_like")


def params(name: str, routed=None) -> MoEParams:
    wtype, E, k, H, F, normalize, fused, residual = CASES[name]
    router, norm = routed or ("", False)
    eps = EPS if norm else 0.0
    return MoEParams(wtype, E, k, H, F, normalize, fused, residual, router, eps, DOWN.get(name, ""))


def device_specs(arch: str, kernels: dict) -> list:
    """The kernels this file runs on `arch` (filling `kernels`: case -> MoEGpu), as
    DeviceKernels builds them (also to build their code object ahead, with no GPU)."""
    specs = [(ROUTING.fn, ROUTING.template, ROUTING.ctx, None)]
    for i, name in enumerate(CASES):
        m = gpu_kernels(f"m{i}", params(name), GpuTarget(arch), [name], MAX_TOKENS)
        kernels[name] = m
        kinds = (m.decode, m.prefill, *([m.mma] if m.mma else []))
        specs += [(k.fn, k.template, k.ctx, None) for k in kinds]
    # every tile height the arch has, beside the one chosen for MAX_TOKENS; x as bf16 hi + lo
    # (as above) and rounded to bf16 once (--prefill-precision bf16, the default)
    for i, name in enumerate(TILED):
        short = sorted(MOE_SHORT_TILES.get(arch, {}))
        variants = [(r, True) for r in sorted({TILE, *short})] + [
            (r, False) for r in {TILE, *short[:1]}
        ]
        for rows, split in variants:
            m = gpu_kernels(f"t{i}_{rows}_{int(split)}", params(name), GpuTarget(arch),
                            [name], MAX_TOKENS, rows=rows, split=split)  # fmt: skip
            kernels[f"{name}@{rows}" + ("" if split else "/bf16")] = m
            specs += [(k.fn, k.template, k.ctx, None) for k in (m.prefill, m.mma) if k]
    for i, (name, routed) in enumerate(ROUTED.items()):
        p = params(name, routed)
        m = gpu_kernels(f"r{i}", p, GpuTarget(arch), [name], MAX_TOKENS)
        kernels["routed:" + name] = m
        specs += [(k.fn, k.template, k.ctx, None) for k in (m.decode, m.prefill)]
    for name in ROUTED_INT8:  # --activations int8: x and act as one int8 plane
        p = params(name, ROUTED[name])
        m = gpu_kernels(f"i8{name}", p, GpuTarget(arch), [name], MAX_TOKENS, "int8")
        kernels["routed:int8:" + name] = m
        specs += [(m.decode.fn, m.decode.template, m.decode.ctx, None)]
    for name in ROUTED_LOCAL:  # opt-in: _up and _down route the token themselves
        p = params(name, ROUTED[name])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe_kind, "MOE_ROUTE_LOCAL", True)
            m = gpu_kernels(f"lo{name}", p, GpuTarget(arch), [name], MAX_TOKENS)
        kernels["routed:local:" + name] = m
        specs += [(m.decode.fn, m.decode.template, m.decode.ctx, None)]
    return specs


@pytest.fixture(scope="module")
def moe():
    kernels = {}

    def build(arch):
        return device_specs(arch, kernels)

    dev = DeviceKernels(build)
    dev.kernels = kernels
    yield dev
    dev.close()


def route(logits: np.ndarray, k: int, normalize: bool):
    node = Node("r", "MoERouter", ("l",), ("i", "w"), {"top_k": k, "normalize": int(normalize)})
    return IMPLS["hipc::MoERouter"](node, [logits.astype(np.float64)], None)


def experts(x, ids, w, gate, up, down):
    node = Node("m", "Experts", ("x", "i", "w", "g", "u", "d"), ("y",), {}, "hipc")
    return IMPLS["hipc::Experts"](node, [x.astype(np.float64), ids, w, gate, up, down], None)[0]


def stacked(wtype: str, w: np.ndarray, idle: np.ndarray):
    """[E, N, K] floats -> (bytes as a GPU artifact stores the stacked tensor, exact values);
    the experts in `idle` poisoned (NaN values, or NaN f16 scales)."""
    E, N, K = w.shape
    raw, vals = pack(w.reshape(E * N, K), wtype, "gguf")
    raw = raw.reshape(E, N, -1).copy()
    if wtype in QUANT:
        raw[idle] = 0xFF  # every f16 scale (d, dmin) 0xffff: NaN
        raw = split_quant_blocks(raw.reshape(E * N, -1), wtype)
    elif wtype == "bfloat16":  # stored as bits: 0x7fc0 is NaN
        raw[idle] = 0x7FC0
    else:
        raw[idle] = np.nan
    return raw, vals.reshape(E, N, K)


def make(name: str, T: int, ties: bool = False, routed=None, skew: bool = False, values=None):
    """routed: (x, ids, w) given (the fused routing's), else drawn and routed here."""
    wtype, E, k, H, F, normalize, fused, residual = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name) * 100 + T)
    x = rng.standard_normal((T, H)).astype(np.float32)
    if ties:  # a few levels: equal probabilities inside and across the top k
        logits = rng.integers(0, 3, (T, E)).astype(np.float32)
    else:
        logits = (2 * rng.standard_normal((T, E))).astype(np.float32)
    idle = rng.choice(E, size=max(1, E // 4) if k + 1 < E else 0, replace=False)
    if len(idle) and not ties:
        logits[:, idle] -= 40  # experts no token picks
    if skew:  # the same k - 1 experts first for every token
        logits[:, np.setdiff1d(np.arange(E), idle)[: max(1, k - 1)]] += 40
    ids, w = route(logits, k, normalize)
    if routed is not None:
        x, ids, w = routed
    idle = np.setdiff1d(np.arange(E), ids)
    gate_up = 0.1 * rng.standard_normal((E, 2 * F, H))
    down = 0.1 * rng.standard_normal((E, H, F))
    res = rng.standard_normal((T, H)).astype(np.float32)
    if fused:
        gu_raw, gu = stacked(wtype, gate_up, idle)
        weights = [gu_raw, gu_raw]
        g, u = gu[:, :F], gu[:, F:]
    else:
        (g_raw, g), (u_raw, u) = (stacked(wtype, a, idle) for a in (gate_up[:, :F], gate_up[:, F:]))
        weights = [g_raw, u_raw]
    d_raw, d = stacked(DOWN.get(name, wtype), down, idle)
    want = experts(x, ids, w, g, u, d) + (res if residual else 0.0)
    if values is not None:  # the route's weights and the experts' exact values
        values.extend([w, g, u, d])
    return x, logits, [*weights, d_raw], res, ids, want


def u64(*ptrs):
    return [("u64", p) for p in ptrs]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_matches_numpy(moe, name, ties):
    wtype, _E, k, H, F, *_, residual = CASES[name]
    m = moe.kernels[name]
    x, logits, (g, u, d), res, ids, want = make(name, 1, ties)
    dev = moe
    try:
        act, rid, rw = dev.poisoned(k * F), dev.poisoned(k), dev.poisoned(k)
        y = dev.upload(res) if residual else dev.poisoned(H)
        wg, wu, wd = dev.upload(g), dev.upload(u), dev.upload(d)
        dec = m.decode.fn
        lg = dev.upload(logits)
        dev.launch(f"{dec}_up", [m.up_blocks], m.threads,
                   u64(dev.upload(x), lg, wg, wu, act, rid, rw), m.up_shared)  # fmt: skip
        # in place, as the residual stream is updated
        dev.launch(f"{dec}_down", [m.down_blocks], m.down_threads,
                   u64(act, rid, rw, wd, y if residual else 0, y, lg), m.down_shared)  # fmt: skip
        got = dev.read(y, (1, H))
        got_ids = dev.read(rid, k, np.int32)
    finally:
        dev.free()
    np.testing.assert_array_equal(got_ids, ids[0])
    if ties:
        torch = pytest.importorskip("torch")
        want_ids = torch.topk(torch.softmax(torch.from_numpy(logits), -1), k, -1).indices
        np.testing.assert_array_equal(got_ids, want_ids.numpy()[0])
    assert np.isfinite(got).all()
    # quantized experts see x and act as int8 hi + lo planes: ~16 significant bits
    assert rel_err(got, want) <= (1e-4 if wtype in QUANT else 1e-5), rel_err(got, want)


def make_routed(name: str, T: int):
    """x before the norm, the norm's and the router's weights (router as stored, and its
    exact values), and what the fused routing must give: xn, logits, ids, w (float64)."""
    _wtype, E, k, H, _F, normalize, *_ = CASES[name]
    router, norm = ROUTED[name]
    rng = np.random.default_rng(sorted(ROUTED).index(name) * 10 + T)
    x = (3 * rng.standard_normal((T, H))).astype(np.float32)
    g = (1 + 0.3 * rng.standard_normal(H)).astype(np.float32)
    r_raw, r = pack(rng.standard_normal((E, H)) / np.sqrt(H), router)
    xn = x.astype(np.float64)
    if norm:
        xn = xn / np.sqrt(np.mean(xn * xn, -1, keepdims=True) + EPS) * g
    logits = xn @ r.T
    ids, w = route(logits, k, normalize)
    return x, g, r_raw, xn, logits, ids, w


@pytest.mark.parametrize(
    "name",
    [*sorted(ROUTED), *(f"int8:{n}" for n in ROUTED_INT8), *(f"local:{n}" for n in ROUTED_LOCAL)],
)
def test_decode_with_the_router_fused_matches_numpy(moe, name):
    """_route (the norm, the logits over many blocks, the last block's top-k), _up, _down;
    "int8:" with int8 activations, "local:" with MOE_ROUTE_LOCAL (no last block: _up and
    _down each route the token from the logits with one wave)."""
    int8 = name.startswith("int8:")
    m = moe.kernels["routed:" + name]
    name = name.split(":")[-1]
    wtype, E, k, H, F, *_, residual = CASES[name]
    x, g, r, xn_want, logits_want, ids_want, w_want = make_routed(name, 1)
    # the experts, those this route leaves idle poisoned
    _, _, (gw, uw, dw), res, _, want = make(name, 1, routed=(xn_want, ids_want, w_want))
    dev = moe
    try:
        xn, lg, rid, rw = dev.poisoned(H), dev.poisoned(E), dev.poisoned(k), dev.poisoned(k)
        cnt = dev.upload(np.zeros(1, np.uint32))
        act = dev.poisoned(k * F)
        y = dev.upload(res) if residual else dev.poisoned(H)
        dg, du, dd = dev.upload(gw), dev.upload(uw), dev.upload(dw)
        dec = m.decode.fn
        inputs = dev.upload(x), dev.upload(g), dev.upload(r)
        t1 = [("i32", 1)]
        # twice, the first into other buffers: the second routes only if the first's last
        # block reset the hand-off counter
        first = u64(
            *inputs, dev.poisoned(H), dev.poisoned(E), cnt, dev.poisoned(k), dev.poisoned(k)
        )
        dev.launch(f"{dec}_route", [m.route_blocks], m.threads, t1 + first)
        dev.launch(f"{dec}_route", [m.route_blocks], m.threads,
                   t1 + u64(*inputs, xn, lg, cnt, rid, rw))  # fmt: skip
        dev.launch(f"{dec}_up", [m.up_blocks], m.threads,
                   u64(xn, lg, dg, du, act, rid, rw), m.up_shared)  # fmt: skip
        dev.launch(f"{dec}_down", [m.down_blocks], m.down_threads,
                   u64(act, rid, rw, dd, y if residual else 0, y, lg), m.down_shared)  # fmt: skip
        got = dev.read(y, (1, H))
        got_xn, got_lg = dev.read(xn, H), dev.read(lg, E)
        got_ids, got_w = dev.read(rid, k, np.int32), dev.read(rw, k)
        count = dev.read(cnt, 1, np.uint32)
    finally:
        dev.free()
    assert count[0] == 0
    np.testing.assert_allclose(got_xn, xn_want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_lg, logits_want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got_ids, ids_want[0])
    np.testing.assert_allclose(got_w, w_want[0], rtol=1e-5, atol=1e-7)
    assert np.isfinite(got).all()
    if int8:  # one int8 plane per 32 values (tests/compiler/test_gpu_moe_host.py: 8.7e-3)
        assert 1e-3 < rel_err(got, want) <= 3e-2, rel_err(got, want)
        return
    # quantized experts see x and act as int8 hi + lo planes: ~16 significant bits
    assert rel_err(got, want) <= (1e-4 if wtype in QUANT else 1e-5), rel_err(got, want)


@pytest.mark.parametrize("T", [5, MAX_TOKENS])
@pytest.mark.parametrize("name", sorted(ROUTED))
def test_prefill_route_with_the_router_fused_matches_numpy(moe, name, T):
    """The prefill's _route (blocks of route_tokens tokens, the last one partly past T):
    the norm, the logits, the route; nothing written past T."""
    _wtype, E, k, H, *_ = CASES[name]
    m = moe.kernels["routed:" + name]
    x, g, r, xn_want, logits_want, ids_want, w_want = make_routed(name, T)
    tt = m.prefill.ctx["route_tokens"]
    dev = moe
    try:
        xn, lg = dev.poisoned((MAX_TOKENS, H)), dev.poisoned((MAX_TOKENS, E))
        rid, rw = dev.poisoned((MAX_TOKENS, k)), dev.poisoned((MAX_TOKENS, k))
        cnt = dev.upload(np.zeros(1, np.uint32))
        args = [("i32", T), *u64(dev.upload(x), dev.upload(g), dev.upload(r), xn, lg, cnt, rid, rw)]
        dev.launch(f"{m.prefill.fn}_route", [-(-T // tt)], 256, args)
        got_xn, got_lg = dev.read(xn, (MAX_TOKENS, H)), dev.read(lg, (MAX_TOKENS, E))
        got_ids, got_w = dev.read(rid, (MAX_TOKENS, k), np.int32), dev.read(rw, (MAX_TOKENS, k))
    finally:
        dev.free()
    np.testing.assert_allclose(got_xn[:T], xn_want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_lg[:T], logits_want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got_ids[:T], ids_want)
    np.testing.assert_allclose(got_w[:T], w_want, rtol=1e-5, atol=1e-7)
    assert np.isnan(got_xn[T:]).all() and np.isnan(got_lg[T:]).all()  # nothing past T


@pytest.mark.parametrize("T", [1, 7, MAX_TOKENS])
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_matches_numpy(moe, name, T):
    check_prefill(moe, name, name, T)


@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("T", [5, MAX_TOKENS])
@pytest.mark.parametrize("rows", [16, 32, 64])
@pytest.mark.parametrize("name", TILED)
def test_prefill_tiles_match_numpy(moe, name, rows, T, skew):
    """Each tile height; skew: every token's top choices the same few experts (rows past
    several tiles of any height) and a quarter of the experts empty."""
    if f"{name}@{rows}" not in moe.kernels:
        pytest.skip(f"no {rows}-row MoE tile on {moe.arch}")
    check_prefill(moe, name, f"{name}@{rows}", T, skew=skew)


@pytest.mark.parametrize("rows", [16, 64])
@pytest.mark.parametrize("name", TILED)
def test_prefill_bf16_once_matches_numpy(moe, name, rows):
    """x (and act) rounded to bf16 once: against NumPy rounding them the same way."""
    if f"{name}@{rows}/bf16" not in moe.kernels:
        pytest.skip(f"no {rows}-row MoE tile on {moe.arch}")
    check_prefill(moe, name, f"{name}@{rows}/bf16", MAX_TOKENS, skew=True)


def check_prefill(moe, name, kernels, T, skew=False):
    _wtype, E, k, H, F, *_, residual = CASES[name]
    m = moe.kernels[kernels]
    values = []
    x, logits, (g, u, d), res, ids, want = make(name, T, ties=T == 7, skew=skew, values=values)
    pre, dev = m.prefill.fn, moe
    pairs = MAX_TOKENS * k
    try:
        rid, rw = dev.poisoned(pairs), dev.poisoned(pairs)
        src, pos = dev.poisoned(pairs), dev.poisoned(pairs)
        tiles = dev.poisoned(3 * m.max_tiles + 1)
        act, out = dev.poisoned(pairs * F), dev.poisoned(pairs * H)
        y = dev.upload(res) if residual else dev.poisoned((T, H))
        xs, ls = dev.upload(x), dev.upload(logits)
        wg, wu, wd = dev.upload(g), dev.upload(u), dev.upload(d)
        dev.launch(f"{pre}_route", [T], 256, [*u64(ls), ("i32", E), *u64(rid, rw)])
        dev.launch(f"{pre}_group", [1], 1024, [*u64(rid), ("i32", T), *u64(src, pos, tiles)])
        # SIMT tiles, or the matrix instructions for bf16 experts where the arch has them
        gu, dn = m.gate_up, m.down
        dev.launch(gu.kernel, [gu.blocks_x, m.max_tiles], gu.threads,
                   u64(xs, src, tiles, wg, wu, act), gu.shared)  # fmt: skip
        dev.launch(dn.kernel, [dn.blocks_x, m.max_tiles], dn.threads,
                   u64(act, tiles, wd, out), dn.shared)  # fmt: skip
        dev.launch(f"{pre}_combine", [T], 256, u64(out, pos, rw, y if residual else 0, y))
        got = dev.read(y, (T, H))
        got_ids = dev.read(rid, (T, k), np.int32)
        n_tiles = int(dev.read(tiles, 3 * m.max_tiles + 1, np.int32)[-1])
    finally:
        dev.free()
    np.testing.assert_array_equal(got_ids, ids)
    counts = np.bincount(ids.reshape(-1), minlength=E)
    bm = m.prefill.ctx["bm"]
    assert n_tiles == sum(-(-c // bm) for c in counts) <= m.max_tiles
    assert np.isfinite(got).all()
    if m.mma is not None and not m.mma.ctx["split"]:
        # rounded once (a float32 act may round the other way at a tie's edge, rarely)
        once = experts_bf16_once(x, ids, *values) + (res if residual else 0.0)
        assert rel_err(got, once) <= 2e-4, rel_err(got, once)
        assert rel_err(got, want) > 1e-5  # the rounding shows: not the split path
        return
    # the matrix instructions see x and act as bf16 hi + lo: about 16 significant bits
    assert rel_err(got, want) <= (1e-4 if m.mma else 1e-5), rel_err(got, want)


# -- Qwen2-MoE's shared expert: the linear kernels' gated residual -------------------------

# name: (wtype, N, K); y[t] = res[t] + sigmoid(gate[t * ldg]) * (W x[t] + b)
GATED = {
    "gated_bf16": ("bfloat16", 48, 256),
    "gated_q4_0": ("q4_0", 64, 256),
    "gated_f32_odd": ("float32", 37, 96),
}
LDG = 5  # the gate logit is a column of a wider buffer (the router's logits + 1)


@pytest.fixture(scope="module")
def gated():
    from hipc.compiler.kernels.linear import LinearParams, decode_gemv, prefill_gemm

    kernels = {}

    def build(arch):
        specs = []
        for i, (name, (wtype, N, K)) in enumerate(GATED.items()):
            p = LinearParams(wtype, N, K, 0.0, "residual", True, gated=True)
            dk = decode_gemv(f"gv{i}", p, GpuTarget(arch), [name])
            # split: x as bf16 hi + lo, the exact policy these bars are for (bf16-once
            # measured 1.08e-3 on the H200, its rounding)
            pk = prefill_gemm(f"gm{i}", p, GpuTarget(arch), [name], split=True)
            kernels[name] = (dk, pk)
            specs += [(k.fn, k.template, k.ctx, k.shared) for k in (dk, pk)]
        return specs

    dev = DeviceKernels(build)
    dev.kernels = kernels
    yield dev
    dev.close()


@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("name", sorted(GATED))
def test_gated_residual_matches_numpy(gated, name, T):
    wtype, N, K = GATED[name]
    rng = np.random.default_rng(sorted(GATED).index(name) + 10 * T)
    raw, w = pack(0.1 * rng.standard_normal((N, K)), wtype)
    x = rng.standard_normal((T, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    res = rng.standard_normal((T, N)).astype(np.float32)
    g = (2 * rng.standard_normal((T, LDG))).astype(np.float32)
    s = 1 / (1 + np.exp(-g[:, LDG - 1 : LDG].astype(np.float64)))
    want = res + s * (x.astype(np.float64) @ w.T + b)
    dk, pk = gated.kernels[name]
    dev = gated
    try:
        xs, ws, bs, gs = dev.upload(x), dev.upload(raw), dev.upload(b), dev.upload(g)
        gate = gs + 4 * (LDG - 1)
        y = dev.upload(res)  # in place, as the residual stream is updated
        if T == 1:
            args = [*u64(xs, ws, 0, bs, y, y, gate), ("i32", LDG)]
            dev.launch(dk.fn, dk.grid, dk.threads, args, dk.shared)
        else:
            args = [("u64", xs), ("i32", T), *u64(ws, 0, 0, bs, y, y, gate), ("i32", LDG)]
            grid = [-(-N // pk.block_outputs), -(-T // pk.block_tokens)]
            dev.launch(pk.fn, grid, pk.threads, args, pk.shared)
        got = dev.read(y, (T, N))
    finally:
        dev.free()
    # q4_0 decode: x staged as int8 hi + lo planes; bf16 prefill: x split into bf16 hi + lo
    tol = 1e-4 if (wtype, T) in (("q4_0", 1), ("bfloat16", 9)) else 1e-5
    assert rel_err(got, want) <= tol, rel_err(got, want)
