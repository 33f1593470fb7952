"""Sibling GEMVs (compiler/codegen/siblings.py, templates/hip/linear_gemv_siblings.hip.j2) run on
the host: quantized decode GEMVs of different weight types reading one x, each on its range of
one grid's blocks, compiled with HIPC_HOST_SIMT as test_gpu_gemv_host.py's kernels are, against
NumPy in float64 on gguf-py's dequantized weights. Every output starts as NaN, so a row that no
segment writes, or a segment that writes another's rows, fails. tests/gpu runs them on a GPU
(the compiled Q4_K_M-style models)."""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest
from test_gpu_prelude_host import aligned, blocks, gguf, stage_x

from hipc.compiler.codegen.siblings import render_siblings, segment_blocks
from hipc.compiler.kernels.linear import GEMV, LinearParams, QuantGemv, decode_gemv
from hipc.compiler.passes.repack import split_quant_blocks
from hipc.compiler.targets import GpuTarget

EPS = 1e-5
K = 2048

# name: [(wtype, rows, geometry)], every segment normalizing x (a q+k / v of Q4_K_M)
RUNS = {
    # Q4_K's 4-row groups beside Q6_K's 2-row rings: several groups a wave, rows past the end
    "q4_k_q6_k": [
        ("q4_k", 37, QuantGemv(2, 4, 1, 4, 1, 1)),
        ("q6_k", 13, QuantGemv(2, 2, 1, 4, 1, 3, 8)),
    ],
    # three types (the else-if chain), the 64-weight units in one
    "q4_k64_q8_0_q5_0": [
        ("q4_k", 21, QuantGemv(2, 2, 1, 5, 1, 2, unit64=True)),
        ("q8_0", 9, QuantGemv(2, 2, 2, 5, 1, 2)),
        ("q5_0", 17, QuantGemv(2, 2, 2, 5, 1, 1)),
    ],
}


@pytest.fixture(scope="module", params=["int16", "int8"])
def lib(request, tmp_path_factory):
    kernels: dict[str, str] = {}
    wrappers, specs = [], {}
    for name, run in RUNS.items():
        gemvs = []
        for i, (wtype, rows, geo) in enumerate(run):
            p = LinearParams(wtype, rows, K, EPS, "none", bias=False)
            gemvs.append((decode_gemv(f"{name}{i}", p, GpuTarget("sm_90"), [name], geo,
                                      request.param), GEMV))  # fmt: skip
        fn, grid = render_siblings(kernels, 32, gemvs)
        args = ", ".join(f"x, W{i}, g, nullptr, nullptr, y{i}" for i in range(len(run)))
        params = ", ".join(f"const void* W{i}, float* y{i}" for i in range(len(run)))
        wrappers.append(
            f'extern "C" void run_{name}(const float* x, const float* g, {params}) {{\n'
            f"  grid({grid}, 1, {gemvs[0][0].threads}, [=] {{ {fn}({args}); }}, "
            f"{gemvs[0][0].shared});\n}}"
        )
        specs[name] = [k for k, _ in gemvs]
    code = "\n".join(kernels.values()) + "\n" + "\n".join(wrappers)
    root = tmp_path_factory.mktemp("siblings")
    handle = host_simt.build(root, f"siblings_{request.param}", code)
    handle.specs, handle.activations = specs, request.param
    return handle


@pytest.mark.parametrize("name", sorted(RUNS))
def test_sibling_gemvs_on_the_host(lib, name):
    run = RUNS[name]
    counts = segment_blocks(lib.specs[name])
    for (_, rows, geo), n in zip(run, counts, strict=True):
        assert -(-rows // geo.rows) > n * geo.waves, "every segment streams several groups a wave"
    rng = np.random.default_rng(sorted(RUNS).index(name))
    x = (rng.standard_normal(K) * 3).astype(np.float32)
    x[rng.integers(0, K, 4)] *= 30
    g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    _, held = stage_x(x * g, lib.activations)
    inv = 1 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + EPS)
    keep, wants, ys, ptrs = [], [], [], []
    for wtype, rows, _ in run:
        raw = blocks(wtype, rows, K, rng)
        w = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, wtype.upper()))
        buf, ptr = aligned(split_quant_blocks(raw, wtype))
        keep.append(buf)
        wants.append(w.astype(np.float64) @ held * inv)
        ys.append(np.full(rows, np.nan, np.float32))
        ptrs += [ctypes.c_void_p(ptr), ys[-1].ctypes.data_as(ctypes.c_void_p)]
    f = ctypes.c_void_p
    getattr(lib, f"run_{name}")(x.ctypes.data_as(f), g.ctypes.data_as(f), *ptrs)
    for y, want in zip(ys, wants, strict=True):
        assert np.isfinite(y).all()
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_segment_blocks_share_the_budget_by_bytes():
    """The 8B Q4_K_M's q+k (Q4_K, 5120 rows, 80 blocks alone) and Q6_K v (1024 rows): q+k keeps
    its blocks, v streams in what is left of the 132 instead of its own 64 (144 in all would
    not be resident at once on an H200)."""
    target = GpuTarget("sm_90")
    qk = decode_gemv("a", LinearParams("q4_k", 5120, 4096, EPS, "none", False), target, ["a"],
                     activations="int8")  # fmt: skip
    v = decode_gemv("b", LinearParams("q6_k", 1024, 4096, EPS, "none", False), target, ["b"],
                    activations="int8")  # fmt: skip
    assert (qk.grid, v.grid) == ([80], [64])
    assert segment_blocks([qk, v]) == [80, 32]
    assert segment_blocks([v, qk]) == [32, 80]
