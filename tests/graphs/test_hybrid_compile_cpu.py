"""Qwen3.5 hybrids compiled for the CPU (compiler/kernels/deltanet.py, the gated partial-RoPE
attention) against the reference executor, itself checked against transformers
(test_hybrid.py): prompts shorter than, equal to and several times the 64-token chunk, run
in prefill calls of max_tokens (the kernel's column-blocked recurrence), a 2-token step, then
token by token (its one-step form), <= 1e-3 relative, 32 greedy tokens
equal; float32 and bf16 HF weights, F32 and Q8_0 GGUF files (value heads in llama.cpp's
tiled order); Qwen3.5-MoE and Qwen3-Next (HF and GGUF) with routed and shared experts.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.compiler.reference.engine import ReferenceEngine
from hipc.graphs import load_model
from hipc.runtime.engine import load_engine

from gguf_writer import write_hybrid_gguf
from support import greedy, make_hybrid_hf, rel_err, require

pytestmark = pytest.mark.oracle

CTX = 256


def _check(artifact, model_ref, bound=1e-3):
    compiled = load_engine(artifact)
    reference = ReferenceEngine(load_model(model_ref), CTX)
    errors = []
    for T in (9, 64, 150):
        tokens = np.random.default_rng(T).integers(0, compiled.vocab_size, T).tolist()
        compiled.reset()
        reference.reset()
        errors.append(rel_err(compiled.logits(tokens), reference.logits(tokens, 0)))
        # a prefill, a 2-token step (fewer tokens than the conv window holds), then token by
        # token on the same states
        cut = T - 5
        compiled.reset()
        reference.reset()
        want = [reference.forward(tokens[:cut], 0)]
        got = [compiled.forward(tokens[:cut], 0)]
        want.append(reference.forward(tokens[cut : cut + 2], cut))
        got.append(compiled.forward(tokens[cut : cut + 2], cut))
        for i, t in enumerate(tokens[cut + 2 :]):
            want.append(reference.forward([t], cut + 2 + i))
            got.append(compiled.forward([t], cut + 2 + i))
        errors.append(rel_err(np.stack(got), np.stack(want)))
    assert max(errors) <= bound, errors
    prompt = np.random.default_rng(7).integers(0, compiled.vocab_size, 70).tolist()
    assert greedy(compiled, prompt, 32) == greedy(reference, prompt, 32)
    return max(errors)


def _compile(src, out, max_tokens=16):
    # max_tokens 16: the longer prompts run as several prefill calls on one state, each a
    # partial delta-rule chunk; 64: whole chunks
    options = CompileOptions(max_context=CTX, max_tokens=max_tokens)
    compile_model(src, out, options, verbose=False)
    return out


@pytest.mark.parametrize(("dtype", "max_tokens"), [("float32", 64), ("bfloat16", 16)])
def test_compiled_qwen3_5_matches_reference(dtype, max_tokens, tmp_path):
    torch = require("torch")
    hf = make_hybrid_hf("qwen3_5", tmp_path / "hf", seed=11)
    if dtype == "bfloat16":
        hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    plan = load_engine(_compile(tmp_path / "hf", tmp_path / "m.hipc", max_tokens)).artifact.plan
    kernels = {launch["kernel"] for launch in plan["targets"]["cpu"]["steps"]["forward"]}
    assert sum(k.startswith("deltanet_") for k in kernels) == 1  # two layers, one function
    kinds = {s["kind"] for s in plan["states"]}
    assert kinds == {"kv", "recurrent"}
    _check(tmp_path / "m.hipc", tmp_path / "hf")


@pytest.mark.parametrize(("qtype", "bound"), [("F32", 1e-3), ("Q8_0", 5e-3)])
def test_compiled_qwen35_gguf(qtype, bound, tmp_path):
    """llama.cpp's layout (tiled value heads, 1 + w norms, -exp(A_log)), compiled. F32:
    measured 7e-6. Q8_0: the linear kernels round activations to int16 per 32-block, and
    these random models amplify any rounding (one tensor's Q8_0 weights alone move their
    logits 0.4-10%, test_hybrid_gguf.py): measured 1.6e-3, greedy tokens still equal."""
    hf = make_hybrid_hf("qwen3_5", tmp_path / "hf", hidden_size=64, linear_value_head_dim=16)
    path = write_hybrid_gguf(hf, tmp_path / "m.gguf", "qwen35", qtype)
    _check(_compile(path, tmp_path / "m.hipc"), path, bound)


def test_compiled_moe_hybrids_match_reference(tmp_path):
    """Routed experts plus the sigmoid-gated shared expert (the moe and linear kinds), and
    Qwen3-Next's projections packed per key head: its HF in_proj_qkvz and in_proj_ba read
    where they are, and its GGUF (q/k/v and z split by llama.cpp's converter, b and a still
    packed). Qwen3.5-MoE from its HF folder."""
    make_hybrid_hf("qwen3_5_moe", tmp_path / "moe", seed=12)
    _check(_compile(tmp_path / "moe", tmp_path / "moe.hipc"), tmp_path / "moe")
    hf = make_hybrid_hf("qwen3_next", tmp_path / "next")
    _check(_compile(tmp_path / "next", tmp_path / "next.hipc", 64), tmp_path / "next")
    path = write_hybrid_gguf(hf, tmp_path / "n.gguf", "qwen3next")
    _check(_compile(path, tmp_path / "n.hipc"), path)
