"""Qwen3.5 / Qwen3.5-MoE GGUFs written by docs/benchmarks/write_hybrid_gguf.py (llama.cpp's
names, shapes and keys; value heads in its tiled order; random F32 weights), compiled for
the CPU, against llama.cpp's own logits for the same file: an oracle independent of
transformers and of this repository's reading of the format. Token by token (llama.cpp's
batched prompt path dies of SIGILL on this machine with its weight repacking), 40
positions: linear layers' states carried, full layers at positions 3, 7, ..."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.runtime.engine import load_engine

from support import rel_err

WRITER = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "write_hybrid_gguf.py"


def _writer():
    spec = importlib.util.spec_from_file_location("write_hybrid_gguf", WRITER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("preset", ["tiny", "tiny-dense"])
def test_compiled_hybrid_gguf_matches_llama_cpp(preset, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    w = _writer()
    path = w.write(tmp_path / f"{preset}.gguf", dict(w.PRESETS[preset]), "f32", seed=3)
    art = compile_model(path, tmp_path / "m.hipc", CompileOptions(max_context=128), verbose=False)
    tokens = np.random.default_rng(0).integers(3, 2000, 40).tolist()
    llm = llama_cpp.Llama(
        str(path), n_ctx=128, n_batch=1, n_ubatch=1, logits_all=True, verbose=False
    )
    llm.eval(tokens)
    want = np.asarray(llm.scores[: len(tokens)])
    engine = load_engine(art.artifact, "cpu")
    engine.reset()
    got = np.stack([engine.forward([t], i) for i, t in enumerate(tokens)])
    assert rel_err(got, want) <= 1e-3
    assert (got.argmax(1) == want.argmax(1)).all()
