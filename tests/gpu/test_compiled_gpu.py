"""Compiled GPU artifacts on a real GPU: every family against the reference executor.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). The GPU
kernels dequantize weights exactly and accumulate in float32, so the bar is the
float32 one: relative logit error <= 2e-3, greedy tokens equal for 32 steps. The KV
cache is bfloat16 by default on GPUs: the reference stores its cache the same way
(rounded to nearest even), and float32 caches are checked too.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.compiler.reference.engine import ReferenceEngine
from hipc.graphs import load_model
from hipc.runtime.engine import load_engine

from gguf_writer import write_numpy_gguf, write_q6k_head_gguf
from support import TINY_FAMILIES, greedy, rel_err, write_tiny_hf

pytestmark = pytest.mark.gpu
TARGET = "sm_90"


def check(model_path, tmp_path, ctx=64, kv_storage="auto"):
    out = tmp_path / "m.hipc"
    compile_model(
        model_path,
        out,
        CompileOptions(targets=(TARGET,), max_context=ctx, max_tokens=8, kv_storage=kv_storage),
        verbose=False,
    )
    gpu = load_engine(out, target="cuda")
    ref = ReferenceEngine(load_model(model_path), ctx, kv_storage=gpu.artifact.kv_storage)
    tokens = np.random.default_rng(5).integers(0, gpu.vocab_size, 19).tolist()
    assert rel_err(gpu.logits(tokens), ref.logits(tokens, 0)) <= 2e-3
    ref.reset()
    want = np.stack(
        [ref.logits(tokens[:6], 0)[-1]]
        + [ref.logits([t], 6 + i)[-1] for i, t in enumerate(tokens[6:])]
    )
    got = np.stack(
        [gpu.forward(tokens[:6], 0)] + [gpu.forward([t], 6 + i) for i, t in enumerate(tokens[6:])]
    )
    assert rel_err(got, want) <= 2e-3
    assert greedy(gpu, tokens[:3], 32) == greedy(ref, tokens[:3], 32)
    gpu.close()


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_family_on_gpu(family, tmp_path):
    check(write_tiny_hf(tmp_path / family, **TINY_FAMILIES[family]), tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen3-qknorm", "mistral-window"])
def test_float32_kv_cache_on_gpu(family, tmp_path):
    check(write_tiny_hf(tmp_path / family, **TINY_FAMILIES[family]), tmp_path, kv_storage="float32")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16"])
def test_quantized_on_gpu(qtype, tmp_path):
    check(write_numpy_gguf(tmp_path / "m.gguf", qtype), tmp_path)


def test_quantized_q6_k_output_on_gpu(tmp_path):
    check(write_q6k_head_gguf(tmp_path / "m.gguf"), tmp_path)


@pytest.mark.parametrize(
    "dtype, family", [("bfloat16", "llama"), ("float16", "llama"), ("bfloat16", "qwen2-bias")]
)
def test_half_weights_on_gpu(dtype, family, tmp_path):
    # bf16: prefill runs the matrix-instruction GEMM (qwen2-bias: with its bias epilogue)
    cfg = {**TINY_FAMILIES[family], "hidden_size": 64, "intermediate_size": 128}
    check(write_tiny_hf(tmp_path / dtype, dtype=dtype, **cfg), tmp_path)


@pytest.mark.parametrize(
    "family, overrides",
    [
        # 32 heads: 8 decode blocks per head, so each block loops over several chunks
        ("qwen3-qknorm", dict(num_attention_heads=32, num_key_value_heads=4)),
        ("mistral-window", {}),  # the window starts far past 0
        ("llama", {}),  # 16 blocks per head, several holding no key
    ],
)
def test_long_context_decode(family, overrides, tmp_path):
    """Decode at ~1,100 positions: the split attention's chunks, loops and merge."""
    cfg = {**TINY_FAMILIES[family], **overrides, "max_position_embeddings": 4096}
    folder = write_tiny_hf(tmp_path / family, **cfg)
    out = tmp_path / "m.hipc"
    compile_model(
        folder,
        out,
        CompileOptions(targets=(TARGET,), max_context=2048, max_tokens=256),
        verbose=False,
    )
    gpu = load_engine(out, target="cuda")
    ref = ReferenceEngine(load_model(folder), 2048, kv_storage=gpu.artifact.kv_storage)
    tokens = np.random.default_rng(7).integers(0, gpu.vocab_size, 1112).tolist()
    want = [ref.logits(tokens[:1100], 0)[-1]]
    want += [ref.logits([t], 1100 + i)[-1] for i, t in enumerate(tokens[1100:])]
    got = [gpu.forward(tokens[:1100], 0)]
    got += [gpu.forward([t], 1100 + i) for i, t in enumerate(tokens[1100:])]
    assert rel_err(np.stack(got), np.stack(want)) <= 2e-3
    gpu.close()
