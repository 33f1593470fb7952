"""Byte progress bars (tqdm): drawn on a terminal only, reaching the bytes written."""

from __future__ import annotations

import io
import sys

import numpy as np

from hipc.base.progress import byte_progress
from hipc.base.safetensors_file import LazyTensor, write_safetensors


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def tensors() -> list[LazyTensor]:
    arrays = [np.arange(n, dtype=np.float32) for n in (1000, 500, 3)]
    return [LazyTensor(f"t{i}", a.dtype, a.shape, lambda a=a: a) for i, a in enumerate(arrays)]


def test_weight_writing_draws_a_bar_on_a_terminal(tmp_path, monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    write_safetensors(
        tmp_path / "w.safetensors", tensors(), on_progress=byte_progress("writing weights")
    )
    out = term.getvalue()
    assert "hipc: writing weights" in out and "100%" in out
    assert "6.01k/6.01k" in out  # 1503 float32 values, in SI units


def test_no_bar_off_a_terminal_or_when_quiet(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert byte_progress("writing weights") is None
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert byte_progress("x", show=False) is None
