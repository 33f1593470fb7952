"""The GPU MoE decode chain with the router fused in (templates/hip/moe_decode.hip.j2:
_route, _up, _down) and the prefill's fused _route (moe_prefill.hip.j2), run on the host:
the rendered kernels compiled by a plain C++ compiler with HIPC_HOST_SIMT, each block's
threads in step as host threads, the blocks one after another (the last block of _route is
then the grid's last: any order is one the GPU may take). Outputs start as NaN and the
experts no token picks have NaN weights, against NumPy in float64. The experts' types take
each kind of GEMV unit (32-weight blocks, the K-quants' 64- and 128-weight units) and a down
type of their own (llama-quantize's Q4_K_M: Q6_K downs). tests/gpu runs the same kernels on a
GPU; this checks their indexing and the blocks' hand-off on a machine with none.
"""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest

from hipc.compiler.codegen.environment import render
from hipc.compiler.ir import Node
from hipc.compiler.kernels import moe
from hipc.compiler.kernels.moe import XQ_BLOCK_BYTES, XQ_BYTES, MoEParams, gpu_kernels
from hipc.compiler.passes.repack import split_quant_blocks
from hipc.compiler.reference.ops import IMPLS
from hipc.compiler.targets import GpuTarget

from gpu_kernels import pack
from support import rel_err

EPS = 1e-6
MAX_TOKENS = 7

# name: (experts' type, E, k, H, F, normalize, router type, norm fused)
CASES = {
    "q4_0_e16_k4_f32router_norm": ("q4_0", 16, 4, 256, 64, True, "float32", True),
    "f32_e7_k2_bf16router": ("float32", 7, 2, 64, 40, False, "bfloat16", False),
    "q8_0_e128_k8_f16router_norm": ("q8_0", 128, 8, 128, 32, True, "float16", True),
    "q4_0_e16_k4_f32router_norm_int8": ("q4_0", 16, 4, 256, 64, True, "float32", True),
    # llama-quantize's Q4_K_M experts (Q6_K downs) in 64-weight units; _down's 48 units a row
    # take 2 steps a lane, one a batch (OPT_IN: MOE_DOWN_UNITS)
    "q4_k_q6_k_e9_k4_f32router_norm": ("q4_k", 9, 4, 256, 768, True, "float32", True),
    # ... in 128-weight units (hipc_unit_q4_k, hipc_unit_q6_k: OPT_IN)
    "q4_k_q6_k_e5_k2_f16router_unit128": ("q4_k", 5, 2, 256, 256, False, "float16", False),
    "iq4_xs_e6_k2_f16router_norm_int8": ("iq4_xs", 6, 2, 512, 256, False, "float16", True),
    "q5_k_e5_k2_bf16router": ("q5_k", 5, 2, 256, 256, True, "bfloat16", False),
    "iq4_nl_q5_1_e10_k4_f32router": ("iq4_nl", 10, 4, 128, 96, True, "float32", False),
    # Q4_K gate/up with Q8_0 downs of an expert width that is no whole super-block (llama.cpp's
    # fallback: Qwen2-MoE's 1408)
    "q4_k_q8_0_e7_k3_f32router_norm": ("q4_k", 7, 3, 256, 160, True, "float32", True),
    # llama-quantize's Q3_K_M experts: Q3_K gate/up (128-weight units), Q4_K downs
    "q3_k_q4_k_e6_k2_f32router_norm": ("q3_k", 6, 2, 256, 512, True, "float32", True),
    # Q2_K experts, gate/up and downs (mins per 16)
    "q2_k_e6_k2_f32router_norm": ("q2_k", 6, 2, 256, 512, True, "float32", True),
}
# the down experts' type where it differs from gate/up's
DOWN = {
    "q4_k_q6_k_e9_k4_f32router_norm": "q6_k",
    "q4_k_q6_k_e5_k2_f16router_unit128": "q6_k",
    "iq4_nl_q5_1_e10_k4_f32router": "q5_1",
    "q4_k_q8_0_e7_k3_f32router_norm": "q8_0",
    "q3_k_q4_k_e6_k2_f32router_norm": "q4_k",
}
# cases compiled with CompileOptions.activations "int8" (x and act as one int8 plane)
INT8 = {"q4_0_e16_k4_f32router_norm_int8", "iq4_xs_e6_k2_f16router_norm_int8"}
# the opt-in decode routing (compiler/kernels/moe.py): the last block routing with one wave;
# no hand-off, _up and _down each routing from the logits
CASES["q8_0_e128_k8_f16router_norm_wave"] = CASES["q8_0_e128_k8_f16router_norm"]
CASES["q4_0_e16_k4_f32router_norm_local"] = CASES["q4_0_e16_k4_f32router_norm"]
CASES["q8_0_e128_k8_f16router_norm_local"] = CASES["q8_0_e128_k8_f16router_norm"]
OPT_IN = {
    "q4_k_q6_k_e9_k4_f32router_norm": {"MOE_DOWN_UNITS": {"q6_k64": 1}},
    "q4_k_q6_k_e5_k2_f16router_unit128": {"MOE_UNIT64": False},
    "q8_0_e128_k8_f16router_norm_wave": {"MOE_ROUTE_WAVE": True},
    "q4_0_e16_k4_f32router_norm_local": {"MOE_ROUTE_LOCAL": True},
    "q8_0_e128_k8_f16router_norm_local": {"MOE_ROUTE_LOCAL": True},
}


