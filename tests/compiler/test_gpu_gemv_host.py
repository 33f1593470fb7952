"""The quantized decode GEMV (templates/hip/linear_gemv_q.hip.j2) run on the host: the
rendered kernel compiled by a plain C++ compiler with HIPC_HOST_SIMT (each block's threads in
step as host threads, the grid's blocks one after another), against NumPy in float64 on
gguf-py's dequantized weights and x as the kernel holds it (test_gpu_prelude_host.stage_x).
The geometries are small versions of the ones the H200 runs: waves streaming several row
groups, long rows in several batches, rings of 2-4 batch buffers whose last turn is partial,
rows past the end of the matrix. The outputs start as NaN, so an output no wave writes fails,
and each block's shared memory starts poisoned (the harness), so a block that read staged x
it did not write fails too.
The register kernels run again on blocks in GGUF's order (HIPC_QSPLIT 0); the bulk-copy
kernel (linear_gemv_qbulk) reads the split layout only.
tests/gpu runs the same kernels on a GPU.
"""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest
from test_gpu_prelude_host import aligned, blocks, gguf, stage_x

from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.linear import LinearParams, QuantGemv, QuantGemvBulk, decode_gemv
from hipc.compiler.passes.repack import split_quant_blocks
from hipc.compiler.targets import GpuTarget

EPS = 1e-5

