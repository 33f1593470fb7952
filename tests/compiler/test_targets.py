"""Targets as objects: what differs per target is answered by the target, not by its name."""

from __future__ import annotations

import pytest

from hipc.compiler.options import KNOWN_TARGETS
from hipc.compiler.pipeline import stages
from hipc.compiler.targets import CpuTarget, GpuTarget, target


@pytest.mark.parametrize("name", KNOWN_TARGETS)
def test_every_known_target_is_an_object(name):
    t = target(name)
    assert t.name == name
    if name == "cpu":
        assert isinstance(t, CpuTarget) and (t.source_ext, t.binary_ext) == ("cpp", "so")
    else:
        assert isinstance(t, GpuTarget) and t.source_ext == "hip"
        nvidia = name.startswith("sm_")
        assert t.family == ("nvidia" if nvidia else "amd")
        assert t.binary_ext == ("fatbin" if nvidia else "co")
        # CDNA runs wave64; RDNA and NVIDIA wave32
        assert t.wave == (64 if name.startswith("gfx9") else 32)


def test_stages_are_named_in_order_with_render_and_compile_per_target():
    names = [s.name for s in stages([target("cpu"), target("sm_90")])]
    assert names[:10] == [
        "load model",
        "build graph",
        "quantize",
        "export gguf",
        "canonicalize",
        "repack weights",
        "fuse",
        "plan memory",
        "plan states",
        "select kernels",
    ]
    assert names[10:] == [
        "render cpu",
        "compile cpu",
        "render sm_90",
        "compile sm_90",
        "launch plan",
        "write artifact",
        "trim cache",
    ]
