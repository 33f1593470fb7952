"""The passes on a Gemma-2 graph, one at a time: what canonicalize rewrites must still run
to the same logits, and fuse / plan_memory must give the kernels and buffers the CPU
templates expect (sandwich norms inside the linear kernels, the residual stream in place).
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.passes.canonicalize import canonicalize
from hipc.compiler.passes.fuse import fuse
from hipc.compiler.passes.memory import plan_memory
from hipc.compiler.passes.repack import merge_parallel_linears
from hipc.compiler.passes.select import select_kernels
from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import build_graph, load_model

from support import TINY_GEMMA, write_tiny_hf


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = write_tiny_hf(tmp_path_factory.mktemp("g") / "g", **TINY_GEMMA["gemma2"])
    return build_graph(load_model(folder), 32)


def test_canonical_forms_run_like_the_built_graph(built):
    canonical = canonicalize(built)
    ops = canonical.op_histogram()
    assert ops["hipc::SoftCap"] == 1 and "Tanh" not in ops and "Div" not in ops
    # the (1 + w) scales are constants now: every Add left is a residual
    assert ops["Add"] == 2 * 2
    tokens = list(range(5, 22))
    want = ReferenceExecutor(built).logits(tokens)
    got = ReferenceExecutor(canonical).logits(tokens)
    assert float(np.max(np.abs(got - want)) / np.max(np.abs(want))) <= 1e-5


def test_fusion_and_memory(built):
    fusion = fuse(merge_parallel_linears(canonicalize(built)))
    # embedding, then per layer qkv, attention, o (+post-norm), gate/up, down (+post-norm)
    assert len(fusion.groups) == 1 + 5 * 2 + 1
    kernels = {k.group: k.params.context() for k in select_kernels(fusion)}
    assert kernels["embed.rows"]["scale"] == pytest.approx(48**0.5)
    o, down, gate_up = kernels["l0.o"], kernels["l1.down"], kernels["l0.gate+up"]
    assert o["epilogue"] == down["epilogue"] == "residual"
    assert o["post_norm_eps"] == down["post_norm_eps"] == pytest.approx(1e-5)
    assert gate_up["epilogue"] == "glu" and gate_up["act"] == "gelu_tanh"
    assert kernels["logits.raw"]["softcap"] == 4.0
    assert [kernels[f"l{i}.attn"]["window"] for i in range(2)] == [5, 0]
    assert all(kernels[f"l{i}.attn"]["softcap"] == 2.5 for i in range(2))
    memory = plan_memory(fusion, 8)
    # the post-normed residual adds write into one residual buffer
    streams = {memory.views[f"l{i}.{s}.residual"].buffer for i in range(2) for s in ("attn", "ffn")}
    assert streams == {memory.views["embed"].buffer}


def test_switches_at_their_default_leave_the_kernel_name_alone():
    # the Params fields other families never set must not reach the name digest or the
    # plan, or every existing model's kernels would be renamed (and caches missed)
    from hipc.compiler.kernels.base import kernel_name
    from hipc.compiler.kernels.linear import LinearParams

    base = dict(wtype="float32", N=64, K=48, norm_eps=1e-5, epilogue="residual", bias=False)
    plain = LinearParams(**base)
    assert set(plain.to_json()) == set(base) and plain.switched_on() == []
    capped = LinearParams(**base, post_norm_eps=1e-6)
    assert capped.switched_on() == ["post_norm_eps"] and "post_norm_eps" in capped.to_json()
    assert kernel_name("linear", capped) != kernel_name("linear", plain)
    assert plain.context()["act"] == "silu"
