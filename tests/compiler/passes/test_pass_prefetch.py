"""passes/prefetch.py: a quantized decode GEMV given the next GEMV's weight to pull towards L2."""

from __future__ import annotations

from itertools import pairwise

import pytest

from hipc.base.errors import HipcError
from hipc.compiler.kernels.base import SelectedKernel
from hipc.compiler.kernels.linear import QUANT_TYPES, LinearParams
from hipc.compiler.options import CompileOptions
from hipc.compiler.passes.prefetch import (
    ENV,
    link_prefetches,
    next_spans,
    prefetch_available,
    prefetch_table,
)

from gguf_writer import write_numpy_gguf

MIB = 1 << 20


class _Kind:
    def __init__(self, name: str) -> None:
        self.name = name


def _linear(w: str, wtype: str, N: int, K: int, epilogue: str = "none") -> SelectedKernel:
    p = LinearParams(wtype, N, K, 0.0, epilogue, False)
    return SelectedKernel(w, [w], _Kind("linear"), p, {"w": ("weight", w)})


def test_spans_are_the_heads_of_the_rows_the_next_gemv_reads_first():
    q = QUANT_TYPES["q4_0"]
    down = LinearParams("q4_0", 4096, 14336, 0.0, "residual", False)
    assert next_spans(down, 8) == (0, 8 * MIB)
    gate_up = LinearParams("q4_0", 28672, 4096, 1e-5, "glu", False)
    half = 14336 * (4096 // 32) * q.quant_bytes  # the up rows' quants start here
    assert next_spans(gate_up, 16) == (0, 8 * MIB, half, 8 * MIB)
    # the file's blocks: whole blocks per row, so the up half starts later
    assert next_spans(gate_up, 16, "gguf") == (0, 8 * MIB, half // 16 * 18, 8 * MIB)
    small = LinearParams("q4_0", 64, 64, 0.0, "none", False)
    assert next_spans(small, 8) == (0, 64 * 2 * 16)  # never past the rows' region
    assert LinearParams("q4_0", 8, 8, 0.0, "none", False, next_pf=(0, 5, 9, 7)).prefetch_spans == (
        (0, 5),
        (9, 7),
    )


def test_each_gemv_of_a_budgeted_class_gets_the_next_quantized_linear():
    o = _linear("o", "q4_0", 4096, 4096, "residual")
    attention = SelectedKernel("attn", ["attn"], _Kind("attention"), None, {})
    kernels = [
        _linear("qkv", "q4_0", 6144, 4096),
        attention,
        o,
        _linear("gate_up", "q4_0", 28672, 4096, "glu"),
        _linear("down", "q4_0", 4096, 14336, "residual"),
        _linear("head", "bfloat16", 1000, 4096),  # not quantized: never a target
    ]
    assert link_prefetches(kernels, {}) == kernels
    out = link_prefetches(kernels, {("q", "narrow"): 16, ("q", "long"): 4})
    by = {k.group: k for k in out}
    assert by["o"].refs["pf"] == ("weight", "gate_up")
    assert by["o"].params.next_pf == next_spans(kernels[3].params, 16)
    assert "pf" not in by["qkv"].refs and not by["qkv"].params.next_pf  # class "short"
    assert "pf" not in by["down"].refs  # nothing quantized after it
    assert by["attn"] is attention and "_pf" in by["o"].fn and "_pf" not in kernels[2].fn


def test_the_table_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "q:narrow=16;q4_k:glu=2.5")
    assert prefetch_table()[("q", "narrow")] == 16 and prefetch_table()[("q4_k", "glu")] == 2.5
    monkeypatch.setenv(ENV, "q:narrow=lots")
    with pytest.raises(HipcError, match=f"{ENV}: bad entry 'q:narrow=lots'"):
        prefetch_table()


def test_only_where_kernels_overlap():
    assert prefetch_available(("sm_90",)) and prefetch_available(("cpu", "sm_100"))
    assert not prefetch_available(("cpu",)) and not prefetch_available(("sm_80", "gfx942"))


def _program(path, tmp_path, targets):
    from hipc.cache.store import KernelCache
    from hipc.compiler.pipeline import Compilation, stages
    from hipc.compiler.targets import target

    ts = [target(t) for t in targets]
    options = CompileOptions(targets=targets, max_context=64, max_tokens=8)
    c = Compilation(path, tmp_path / "m.hipc", options, ts, KernelCache(tmp_path / "cache"))
    for stage in stages(ts):
        stage.run(c)
        if stage.name == f"render {targets[-1]}":
            return c
    raise AssertionError("no render stage")


def test_compiled_decode_passes_the_next_weight(tmp_path, monkeypatch):
    """A quantized model for sm_90 with every small GEMV prefetching: each decode GEMV but the
    last passes the next GEMV's weight as its last argument, and the sm_90 source pulls it
    towards L2 before the wait; gfx942 in the same artifact takes the argument unused."""
    monkeypatch.setenv(ENV, "q:small=0.001")
    path = write_numpy_gguf(tmp_path / "m.gguf", "Q4_0", hidden=64, ffn=128)
    c = _program(path, tmp_path, ("sm_90", "gfx942"))
    for arch in ("sm_90", "gfx942"):
        decode = c.programs[arch].plan["steps"]["decode"]
        gemvs = [x for x in decode if x["kernel"].endswith("_gemv")]
        pf = [x for x in gemvs if "_pf_" in x["kernel"]]
        assert len(pf) == len(gemvs) - 1, [x["kernel"] for x in gemvs]
        for a, b in pairwise(gemvs):
            w_next = next(arg for arg in b["args"] if arg["kind"] == "weight")
            assert a["args"][-1] == w_next == {"kind": "weight", "index": w_next["index"]}
    sm90, amd = c.programs["sm_90"].source, c.programs["gfx942"].source
    assert "hipc_prefetch_l2((const char*)pf + 0 + o);" in sm90
    assert "const char* __restrict__ pf" in amd and "(const char*)pf +" not in amd