# name: (wtype, N weight rows, K, epilogue, norm prologue, geometry)
CASES = {
    # 1-row groups, 3 rounds of a 2-stage ring, one batch per row (K 1024: 1 step per lane)
    "q4_0_rows1_norm": ("q4_0", 45, 1024, "none", True, QuantGemv(2, 1, 1, 4, 1, 2, 4)),
    # the rows pulled towards L2 before the wait (a no-op on the host: the indexing compiles)
    "q4_0_l2_glu": (
        "q4_0",
        2 * 21,
        1024,
        "glu",
        True,
        QuantGemv(2, 2, 1, 3, 2, 3, l2_prefetch=True),
    ),
    # K 2304: 72 units, 3 steps per lane, batches of 2 (the last half empty), 3 stages; x in
    # 9 staging rounds per thread, 8 loaded at once, then 1
    "q4_0_residual_k2304_s3": (
        "q4_0",
        23,
        2304,
        "residual",
        False,
        QuantGemv(2, 1, 2, 3, 1, 3, xq_chunk=8),
    ),
    # the residual of each wave's first group read before x is staged (early_res): ~4 groups
    # a wave, so the later groups' residuals come the usual way
    "q4_0_residual_early": (
        "q4_0",
        23,
        2304,
        "residual",
        False,
        QuantGemv(2, 1, 2, 3, 1, 3, xq_chunk=8, early_res=True),
    ),
    "q4_k64_rows2_early": (
        "q4_k",
        9,
        2048,
        "residual",
        False,
        QuantGemv(2, 2, 1, 2, 1, 2, 8, unit64=True, early_res=True),
    ),
    # the items after the ring pulled towards L2 after the wait (none past the wave's last)
    "q4_0_glu_after_prefetch": (
        "q4_0",
        2 * 23,
        1024,
        "glu",
        True,
        QuantGemv(2, 2, 2, 3, 1, 2, after_prefetch=3),
    ),
    "q6_k64_after_prefetch": (
        "q6_k",
        9,
        2048,
        "residual",
        False,
        QuantGemv(2, 2, 1, 2, 1, 2, unit64=True, after_prefetch=1),
    ),
    # gate/up pairs, 4 stages over 5 items per wave (the ring's last turn partial)
    "q4_1_glu_norm_s4": ("q4_1", 2 * 19, 1024, "glu", True, QuantGemv(2, 2, 1, 2, 1, 4)),
    # IQ4_NL: Q4_0's blocks, the nibbles looked up in its table
    "iq4_nl_glu_norm_s3": ("iq4_nl", 2 * 19, 1024, "glu", True, QuantGemv(2, 2, 1, 2, 1, 3)),
    "iq4_nl_residual_early": (
        "iq4_nl",
        23,
        2304,
        "residual",
        False,
        QuantGemv(2, 1, 2, 3, 1, 3, xq_chunk=8, early_res=True),
    ),
    "q8_0_rows2_residual": ("q8_0", 30, 2048, "residual", False, QuantGemv(2, 2, 1, 3, 1, 2)),
    # the K-quants' 128-weight units: 4-row groups, rows past the end (N 21)
    "q4_k_rows4_norm": ("q4_k", 21, 2048, "none", True, QuantGemv(2, 4, 1, 2, 1, 2)),
    "iq4_xs_rows4_norm": ("iq4_xs", 21, 2048, "none", True, QuantGemv(2, 4, 1, 2, 1, 2)),
    "iq4_xs_copy_glu": ("iq4_xs", 2 * 21, 2048, "glu", False, QuantGemv(2, 4, 1, 2, 1, 1)),
    # rows of one and two super-blocks (a 256-wide model's), QUANT_GEMV_KQUANT's shape
    "iq4_xs_k256_glu_norm": ("iq4_xs", 2 * 21, 256, "glu", True, QuantGemv(2, 4, 1, 3, 1, 1)),
    "iq4_xs_k512_residual": ("iq4_xs", 41, 512, "residual", False, QuantGemv(2, 4, 1, 3, 1, 1)),
    "q4_k_k256_glu_norm": ("q4_k", 2 * 21, 256, "glu", True, QuantGemv(2, 4, 1, 3, 1, 1)),
    "q6_k_glu_s3": ("q6_k", 2 * 9, 1536, "glu", False, QuantGemv(2, 2, 1, 2, 1, 3)),
    # Q3_K: rows of one super-block and of several, a ring whose last turn is partial
    "q3_k_k256_glu_norm": ("q3_k", 2 * 21, 256, "glu", True, QuantGemv(2, 2, 1, 3, 1, 4)),
    "q3_k_residual_s4": ("q3_k", 23, 2304, "residual", False, QuantGemv(2, 2, 1, 2, 1, 4, 8)),
    "q3_k_copy_rows4_norm": ("q3_k", 21, 1024, "none", True, QuantGemv(2, 4, 1, 2, 1, 1)),
    # Q5_K's 1-row rings (QUANT_GEMV_Q5_K's shape: of 2; of 3 before), the last turn partial
    "q5_k_rows1_s2_residual": ("q5_k", 23, 2304, "residual", False, QuantGemv(2, 1, 1, 2, 1, 2, 8)),
    "q5_k_rows1_s3_residual": ("q5_k", 23, 2304, "residual", False, QuantGemv(2, 1, 1, 2, 1, 3, 8)),
    "q5_k_rows1_s2_norm": ("q5_k", 13, 1024, "none", True, QuantGemv(2, 1, 1, 3, 1, 2, 8)),
    # Q2_K (mins per 16 against x's staged sums): a ring, a copy loop, a GLU pair
    "q2_k_residual_s3": ("q2_k", 23, 2304, "residual", False, QuantGemv(2, 2, 1, 2, 1, 3, 8)),
    "q2_k_copy_rows4_norm": ("q2_k", 21, 1024, "none", True, QuantGemv(2, 4, 1, 2, 1, 1)),
    "q2_k_k256_glu_norm": ("q2_k", 2 * 21, 256, "glu", True, QuantGemv(2, 2, 1, 3, 1, 4)),
    "q5_0_residual_s2": ("q5_0", 17, 1536, "residual", False, QuantGemv(2, 2, 2, 2, 1, 2)),
    # one stage: the next item's loads copied in at the end of each step
    "q4_k_copy_rows4": ("q4_k", 21, 2048, "residual", False, QuantGemv(2, 4, 1, 2, 1, 1)),
    # 64-weight K-quant units (bank-covering half order) in the register ring
    "q4_k64_ring_glu": (
        "q4_k",
        2 * 21,
        2048,
        "glu",
        True,
        QuantGemv(2, 2, 1, 2, 1, 3, unit64=True),
    ),
    "q6_k64_copy_rows4": (
        "q6_k",
        21,
        2048,
        "residual",
        False,
        QuantGemv(2, 4, 2, 2, 1, 1, unit64=True),
    ),
    # the down projections' default (QUANT_GEMV_K64) in small: 2-row rings of 2 units
    "q4_k64_ring2_k14336": (
        "q4_k",
        9,
        14336,
        "residual",
        False,
        QuantGemv(2, 2, 1, 2, 1, 2, 8, unit64=True),
    ),
    "q6_k64_ring2_k14336": (
        "q6_k",
        9,
        14336,
        "residual",
        False,
        QuantGemv(2, 2, 1, 2, 1, 2, 8, unit64=True),
    ),
    "q4_0_copy_k2304_glu": ("q4_0", 2 * 23, 2304, "glu", True, QuantGemv(2, 2, 2, 3, 1, 1)),
    # the bulk-copy GEMV (linear_gemv_qbulk): tiles through a ring of shared-memory stages,
    # several turns of the ring per block, the last tile partial (rows past the end); tiles
    # of fewer outputs than waves split each output's units over 2-4 waves
    "bulk_q4_0_residual": ("q4_0", 45, 2048, "residual", False, QuantGemvBulk(2, 4, 3, 3)),
    "bulk_q4_0_split2": ("q4_0", 45, 2048, "residual", False, QuantGemvBulk(4, 2, 3, 3)),
    "bulk_q4_0_glu_norm": ("q4_0", 2 * 21, 1024, "glu", True, QuantGemvBulk(2, 4, 2, 2)),
    "bulk_q4_0_glu_split2": ("q4_0", 2 * 21, 4096, "glu", True, QuantGemvBulk(2, 2, 2, 2)),
    "bulk_q4_k_norm": ("q4_k", 21, 2048, "none", True, QuantGemvBulk(2, 2, 3, 2)),
    # Q4_K in 64-weight units (K 2048: 32 units a row, one step per lane) and split over waves
    "bulk_q4_k64_glu": ("q4_k", 2 * 13, 2048, "glu", True, QuantGemvBulk(2, 4, 2, 2, unit64=True)),
    "bulk_q6_k64_residual": (
        "q6_k",
        23,
        2048,
        "residual",
        False,
        QuantGemvBulk(2, 3, 2, 2, unit64=True),
    ),
    "bulk_q6_k64_glu_split": (
        "q6_k",
        2 * 9,
        8192,
        "glu",
        True,
        QuantGemvBulk(4, 2, 3, 2, unit64=True),
    ),
    # rows whose units are not a multiple of a wave's 32 lanes (72 Q4_0 blocks, 48 Q4_K pairs)
    "bulk_q4_0_k2304": ("q4_0", 27, 2304, "none", True, QuantGemvBulk(2, 2, 3, 3)),
    "bulk_q4_k64_k3072": (
        "q4_k",
        2 * 15,
        3072,
        "glu",
        False,
        QuantGemvBulk(2, 2, 2, 3, unit64=True),
    ),
    "bulk_q4_k64_split": (
        "q4_k",
        19,
        4096,
        "residual",
        False,
        QuantGemvBulk(4, 2, 3, 3, unit64=True),
    ),
    # 2 outputs a wave at once: 5 outputs a tile over 2 waves (the last pass has one row)
    "bulk_q4_k_rw2": (
        "q4_k",
        23,
        2048,
        "residual",
        False,
        QuantGemvBulk(2, 5, 2, 2, rows_per_wave=2),
    ),
    "bulk_q4_0_glu_rw2": (
        "q4_0",
        2 * 22,
        1024,
        "glu",
        True,
        QuantGemvBulk(2, 6, 2, 2, rows_per_wave=2),
    ),
    "bulk_q5_k_residual": ("q5_k", 13, 1024, "residual", False, QuantGemvBulk(2, 2, 2, 2)),
    "bulk_iq4_nl_residual": ("iq4_nl", 13, 1024, "residual", False, QuantGemvBulk(2, 2, 2, 2)),
    "bulk_iq4_xs_norm": ("iq4_xs", 21, 2048, "none", True, QuantGemvBulk(2, 2, 3, 2)),
    "bulk_q6_k_glu_split2": ("q6_k", 2 * 9, 8192, "glu", False, QuantGemvBulk(2, 2, 4, 2)),
    "bulk_q8_0_norm": ("q8_0", 19, 512, "none", True, QuantGemvBulk(2, 3, 2, 2)),
}