def params(name: str) -> MoEParams:
    wtype, E, k, H, F, normalize, router, norm = CASES[name]
    eps = EPS if norm else 0.0
    return MoEParams(wtype, E, k, H, F, normalize, False, True, router, eps, DOWN.get(name, ""))


def host_source(text: str, xq_ints: int) -> str:
    # the host has no dynamic shared memory: the kernels' staging array as a static one
    return text.replace("extern __shared__ int xq[];", f"static int xq[{max(xq_ints, 1)}];")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    from hipc.compiler.kernels.moe import ROUTING

    # (the prefill kernels give CUDA's launch bounds directly)
    parts = [
        "#define __launch_bounds__(...)",
        render(f"hip/{ROUTING.template}.hip.j2", fn=ROUTING.fn),
    ]
    wrappers, specs = [], {}
    for i, name in enumerate(CASES):
        act = "int8" if name in INT8 else "int16"
        with pytest.MonkeyPatch.context() as mp:
            for attr, value in OPT_IN.get(name, {}).items():
                mp.setattr(moe, attr, value)
            m = gpu_kernels(f"m{i}", params(name), GpuTarget("sm_90"), [name], MAX_TOKENS, act)
        specs[name] = m
        xq = max(m.up_shared, m.down_shared) // 4
        for k in (m.decode, m.prefill):
            parts.append(host_source(render(f"hip/{k.template}.hip.j2", fn=k.fn, **k.ctx), xq))
        d, p, tt = m.decode.fn, m.prefill.fn, m.prefill.ctx["route_tokens"]
        route_args = "T, x, g, r, xn, lg, cnt, ids, w"
        wrappers.append(
            f'extern "C" void run_{d}(const float* x, const float* g, const void* r, float* xn, '
            f"float* lg, unsigned* cnt, int* ids, float* w, const void* gate, const void* up, "
            f"const void* down, float* act, float* y) {{\n"
            f"  const int T = 1;\n"
            f"  grid({m.route_blocks}, 1, {m.threads}, [=] {{ {d}_route({route_args}); }});\n"
            f"  grid({m.up_blocks}, 1, {m.threads}, [=] {{ {d}_up(xn, lg, gate, up, act, ids, w); }});\n"
            f"  grid({m.down_blocks}, 1, {m.down_threads}, [=] {{ {d}_down(act, ids, w, down, y, y, lg); }});\n"
            f'}}\nextern "C" void run_{p}(int T, const float* x, const float* g, const void* r, '
            f"float* xn, float* lg, unsigned* cnt, int* ids, float* w) {{\n"
            f"  grid((T + {tt} - 1) / {tt}, 1, 256, [=] {{ {p}_route({route_args}); }});\n}}"
        )
    code = "\n".join(parts) + "\n" + "\n".join(wrappers)
    handle = host_simt.build(tmp_path_factory.mktemp("moe"), "moe_host", code)
    handle.specs = specs
    return handle


