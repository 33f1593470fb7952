"""lanes: which weights the CPU stores in row lanes, and the compiled program reading them.

The kernels themselves are checked against gguf-py in test_cpu_kernels.py (test_lanes_*)."""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.kernels.base import SelectedKernel
from hipc.compiler.kernels.embedding import EmbeddingParams
from hipc.compiler.kernels.linear import LinearParams
from hipc.compiler.kernels.moe import MoEParams
from hipc.compiler.options import CompileOptions
from hipc.compiler.passes.lanes import (
    fifth_form,
    lane_types,
    lanes_weights,
    lay_out_lanes,
)
from hipc.compiler.passes.repack import (
    FIFTH_FORMS,
    FIFTH_TYPES,
    LANE_BLOCKS,
    LANE_KQUANTS,
    LANE_TYPES,
    lane_quant_blocks,
    unlane_quant_blocks,
)
from hipc.compiler.pipeline import compile_model
from hipc.compiler.reference.engine import ReferenceEngine
from hipc.compiler.toolchains.cpu import cpu_flags
from hipc.graphs import load_model
from hipc.runtime.engine import load_engine

gguf_writer = pytest.importorskip("gguf_writer")

AVX512 = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")


@pytest.mark.parametrize("fifth", FIFTH_FORMS)
@pytest.mark.parametrize("dtype", LANE_TYPES)
def test_lanes_hold_every_byte_of_the_blocks(dtype, fifth):
    """The layout is a permutation of the file's bytes (plus zero rows to 16): undone exactly,
    for a lone block, an unpaired last block and partial row groups (K-quants: super-blocks),
    in either arrangement of the fifth bits (which only the Q5 types' lanes differ by)."""
    rng = np.random.default_rng(3)
    size = LANE_BLOCKS[dtype][0] if dtype in LANE_BLOCKS else LANE_KQUANTS[dtype]
    for rows, nb in ((1, 1), (17, 3), (40, 18), (16, 2)):
        raw = rng.integers(0, 256, (rows, nb * size), dtype=np.uint8)
        lanes = lane_quant_blocks(raw, dtype, fifth)
        assert lanes.shape == (-(-rows // 16) * 16, nb * size)
        np.testing.assert_array_equal(unlane_quant_blocks(lanes, dtype, rows, fifth), raw)
        other = lane_quant_blocks(raw, dtype, "masks" if fifth == "bytes" else "bytes")
        assert (dtype in FIFTH_TYPES) == (not np.array_equal(other, lanes))


@pytest.mark.parametrize("dtype", FIFTH_TYPES)
def test_fifth_bits_as_bytes_hold_chunk_j_at_bit_j(dtype):
    """The AVX2 arrangement (linear_lanes_avx2.h lane2_nibbles reads it): a block whose only
    fifth bit is row r's element e has one bit set, bit j of byte 4r + i of its fifth region,
    where e is element i of chunk j (chunk_elem(j) = 16 (j & 1) + 4 (j >> 1))."""
    size = LANE_BLOCKS[dtype][0] if dtype in LANE_BLOCKS else LANE_KQUANTS[dtype]
    nb = 1
    for r, j, i in ((0, 0, 0), (5, 3, 2), (15, 7, 3), (9, 4, 1)):
        e = 16 * (j & 1) + 4 * (j >> 1) + i
        raw = np.zeros((16, nb * size), np.uint8)
        if dtype == "q5_k":  # bit u of qh[l]: the fifth bit of unit u's element l (unit 0 here)
            raw[r, 16 + e] = 1
            at = 256  # the cell's head; unit 0's fifth bits first
        else:  # qh (a u32 after d, or d and m): bit e
            qh = LANE_BLOCKS[dtype][2]
            raw[r, qh + e // 8] = 1 << (e % 8)
            at = 16 * (LANE_BLOCKS[dtype][3][1])  # the block's quants first
        fifth = lane_quant_blocks(raw, dtype, "bytes").reshape(-1)[at : at + 64]
        want = np.zeros(64, np.uint8)
        want[4 * r + i] = 1 << j
        np.testing.assert_array_equal(fifth, want)


def test_lanes_only_for_a_cpu_alone_with_their_kernels():
    """Every type with AVX512-VNNI or AVX2 (linear_lanes_avx2.h), none on a plain x86-64 or
    beside a GPU target."""
    assert lane_types(("cpu",), AVX512) == LANE_TYPES
    assert lane_types(("cpu",), (*AVX512[:-1], "avx512vnni")) == LANE_TYPES
    assert lane_types(("cpu",), ("avx2", "fma", "f16c")) == LANE_TYPES
    assert lane_types(("cpu",), (*AVX512[:-1], "fma", "f16c")) == LANE_TYPES  # no VNNI: AVX2's
    assert lane_types(("cpu",), ("sse4_2", "fma", "f16c")) == ()
    assert lane_types(("cpu", "sm_90"), AVX512) == ()  # one copy of the weights serves both


def test_fifth_bits_arranged_for_the_kernels_of_the_isa():
    """AVX512-VNNI's kernels take a chunk's fifth bits as a k-mask, the AVX2 ones (AVX512
    without VNNI included: its build is linear_lanes_avx2.h's) as bytes."""
    assert fifth_form(AVX512) == "masks"
    assert fifth_form((*AVX512[:-1], "fma", "f16c")) == "bytes"
    assert fifth_form(("avx2", "fma", "f16c")) == "bytes"


def test_lanes_off_with_hipc_cpu_lanes_0(monkeypatch):
    """The benchmarks' A/B switch (bench_cpu_kquant_lanes.sh): the file's blocks everywhere."""
    monkeypatch.setenv("HIPC_CPU_LANES", "0")
    assert lane_types(("cpu",), AVX512) == ()
    monkeypatch.setenv("HIPC_CPU_LANES", "1")
    assert lane_types(("cpu",), AVX512) == LANE_TYPES


class _Kind:
    def __init__(self, name: str) -> None:
        self.name = name


def _kernel(kind: str, weight: str, arg: str = "w") -> SelectedKernel:
    params = (
        EmbeddingParams("q8_0", 64, 160)
        if kind == "embedding"
        else LinearParams("q8_0", 64, 64, 0.0, "none", False)
    )
    return SelectedKernel(kind, [kind], _Kind(kind), params, {arg: ("weight", weight)})


def _moe(gate: str, down: str) -> SelectedKernel:
    params = MoEParams("q4_0", E=4, top_k=2, H=64, F=48, normalize=True, fused_gate_up=True,
                       residual=True, down_wtype="q2_k")  # fmt: skip
    refs = {"gate": ("weight", gate), "up": ("weight", gate), "down": ("weight", down)}
    return SelectedKernel("moe", ["moe"], _Kind("moe"), params, refs)


def test_a_weight_moves_to_lanes_only_when_every_reader_takes_them():
    kernels = [
        _kernel("embedding", "tied"),  # a tied output matrix: gather and Linear
        _kernel("linear", "tied"),
        _kernel("linear", "alone"),
        _kernel("embedding", "table"),  # a gather alone keeps the file's blocks
        _kernel("linear", "shared"),
        _kernel("deltanet", "shared", arg="w"),  # a reader with no lanes form
        _kernel("linear", "float"),
        _moe("gate_up", "down_q2k"),  # Q4_0 gate/up experts move, Q2_K downs have no lanes
        _moe("gate_up_17", "down_q80"),  # gate/up experts of 2 x 17 rows: the offsets would move
    ]
    dtypes = {
        "tied": "q8_0",
        "alone": "q5_0",
        "table": "q8_0",
        "shared": "q5_1",
        "float": "f32",
        "gate_up": "q4_0",
        "down_q2k": "q2_k",
        "gate_up_17": "q4_0",
        "down_q80": "q8_0",
    }
    shapes = {w: (64, 64) for w in dtypes} | {"gate_up": (4, 96, 64), "down_q2k": (4, 64, 48),
              "gate_up_17": (4, 34, 64), "down_q80": (4, 64, 48)}  # fmt: skip
    out = lay_out_lanes(kernels, dtypes, shapes)
    assert lanes_weights(out) == {"tied", "alone", "gate_up", "down_q80"}
    assert [k.params.layout for k in out] == ["lanes"] * 3 + ["gguf"] * 4 + ["lanes", "gguf"]
    assert [k.params.down_layout for k in out[-2:]] == ["gguf", "lanes"]


@pytest.mark.skipif(not lane_types(("cpu",), cpu_flags()), reason="no AVX2 or AVX512-VNNI here")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_compiled_lanes_against_the_reference(qtype, tmp_path):
    """A tied model (the Linear and the embedding gather read one lanes matrix), rows that
    are not a multiple of 16 (vocab 160, k/v 32): decode and prefill against the reference."""
    path = gguf_writer.write_numpy_gguf(tmp_path / "m.gguf", qtype, tied=True)
    compile_model(path, tmp_path / "m.hipc", CompileOptions(max_context=32), verbose=False)
    engine = load_engine(tmp_path / "m.hipc")
    layouts = {w["name"]: w.get("layout") for w in engine.artifact.plan["weights"]}
    assert layouts["token_embd.weight"] == "lanes"
    assert all(v in ("lanes", None) for v in layouts.values()), layouts
    tokens = np.random.default_rng(4).integers(0, engine.vocab_size, 12).tolist()
    want = ReferenceEngine(load_model(path), 32).logits(tokens, 0)
    got = engine.logits(tokens)  # prefill: the slab GEMM
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
    engine.reset()
    for i, t in enumerate(tokens):  # decode: the GEMV, one token a step
        row = engine.forward([t], i)
        assert np.abs(row - want[i]).max() <= 1e-3 * np.abs(want[i]).max(), i


@pytest.mark.parametrize("mix", ["q3_k", "q4_k", "q5_k", "q6_k", "q4_k_m"])
def test_compiled_kquant_lanes_against_the_reference(mix, tmp_path):
    """The K-quants in row lanes (linear_lanes_k.h; AVX2: linear_lanes_avx2.h), tied
    as SmolLM2's file (the gather reads the lanes matrix too); q4_k_m: Q4_K matrices with Q6_K v, down and embedding, as
    llama-quantize mixes them. Decode (the GEMV) and prefill (the slab GEMMs) against the
    reference."""

    def types(name: str) -> str:
        if mix != "q4_k_m":
            return mix
        return "q6_k" if any(p in name for p in ("attn_v", "ffn_down", "token_embd")) else "q4_k"

    if (mix if mix != "q4_k_m" else "q4_k") not in lane_types(("cpu",), cpu_flags()):
        pytest.skip(f"no {mix} row-lanes kernels here")
    path = gguf_writer.write_numpy_gguf(
        tmp_path / "m.gguf", hidden=256, ffn=512, types=types, tied=True
    )
    compile_model(path, tmp_path / "m.hipc", CompileOptions(max_context=32), verbose=False)
    engine = load_engine(tmp_path / "m.hipc")
    plan = engine.artifact.plan["weights"]
    lanes = {w["dtype"] for w in plan if w.get("layout") == "lanes"}
    assert lanes == ({"q4_k", "q6_k"} if mix == "q4_k_m" else {mix}), plan
    tokens = np.random.default_rng(5).integers(0, engine.vocab_size, 12).tolist()
    want = ReferenceEngine(load_model(path), 32).logits(tokens, 0)
    got = engine.logits(tokens)
    # the AVX2 kernels (those taking the "bytes" fifth bits) prefill on the GEMV's kernel:
    # the GEMV's bound (below)
    gemv_prefill = fifth_form(cpu_flags()) == "bytes"
    assert np.abs(got - want).max() <= (2e-3 if gemv_prefill else 1e-3) * np.abs(want).max()
    engine.reset()
    for i, t in enumerate(tokens):  # (the GEMV rounds x to int16 by 32639, not 32767: on this
        # model's Q5_K the file's GEMV is off by up to 7e-4, this one by up to 1.4e-3, each
        # token its own; the two differ by as much as either from the reference)
        row = engine.forward([t], i)
        assert np.abs(row - want[i]).max() <= 2e-3 * np.abs(want[i]).max(), i