def params(case) -> LinearParams:
    wtype, N, K, epilogue, norm, _ = case
    return LinearParams(wtype, N, K, EPS if norm else 0.0, epilogue, bias=False)


def build_cases(root, name: str, cases: dict, activations: str, defines: str = ""):
    kernels, wrappers, specs = [], [], {}
    for i, (case_name, case) in enumerate(cases.items()):
        k = decode_gemv(
            f"gemv{i}", params(case), GpuTarget("sm_90"), [case_name], case[5], activations
        )
        specs[case_name] = k
        kernels.append(render(f"hip/{k.template}.hip.j2", fn=k.fn, **k.ctx))
        wrappers.append(
            f'extern "C" void run_{k.fn}(const float* x, const void* W, const float* g, '
            f"const float* r, float* y) {{\n"
            f"  grid({k.grid[0]}, 1, {k.threads}, [=] {{ {k.fn}(x, W, g, nullptr, r, y); }}, "
            f"{k.shared});\n}}"
        )
    code = "\n".join(kernels) + "\n" + "\n".join(wrappers)
    handle = host_simt.build(root, name, code, defines=defines)
    handle.specs, handle.activations = specs, activations
    handle.layout = "gguf" if "HIPC_QSPLIT 0" in defines else "split"
    return handle


@pytest.fixture(scope="module", params=["int16", "int8"])
def lib(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("gemv")
    return build_cases(root, f"gemv_{request.param}", CASES, request.param)


# the register kernels again with the blocks in GGUF's order (an artifact that also holds the
# cpu target): narrow loads of the same fields (the bulk-copy GEMV needs the split layout)
GGUF_CASES = {n: c for n, c in CASES.items() if not isinstance(c[5], QuantGemvBulk)}


@pytest.fixture(scope="module")
def lib_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemv_gguf")
    return build_cases(root, "gemv_gguf", GGUF_CASES, "int8", "#define HIPC_QSPLIT 0\n")


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantized_gemv_on_the_host(lib, name):
    run_case(lib, name)


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_quantized_gemv_gguf_order_on_the_host(lib_gguf, name):
    run_case(lib_gguf, name)


def run_case(lib, name):
    wtype, N, K, epilogue, norm, geo = CASES[name]
    spec = lib.specs[name]
    if isinstance(geo, QuantGemvBulk):
        tiles = -(
            -(N // 2 if epilogue == "glu" else N) // (geo.tile_rows // (1 + (epilogue == "glu")))
        )
        assert tiles > spec.grid[0] * geo.stages, "every case turns the ring more than once"
    else:
        groups = -(
            -(N // 2 if epilogue == "glu" else N)
            // (geo.rows // 2 if epilogue == "glu" else geo.rows)
        )
        assert groups > spec.grid[0] * geo.waves, "every case streams several groups per wave"
    n_out = N // 2 if epilogue == "glu" else N
    rng = np.random.default_rng(sorted(CASES).index(name))
    raw = blocks(wtype, N, K, rng)
    w = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, wtype.upper()))
    stored = split_quant_blocks(raw, wtype) if lib.layout == "split" else raw
    _wbuf, wptr = aligned(stored)
    x = (rng.standard_normal(K) * 3).astype(np.float32)
    x[rng.integers(0, K, 4)] *= 30
    g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    r = rng.standard_normal(n_out).astype(np.float32)
    _, held = stage_x(x * g if norm else x, lib.activations)
    acc = w.astype(np.float64) @ held
    if norm:
        acc = acc / np.sqrt(np.mean(x.astype(np.float64) ** 2) + EPS)
    if epilogue == "glu":
        want = acc[:n_out] / (1 + np.exp(-acc[:n_out])) * acc[n_out:]
    else:
        want = acc + (r if epilogue == "residual" else 0.0)
    y = np.full(n_out, np.nan, np.float32)
    ptr = ctypes.c_void_p
    getattr(lib, f"run_{spec.fn}")(
        x.ctypes.data_as(ptr), ptr(wptr), g.ctypes.data_as(ptr) if norm else None,
        r.ctypes.data_as(ptr) if epilogue == "residual" else None, y.ctypes.data_as(ptr),
    )  # fmt: skip
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_gate_up_geometries_take_row_pairs():
    """A GLU group is a gate row and its up row: every geometry the table gives a gate/up
    matrix (the "glu" class, and the small classes, which take gate/up too) has rows >= 2."""
    from hipc.compiler.kernels import linear

    for (family, cls), g in linear.QUANT_GEMV_TABLE.items():
        if cls in ("small", "small_long", "glu"):
            assert g.rows >= 2 and g.rows % 2 == 0, (family, cls, g)


def test_bulk_default_follows_the_table(monkeypatch):
    """QUANT_GEMV_BULK picks the bulk-copy GEMV for its (type, class) on sm_90 in the split
    layout only; GGUF order, an AMD target or a row the copies cannot take keep the register
    kernel."""
    from hipc.compiler.kernels import linear

    monkeypatch.setitem(linear.QUANT_GEMV_BULK, ("q4_k", "short"), linear.BulkSpec(24, 4, 8, 2))
    p = LinearParams("q4_k", 4096, 4096, EPS, "none", bias=False)
    k = decode_gemv("a", p, GpuTarget("sm_90"), ["n"], activations="int8")
    assert k.template == "linear_gemv_qbulk"
    assert k.ctx["tile_rows"] == 8 and k.ctx["stages"] == 4 and k.grid == [132]
    assert decode_gemv("b", p, GpuTarget("sm_90"), ["n"], quant_layout="gguf").template == (
        "linear_gemv_q"
    )
    assert decode_gemv("c", p, GpuTarget("gfx942"), ["n"]).template == "linear_gemv_q"
    # 13 super-blocks a row: Q6_K's 2-byte d region is 26 bytes a row (Q4_K's regions, 128 and
    # 16 bytes a block, take any row)
    monkeypatch.setitem(linear.QUANT_GEMV_BULK, ("q6_k", "short"), linear.BulkSpec(24, 4, 8, 2))
    odd = LinearParams("q6_k", 4096, 3328, EPS, "none", bias=False)
    assert decode_gemv("d", odd, GpuTarget("sm_90"), ["n"]).template == "linear_gemv_q"
    odd4k = LinearParams("q4_k", 4096, 3328, EPS, "none", bias=False)
    assert decode_gemv("d", odd4k, GpuTarget("sm_90"), ["n"]).template == "linear_gemv_qbulk"
    glu = LinearParams("q4_k", 2 * 4096, 4096, EPS, "glu", bias=False)  # another class
    assert decode_gemv("e", glu, GpuTarget("sm_90"), ["n"]).template == "linear_gemv_q"


def test_bulk_env_adds_entries_for_benchmarks(monkeypatch):
    """HIPC_QUANT_GEMV_BULK adds QUANT_GEMV_BULK entries at compile time ("q": every
    32-weight type), so a benchmark can time the bulk-copy GEMV inside the decode graph, and
    refuses an entry it cannot read, naming it."""
    from hipc.base.errors import HipcError
    from hipc.compiler.kernels import linear

    monkeypatch.setenv(linear.BULK_ENV, "q:glu=16,4,8,2;q6_k:long=24,4,8,2,r2,k64")
    overrides = linear.bulk_overrides()
    assert overrides["q4_0", "glu"] == overrides["iq4_nl", "glu"] == linear.BulkSpec(16, 4, 8, 2)
    assert ("q4_k", "glu") not in overrides
    assert overrides["q6_k", "long"] == linear.BulkSpec(24, 4, 8, 2, 2, True)
    glu = LinearParams("q4_0", 2 * 14336, 4096, EPS, "glu", bias=False)
    assert decode_gemv("a", glu, GpuTarget("sm_90"), ["n"]).template == "linear_gemv_qbulk"
    short = LinearParams("q4_0", 6144, 4096, EPS, "none", bias=False)
    assert decode_gemv("b", short, GpuTarget("sm_90"), ["n"]).template == "linear_gemv_q"
    for bad in (
        "q:wide=16,4,8,2",
        "q8_k:glu=16,4,8,2",
        "q:glu=16,4,8",
        "q:glu=16,4,8,x",
        "q:glu=16,4,8,2,r",
        "q:glu=16,4,8,2,r1,r2",
        "q:glu=16,4,8,2,z",
    ):
        monkeypatch.setenv(linear.BULK_ENV, bad)
        with pytest.raises(HipcError, match="HIPC_QUANT_GEMV_BULK: bad entry"):
            linear.bulk_overrides()


def test_quant_gemv_classes():
    """The Llama-3-8B and SmolLM2 matrices fall in the QUANT_GEMV_TABLE classes its comment
    names: the 8B's qkv "short", o "narrow", gate/up "glu", down "long" (K 14336), matrices under
    4 MiB "small" or, with rows of 1536 and more, "small_long"; K-quants and Q6_K each their
    own family."""
    from hipc.compiler.kernels.linear import gemv_class, quant_gemv

    assert gemv_class("q4_0", 6144, 4096, False) == ("q", "short")
    assert gemv_class("q4_0", 4096, 4096, False) == ("q", "narrow")
    assert gemv_class("q8_0", 2 * 14336, 4096, True) == ("q", "glu")
    assert gemv_class("q4_0", 4096, 14336, False) == ("q", "long")
    assert gemv_class("q4_1", 960, 576, False) == ("q", "small")
    assert gemv_class("q4_1", 576, 1536, False) == ("q", "small_long")
    assert gemv_class("q4_1", 2 * 1536, 576, True) == ("q", "small")
    assert gemv_class("q5_k", 5120, 4096, False) == ("q5_k", "short")
    assert gemv_class("q4_k", 4096, 14336, False) == ("q4_k", "long")
    assert gemv_class("q6_k", 1024, 4096, False) == ("q6_k", "small_long")  # 3.4 MB
    assert gemv_class("q6_k", 128256, 4096, False) == ("q6_k", "short")
    # the Q4_K o takes the 64-weight units that lost on the Q4_K qkv (session 10)
    assert quant_gemv("q4_k", 4096, 4096).unit64
    assert not quant_gemv("q4_k", 6144, 4096).unit64


def test_decode_gemv_follows_the_geometry_table(monkeypatch):
    """decode_gemv renders what QUANT_GEMV_TABLE gives the matrix's class (and only that
    class), with q8_0's unroll halved (its blocks are twice the bytes) and Q5_0's copy loop of
    4 units; quant_gemv's `table` replaces the table whole."""
    from dataclasses import replace

    from hipc.compiler.kernels import linear

    p = LinearParams("q4_0", 4096, 14336, 0.0, "residual", bias=False)
    assert linear.quant_gemv("q4_0", 4096, 14336) == linear.QUANT_GEMV_LARGE_DOWN
    assert decode_gemv("a", p, GpuTarget("sm_90"), ["n"], activations="int8").ctx["early_res"]
    # a down projection without a residual to read has nothing to read early
    plain = replace(p, epilogue="none")
    assert not decode_gemv("a", plain, GpuTarget("sm_90"), ["n"], activations="int8").ctx[
        "early_res"
    ]
    down = QuantGemv(8, 2, 4, 132, 2, 3, 8, l2_prefetch=True)
    monkeypatch.setitem(linear.QUANT_GEMV_TABLE, ("q", "long"), down)
    p = LinearParams("q4_0", 4096, 14336, 0.0, "residual", bias=False)
    k = decode_gemv("a", p, GpuTarget("sm_90"), ["n"], activations="int8", quant_layout="gguf")
    assert (k.threads, k.ctx["unroll"], k.ctx["stages"], k.ctx["l2_prefetch"]) == (256, 4, 3, True)
    # the L2 pull's addresses are the split layout's: none in GGUF order
    pull = replace(down, after_prefetch=2)
    for layout, want in (("split", 2), ("gguf", 0)):
        g = decode_gemv("a", p, GpuTarget("sm_90"), ["n"], pull, "int8", quant_layout=layout)
        assert g.ctx["after_prefetch"] == want, layout
    assert k.ctx["min_blocks"] == 2 and k.grid == [128]  # 2048 groups: 2 per wave
    assert linear.quant_gemv("q8_0", 4096, 14336) == replace(down, unroll=2)
    assert linear.quant_gemv("q5_0", 4096, 14336) == replace(down, unroll=2, stages=1)
    o = linear.quant_gemv("q4_0", 4096, 4096)
    assert o == linear.QUANT_GEMV_LARGE and not o.l2_prefetch
    table = {**linear.QUANT_GEMV_TABLE, ("q", "narrow"): down}
    assert linear.quant_gemv("q4_0", 4096, 4096, table=table) == down
    assert linear.quant_gemv("q4_0", 6144, 4096, table=table) == linear.QUANT_GEMV_LARGE


def test_kquant_down_projections_take_64_weight_units():
    """Q4_K and Q6_K matrices of the "long" class (the 8B's down) get QUANT_GEMV_K64 with the
    residual read early, rendered with the 64-weight units, and the Q4_K o ("narrow") the same
    without it; Q5_K, which has no such unit, and the other classes keep theirs."""
    from hipc.compiler.kernels import linear

    for wtype in ("q4_k", "q6_k"):
        assert linear.quant_gemv(wtype, 4096, 14336) == linear.QUANT_GEMV_K64_DOWN
        p = LinearParams(wtype, 4096, 14336, 0.0, "residual", bias=False)
        k = decode_gemv("a", p, GpuTarget("sm_90"), ["n"], activations="int8")
        assert k.ctx["unit"] == f"{wtype}64" and k.threads == 16 * 32
        assert k.ctx["early_res"]
    assert linear.quant_gemv("q5_k", 4096, 14336) == linear.QUANT_GEMV_Q5_K
    assert linear.quant_gemv("q5_k", 2 * 14336, 4096, glu=True) == linear.QUANT_GEMV_KQUANT
    assert linear.quant_gemv("q4_k", 4096, 4096) == linear.QUANT_GEMV_K64
    assert linear.quant_gemv("q4_k", 6144, 4096) == linear.QUANT_GEMV_KQUANT
    assert linear.quant_gemv("q6_k", 4096, 4096) == linear.QUANT_GEMV_Q6_K
    assert linear.quant_gemv("q6_k", 128256, 4096) == linear.QUANT_GEMV_Q6_K


def test_table_env_replaces_entries_for_benchmarks(monkeypatch):
    """HIPC_QUANT_GEMV_TABLE replaces the named QUANT_GEMV_TABLE entries at compile time (so a
    benchmark can time a geometry inside the decode graph), leaves the rest, and refuses an
    entry it cannot read, naming it."""
    from hipc.base.errors import HipcError
    from hipc.compiler.kernels import linear

    monkeypatch.setenv(linear.TABLE_ENV, "q:narrow=8,2,2,128,1,4,8;q4_k:long=16,2,1,64,1,4,8,k64")
    assert linear.quant_gemv("q4_0", 4096, 4096) == QuantGemv(8, 2, 2, 128, 1, 4, 8)
    assert linear.quant_gemv("q4_k", 4096, 14336) == QuantGemv(16, 2, 1, 64, 1, 4, 8, unit64=True)
    assert linear.quant_gemv("q4_0", 6144, 4096) == linear.QUANT_GEMV_LARGE
    monkeypatch.setenv(
        linear.TABLE_ENV, "q:narrow=16,2,2,132,1,3,8,p1,r,l;q4_k:long=8,2,1,64,1,4,8,p2,k64"
    )
    assert linear.quant_gemv("q4_0", 4096, 4096) == QuantGemv(
        16, 2, 2, 132, 1, 3, 8, preload=1, early_res=True, l2_prefetch=True
    )
    assert linear.quant_gemv("q4_k", 4096, 14336) == QuantGemv(
        8, 2, 1, 64, 1, 4, 8, preload=2, unit64=True
    )
    monkeypatch.setenv(linear.TABLE_ENV, "q:long=16,2,2,132,1,3,8,a2,r")
    assert linear.quant_gemv("q4_0", 4096, 14336) == QuantGemv(
        16, 2, 2, 132, 1, 3, 8, early_res=True, after_prefetch=2
    )
    # the down's shared memory: x's staged planes, on either family
    down = LinearParams("q4_0", 4096, 14336, 0.0, "residual", bias=False)
    for target in ("sm_90", "gfx942"):
        k = decode_gemv("a", down, GpuTarget(target), ["n"], activations="int8")
        assert k.shared == linear.xq_bytes(14336, "int8")
    for bad in (
        "q:narrow=8,2,2,128,1,4,8,a",
        "q:narrow=8,2,2,128,1,4,8,a1,a2",
        "q:narrow=8,2,2",
        "q:wide=8,2,2,128,1,4,8",
        "q:narrow=8,2,2,128,1,4,x",
        "q:narrow=8,2,2,128,1,4,8,p",
        "q:narrow=8,2,2,128,1,4,8,p1,p2",
        "q:narrow=8,2,2,128,1,4,8,k64,k64",
        "q:narrow=8,2,2,128,1,4,8,q",
        "q:narrow=8,2,2,128,1,4,8,r,r",
        "q:narrow=8,2,2,128,1,4,8,l,l",
    ):
        monkeypatch.setenv(linear.TABLE_ENV, bad)
        with pytest.raises(HipcError, match="HIPC_QUANT_GEMV_TABLE: bad entry"):
            linear.quant_gemv("q4_0", 4096, 4096)