def make(name: str, T: int, tie: bool = False):
    """`tie`: the k-th ranked expert's router row copied onto a lower ranked one's, so that
    token 0's k-th largest logit is an exact tie of two computed the same way."""
    wtype, E, k, H, F, normalize, router, norm = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name) * 10 + T)
    x = (3 * rng.standard_normal((T, H))).astype(np.float32)
    g = (1 + 0.3 * rng.standard_normal(H)).astype(np.float32)
    r_raw, r = pack(rng.standard_normal((E, H)) / np.sqrt(H), router)
    xn = x.astype(np.float64)
    if norm:
        xn = xn / np.sqrt(np.mean(xn * xn, -1, keepdims=True) + EPS) * g
    node = Node("r", "MoERouter", ("l",), ("i", "w"), {"top_k": k, "normalize": int(normalize)})
    if tie:  # the first copy torch orders other than "lower expert first" (a rule that fails)
        a = np.argsort(-(xn[0] @ r.T), kind="stable")[k - 1]
        for b in np.argsort(-(xn[0] @ r.T), kind="stable")[k:]:
            rt = r.copy()
            rt[b] = r[a]
            ids, _ = IMPLS["hipc::MoERouter"](node, [xn[:1] @ rt.T], None)
            if ids[0, k - 1] != min(a, b):
                r_raw[b], r[b] = r_raw[a], r[a]
                break
        else:
            raise AssertionError("no tie torch orders by more than the expert index")
    logits = xn @ r.T
    ids, w = IMPLS["hipc::MoERouter"](node, [logits], None)
    idle = np.setdiff1d(np.arange(E), ids)
    experts = []
    down = DOWN.get(name, wtype)
    for shape, t in (((E, F, H), wtype), ((E, F, H), wtype), ((E, H, F), down)):
        a = 0.1 * rng.standard_normal(shape)
        raw, vals = pack(a.reshape(-1, shape[2]), t, "gguf")
        raw, vals = raw.reshape(E, shape[1], -1).copy(), vals.reshape(shape)
        if wtype == "float32":
            raw[idle] = np.nan
        else:  # every byte of an idle expert's blocks 0xff: its scales are f16 NaN
            raw[idle] = 0xFF
            raw = split_quant_blocks(raw.reshape(E * shape[1], -1), t)
        experts.append((raw.reshape(E * shape[1], -1), vals))
    return x, g, r_raw, xn, logits, ids, w, experts


def ptrs(*arrays):
    return [a.ctypes.data_as(ctypes.c_void_p) for a in arrays]


# the weight-type cases route without ties only (the routing is the same code for every type)
TYPE_CASES = set(DOWN) | {"iq4_xs_e6_k2_f16router_norm_int8", "q5_k_e5_k2_bf16router"}


