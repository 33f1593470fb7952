"""A tiny Llama-family model's graph at each stage, for the pass tests."""

from __future__ import annotations

import pytest

from hipc.compiler.ir.verify import verify
from hipc.compiler.passes.canonicalize import canonicalize
from hipc.compiler.passes.repack import merge_parallel_linears
from hipc.graphs import build_graph, load_model

from support import write_tiny_hf

LAYERS = 2


@pytest.fixture(scope="module")
def layers() -> int:
    return LAYERS


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = write_tiny_hf(tmp_path_factory.mktemp("tiny") / "m", num_hidden_layers=LAYERS)
    return build_graph(load_model(folder), max_ctx=16)


@pytest.fixture(scope="module")
def canonical(built):
    return verify(canonicalize(built))


@pytest.fixture(scope="module")
def repacked(canonical):
    return verify(merge_parallel_linears(canonical))
