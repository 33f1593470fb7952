"""repack on its own: what merges, and what a norm read by several Linears becomes."""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.passes.canonicalize import canonicalize
from hipc.compiler.passes.fuse import fuse
from hipc.compiler.passes.repack import merge_parallel_linears
from hipc.compiler.passes.select import select_kernels
from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import build_graph, load_model

gguf_writer = pytest.importorskip("gguf_writer")


def _mixed_graph(tmp_path):
    """attn_v in Q8_0, attn_q/attn_k in Q4_K (as llama.cpp's Q4_K_M may store them)."""
    path = gguf_writer.write_numpy_gguf(
        tmp_path / "m.gguf",
        hidden=256,
        ffn=512,
        types=lambda n: "q8_0" if n.endswith(("attn_v.weight", "token_embd.weight")) else "q4_k",
    )
    return canonicalize(build_graph(load_model(path), max_ctx=16))


def test_mixed_types_split_the_shared_norm(tmp_path):
    graph = _mixed_graph(tmp_path)
    out = merge_parallel_linears(graph)
    linears = {n.name: n for n in out.nodes if n.op == "hipc::Linear"}
    assert "l0.q+k" in linears and "l0.v" in linears  # one storage type per merged Linear
    norms = [n for n in out.nodes if n.op == "RMSNormalization" and n.name.startswith("l0.attn")]
    assert sorted(n.name for n in norms) == ["l0.attn_norm", "l0.attn_norm@l0.v"]
    for n in norms:
        (reader,) = out.consumers(n.outputs[0])
        assert reader.op == "hipc::Linear"
    # every norm now fuses into its Linear: no lone RMSNorm group is left for select
    fusion = fuse(out)
    assert all(g.kind != "rmsnorm" for g in fusion.groups)
    select_kernels(fusion)
    # and the rewritten graph computes what the original does (float64: only the sums'
    # order differs between one wide matmul and two)
    tokens = list(range(5, 12))
    want = ReferenceExecutor(graph, dtype="float64").logits(tokens)
    got = ReferenceExecutor(out, dtype="float64").logits(tokens)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
