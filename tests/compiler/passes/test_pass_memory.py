"""plan_memory on its own: liveness checked by recomputing it from the groups."""

from __future__ import annotations

import pytest

from hipc.compiler.passes.fuse import fuse
from hipc.compiler.passes.memory import plan_memory

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def fusion(repacked):
    return fuse(repacked)


@pytest.fixture(scope="module")
def memory(fusion):
    return plan_memory(fusion, MAX_TOKENS)


def _live_ranges(fusion, memory) -> dict[str, tuple[int, int]]:
    """buffer -> (first group writing it, last group reading it), from the graph alone."""
    group_of = {n: i for i, g in enumerate(fusion.groups) for n in g.node_names}
    span: dict[str, list[int]] = {}
    for node in fusion.graph.nodes:
        here = group_of[node.name]
        for v in (*node.inputs, *node.outputs):
            view = memory.views.get(v)
            if view is None or view.buffer in memory.outputs:
                continue
            s = span.setdefault(view.buffer, [here, here])
            s[0], s[1] = min(s[0], here), max(s[1], here)
    return {b: (s[0], s[1]) for b, s in span.items()}


def test_buffers_live_at_once_never_overlap(fusion, memory):
    live = _live_ranges(fusion, memory)
    assert set(live) == set(memory.offsets)
    bufs = sorted(live)
    for i, a in enumerate(bufs):
        for b in bufs[i + 1 :]:
            (s1, e1), (s2, e2) = live[a], live[b]
            if s1 <= e2 and s2 <= e1:
                a0, b0 = memory.offsets[a], memory.offsets[b]
                assert a0 + memory.cols[a] <= b0 or b0 + memory.cols[b] <= a0, (a, b)
    for b in bufs:
        assert memory.offsets[b] >= 0 and memory.offsets[b] + memory.cols[b] <= memory.arena_cols


def test_the_residual_stream_is_one_buffer(fusion, memory, repacked):
    adds = [n for n in repacked.nodes if n.op == "Add"]
    assert adds
    buffers = {memory.views[n.outputs[0]].buffer for n in adds}
    # and the embedding writes into it: every layer updates it in place
    buffers.add(memory.views[fusion.groups[0].anchor.outputs[0]].buffer)
    assert len(buffers) == 1


def test_split_parts_are_column_views(memory, repacked):
    split = repacked.node("l0.q+k+v.split")
    views = [memory.views[o] for o in split.outputs]
    assert len({v.buffer for v in views}) == 1
    cols = [repacked.values[o].shape[1] for o in split.outputs]
    assert [v.col for v in views] == [0, cols[0], cols[0] + cols[1]]
    assert all(v.ld == sum(cols) for v in views)


def test_arena_is_smaller_than_every_value_apart(fusion, memory):
    total = sum(memory.cols.values())
    assert memory.arena_cols < total
    assert memory.arena_bytes == 4 * MAX_TOKENS * memory.arena_cols