@pytest.mark.parametrize(
    ("name", "tie"),
    [(n, t) for n in sorted(CASES) for t in (False, True) if not (t and n in TYPE_CASES)],
)
def test_decode_route_up_down_on_the_host(lib, name, tie):
    """`tie`: the route's one-wave path finds two of the top k + 1 equal and hands the token
    to the block-wide replay of torch's order."""
    wtype, E, k, H, F, *_ = CASES[name]
    m = lib.specs[name]
    x, g, r, xn_want, logits_want, ids_want, w_want, experts = make(name, 1, tie)
    if tie:
        assert logits_want[0, ids_want[0, k - 1]] in np.delete(logits_want[0], ids_want[0, k - 1])
    (gr, gv), (ur, uv), (dr, dv) = experts
    res = np.random.default_rng(1).standard_normal((1, H)).astype(np.float32)
    y = res.copy()  # in place, as the residual stream is updated
    xn = np.full(H, np.nan, np.float32)
    lg = np.full(E, np.nan, np.float32)
    cnt = np.zeros(1, np.uint32)
    ids = np.full(k, -1, np.int32)
    w = np.full(k, np.nan, np.float32)
    act = np.full(k * F, np.nan, np.float32)
    args = ptrs(x, g, r, xn, lg, cnt, ids, w, gr, ur, dr, act, y)
    getattr(lib, f"run_{m.decode.fn}")(*args)
    assert cnt[0] == 0  # the routing block reset the hand-off counter for the next layer
    np.testing.assert_allclose(xn, xn_want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lg, logits_want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ids, ids_want[0])
    np.testing.assert_allclose(w, w_want[0], rtol=1e-5, atol=1e-7)
    node = Node("m", "Experts", ("x", "i", "w", "g", "u", "d"), ("y",), {}, "hipc")
    want = res + IMPLS["hipc::Experts"](node, [xn_want, ids_want, w_want, gv, uv, dv], None)[0]
    assert np.isfinite(y).all()
    if name in INT8:
        # x and act rounded to one int8 plane per 32 values: against NumPy's model of that
        # rounding (tight), and the exact result within what 8 bits allow
        rows = [(gv[e], uv[e], dv[e]) for e in ids_want[0]]
        x8 = int8_blocks(xn_want[0])
        act8 = [int8_blocks(silu(g @ x8) * (u @ x8)) for g, u, _ in rows]
        model = res[0] + sum(
            wj * (d @ a) for wj, (_, _, d), a in zip(w_want[0], rows, act8, strict=True)
        )
        assert rel_err(y[0], model) <= 2e-4, rel_err(y[0], model)
        assert 1e-3 < rel_err(y, want) <= 3e-2, rel_err(y, want)
        assert m.up_shared == H // 32 * XQ_BYTES["int8"]
        return
    # quantized experts see x and act as int8 hi + lo planes (~16 significant bits)
    assert rel_err(y, want) <= (1e-4 if wtype != "float32" else 1e-5), rel_err(y, want)
    assert m.up_shared in (0, H // 32 * XQ_BLOCK_BYTES)


def silu(v):
    return v / (1 + np.exp(-v))


def int8_blocks(v):
    """v rounded as the GPU stages it with int8 activations: per 32 values, d = max|v| / 127
    and round-half-even(v / d) * d."""
    b = np.asarray(v, np.float64).reshape(-1, 32)
    d = np.abs(b).max(1, keepdims=True) / 127
    return (np.rint(b / np.where(d > 0, d, 1)) * d).reshape(-1)


@pytest.mark.parametrize("T", [3, MAX_TOKENS])
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_route_on_the_host(lib, name, T):
    """Blocks of several tokens, the last one partly past T (what it must not touch)."""
    _wtype, E, k, H, *_ = CASES[name]
    m = lib.specs[name]
    x, g, r, xn_want, logits_want, ids_want, w_want, _ = make(name, T)
    xn = np.full((MAX_TOKENS, H), np.nan, np.float32)
    lg = np.full((MAX_TOKENS, E), np.nan, np.float32)
    cnt = np.zeros(1, np.uint32)
    ids = np.full((MAX_TOKENS, k), -1, np.int32)
    w = np.full((MAX_TOKENS, k), np.nan, np.float32)
    getattr(lib, f"run_{m.prefill.fn}")(T, *ptrs(x, g, r, xn, lg, cnt, ids, w))
    np.testing.assert_allclose(xn[:T], xn_want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lg[:T], logits_want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ids[:T], ids_want)
    np.testing.assert_allclose(w[:T], w_want, rtol=1e-5, atol=1e-7)
    assert np.isnan(xn[T:]).all() and (ids[T:] == -1).all()  # nothing past the T tokens
    assert m.prefill.ctx["route_tokens"] > 1
