"""repack on its own: parallel Linears over one input become one Linear + Split."""

from __future__ import annotations

import numpy as np

from hipc.compiler.ir import PackedWeight
from hipc.compiler.source.reader import WeightReader


def test_qkv_and_gate_up_are_merged(canonical, repacked, layers):
    hist = repacked.op_histogram()
    # per layer: q+k+v, o, gate+up, down; plus the LM head
    assert hist["hipc::Linear"] == 4 * layers + 1
    assert hist["Split"] == 2 * layers
    split = repacked.node("l0.q+k+v.split")
    assert split.outputs == ("l0.q", "l0.k", "l0.v")
    # the Split names the old outputs again, so every reader downstream is untouched
    for name in split.outputs:
        assert repacked.values[name] == canonical.values[name]


def test_packed_rows_are_the_parts_concatenated(canonical, repacked):
    reader = WeightReader()
    lin = repacked.producer("l0.q+k+v")
    packed = repacked.initializers[lin.inputs[1]]
    assert isinstance(packed, PackedWeight)
    parts = [
        canonical.initializers[canonical.producer(v).inputs[1]] for v in ("l0.q", "l0.k", "l0.v")
    ]
    assert list(packed.parts) == parts
    whole = reader.value(packed)
    expected = np.concatenate([reader.value(p) for p in parts])
    np.testing.assert_array_equal(whole, expected)
    sizes = list(repacked.node("l0.q+k+v.split").attrs["split"])
    assert sizes == [p.shape[0] for p in parts] and sum(sizes) == whole.shape[0]
