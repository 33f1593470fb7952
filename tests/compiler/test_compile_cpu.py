"""Compiled CPU artifacts against the reference executor, every family (tiny random models).

Float32 weights: the compiled kernels and the reference compute the same float32
sums in different orders, so logits agree to ~1e-6 and the bar is 1e-3.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.compiler.reference.engine import ReferenceEngine
from hipc.graphs import load_model
from hipc.runtime.engine import load_engine

from support import (
    TINY_FAMILIES,
    TINY_GEMMA,
    check_compiled_against_reference,
    greedy,
    rel_err,
    require,
    write_tiny_hf,
)

CPU_FAMILIES = {**TINY_FAMILIES, **TINY_GEMMA}


@pytest.mark.parametrize("family", sorted(CPU_FAMILIES))
def test_compiled_matches_reference(family, tmp_path):
    folder = write_tiny_hf(tmp_path / family, **CPU_FAMILIES[family])
    # max_tokens 8 makes the 19-token prompt run as three prefill chunks
    compile_model(
        folder, tmp_path / "m.hipc", CompileOptions(max_context=48, max_tokens=8), verbose=False
    )
    # prefill, then token-by-token decode extending the same KV cache
    check_compiled_against_reference(tmp_path / "m.hipc", folder)


@pytest.mark.parametrize("activations", ["int16", "int8"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_quantized_weights_stay_quantized(qtype, activations, tmp_path):
    gguf_writer = pytest.importorskip("gguf_writer")
    path = gguf_writer.write_numpy_gguf(tmp_path / "m.gguf", qtype)
    compile_model(
        path,
        tmp_path / "m.hipc",
        CompileOptions(max_context=32, activations=activations),
        verbose=False,
    )
    compiled = load_engine(tmp_path / "m.hipc")
    dtypes = {w["dtype"] for w in compiled.artifact.plan["weights"]}
    assert qtype.lower().replace("f16", "float16") in dtypes
    tokens = np.random.default_rng(4).integers(0, compiled.vocab_size, 12).tolist()
    got = compiled.logits(tokens)
    want = ReferenceEngine(load_model(path), 32).logits(tokens, 0)
    # int8 activations trade a little accuracy for speed, like llama.cpp's kernels
    assert rel_err(got, want) <= (1e-3 if activations == "int16" else 5e-2)
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= (1.0 if activations == "int16" else 0.75)


@pytest.mark.parametrize("arch, qtype", [("gemma2", "F32"), ("gemma2", "Q8_0"), ("gemma3", "Q8_0")])
def test_gemma_gguf(arch, qtype, tmp_path):
    # llama.cpp's layout: norms stored as 1 + w (no Add in the graph), soft-caps from keys;
    # Gemma-3: q/k norms, layers 0-4 sliding on the local RoPE base, layer 5 global
    transformers, torch = require("transformers"), require("torch")
    gguf_writer = pytest.importorskip("gguf_writer")
    shape = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=160,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        sliding_window=5,
    )
    if arch == "gemma2":
        config = transformers.Gemma2Config(
            num_hidden_layers=2, attn_logit_softcapping=3.0, final_logit_softcapping=5.0, **shape
        )
    else:
        config = transformers.Gemma3TextConfig(num_hidden_layers=6, **shape)
    torch.manual_seed(5)
    src = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in src.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    path = gguf_writer.write_gguf(src, tmp_path / "m.gguf", arch, qtype)
    compile_model(
        path, tmp_path / "m.hipc", CompileOptions(max_context=32, max_tokens=8), verbose=False
    )
    compiled = load_engine(tmp_path / "m.hipc")
    reference = ReferenceEngine(load_model(path), 32)
    tokens = np.random.default_rng(7).integers(0, 160, 14).tolist()
    assert rel_err(compiled.logits(tokens), reference.logits(tokens, 0)) <= 1e-3
    assert greedy(compiled, tokens[:4], 20) == greedy(reference, tokens[:4], 20)


@pytest.mark.parametrize(
    "dtype, family",
    [
        ("bfloat16", "llama"),
        ("float16", "llama"),
        ("bfloat16", "qwen2-bias"),
        ("bfloat16", "gemma2"),
    ],
)
def test_half_precision_hf_weights(dtype, family, tmp_path):
    # qwen2-bias: each bias's float view follows the MatMul that adds it in the graph;
    # gemma2: its (1 + w) norm scales fold from bf16 vectors
    cfg = {**CPU_FAMILIES[family], "hidden_size": 64, "intermediate_size": 128}
    folder = write_tiny_hf(tmp_path / dtype, dtype=dtype, **cfg)
    compile_model(folder, tmp_path / "m.hipc", CompileOptions(max_context=32), verbose=False)
    compiled = load_engine(tmp_path / "m.hipc")
    assert {w["dtype"] for w in compiled.artifact.plan["weights"]} >= {dtype}
    tokens = np.random.default_rng(6).integers(0, compiled.vocab_size, 12).tolist()
    want = ReferenceEngine(load_model(folder), 32).logits(tokens, 0)
    assert rel_err(compiled.logits(tokens), want) <= 1e-3


def test_admitted_context_smaller_than_compiled(tmp_path):
    from hipc.base.errors import HipcError

    folder = write_tiny_hf(tmp_path / "m")
    compile_model(folder, tmp_path / "m.hipc", CompileOptions(max_context=64), verbose=False)
    full, short = load_engine(tmp_path / "m.hipc"), load_engine(tmp_path / "m.hipc", max_context=16)
    assert short.max_context == 16 and short.backend.kv[0].shape[0] == 16
    tokens = list(range(3, 15))
    np.testing.assert_array_equal(short.logits(tokens), full.logits(tokens))
    with pytest.raises(HipcError, match="context overflow"):
        short.logits(list(range(3, 20)))
    with pytest.raises(HipcError, match="holds 64 positions"):
        load_engine(tmp_path / "m.hipc", max_context=65)


def _mixed_types(name: str) -> str:
    """A Q4_K_M-style mix: v and down in Q6_K, q/k/gate/up in Q4_K, the output in Q5_0,
    the embedding in Q8_0 -- so q+k and v cannot merge (the norm before them is split)."""
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "q6_k"
    if name == "output.weight":
        return "q5_0"
    if name == "token_embd.weight":
        return "q8_0"
    if name.endswith("attn_output.weight"):
        return "q5_1"
    return "q4_k"


@pytest.mark.parametrize("activations", ["int16", "int8"])
@pytest.mark.parametrize("mix", ["mixed", "q6_k", "q5_k", "q5_0"])
def test_kquant_and_5bit_weights(mix, activations, tmp_path):
    """Q4_K/Q5_K/Q6_K/Q5_0/Q5_1 GGUF files (hipc's quantizer) against the reference, which
    dequantizes them with gguf-py; one file mixes types per tensor."""
    gguf_writer = pytest.importorskip("gguf_writer")
    types = _mixed_types if mix == "mixed" else (lambda name: mix)
    path = gguf_writer.write_numpy_gguf(tmp_path / "m.gguf", hidden=256, ffn=512, types=types)
    # int8 rounding (~4e-3 per block) grows through a random 256-wide model
    stored = _quantized_against_reference(path, tmp_path, activations, int8_bar=0.15)
    assert stored >= ({"q4_k", "q6_k", "q5_0", "q5_1", "q8_0"} if mix == "mixed" else {mix})


def _quantized_against_reference(path, tmp_path, activations: str, int8_bar: float) -> set:
    """`path` compiled for the CPU against the reference (gguf-py dequantizes the blocks):
    12 tokens in chunks of 8 (prefill GEMM tiles and tails) within 1e-3 and 12 greedy tokens
    equal with int16 activations; within `int8_bar` and 75% of the top-1s with int8. Returns
    the stored weight types."""
    compile_model(
        path,
        tmp_path / "m.hipc",
        CompileOptions(max_context=32, max_tokens=8, activations=activations),
        verbose=False,
    )
    compiled = load_engine(tmp_path / "m.hipc")
    tokens = np.random.default_rng(4).integers(0, compiled.vocab_size, 12).tolist()
    got = compiled.logits(tokens)
    reference = ReferenceEngine(load_model(path), 32)
    want = reference.logits(tokens, 0)
    if activations == "int16":
        assert rel_err(got, want) <= 1e-3
        assert greedy(compiled, tokens[:4], 12) == greedy(reference, tokens[:4], 12)
    else:
        assert rel_err(got, want) <= int8_bar
        assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.75
    return {w["dtype"] for w in compiled.artifact.plan["weights"]}


@pytest.mark.parametrize("activations", ["int16", "int8"])
@pytest.mark.parametrize("wtype", ["iq4_nl", "iq4_xs"])
def test_iq4_weights(wtype, activations, tmp_path):
    """IQ4_NL (Q4_0's blocks, each nibble an index into a table of 16 int8 values) and
    IQ4_XS (8 such blocks under 6-bit scales) in every matrix but the embedding (IQ4_NL:
    the embedding too), against the reference (gguf-py's dequantizer): prefill chunks and
    decode."""
    gguf_writer = pytest.importorskip("gguf_writer")
    path = gguf_writer.write_numpy_gguf(
        tmp_path / "m.gguf",
        # IQ4_XS's super-blocks need rows of 256
        hidden=256 if wtype == "iq4_xs" else 64,
        ffn=512 if wtype == "iq4_xs" else 96,
        types=lambda n: "q8_0" if n == "token_embd.weight" and wtype == "iq4_xs" else wtype,
    )
    # int8: the 256-wide model takes test_kquant_and_5bit_weights' bar (its rounding grows
    # with the width: 5.7e-2 here with hipc's IQ4_XS quantizer's blocks), the 64-wide one 5e-2
    bar = 0.15 if wtype == "iq4_xs" else 5e-2
    assert wtype in _quantized_against_reference(path, tmp_path, activations, int8_bar=bar)


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_gate_and_up_in_different_types(activations, tmp_path):
    """A recipe that gives ffn_gate and ffn_up different types (here Q4_K and Q5_0, the down
    Q8_0) leaves no one GLU epilogue to take both: two Linears and the glu kernel."""
    gguf_writer = pytest.importorskip("gguf_writer")
    path = gguf_writer.write_mixed_glu_gguf(tmp_path / "m.gguf")
    _quantized_against_reference(path, tmp_path, activations, int8_bar=0.15)
    steps = load_engine(tmp_path / "m.hipc").artifact.plan["targets"]["cpu"]["steps"]
    assert sum(k["kernel"].startswith("glu_silu_512") for k in steps["forward"]) == 2


@pytest.mark.parametrize("activations", ["int16", "int8"])
@pytest.mark.parametrize("wtype", ["q2_k", "q3_k"])
def test_q2_k_and_q3_k_weights(wtype, activations, tmp_path):
    """Q3_K (Q3_K_M files' main type: 3-bit values under 6-bit scales per 16) in every matrix
    but the embedding, Q2_K (Q2_K files': 2-bit values under a 4-bit scale and min per 16) in
    every matrix, the embedding too, against the reference (gguf-py's dequantizer)."""
    gguf_writer = pytest.importorskip("gguf_writer")
    path = gguf_writer.write_numpy_gguf(
        tmp_path / "m.gguf",
        hidden=256,
        ffn=512,
        types=lambda n: "q8_0" if n == "token_embd.weight" and wtype == "q3_k" else wtype,
    )
    # int8: the bar of test_kquant_and_5bit_weights' 256-wide models
    assert wtype in _quantized_against_reference(path, tmp_path, activations, int8_bar=0.15)


@pytest.mark.parametrize("target, label", [("cpu", "CPU"), ("sm_90", "HIP")])
def test_weight_type_without_kernel_is_refused_naming_the_tensor(
    target, label, tmp_path, monkeypatch
):
    """One line, before any rendering: the tensor as the file names it, its type, the
    supported types. (Every type the reader takes has kernels on every target: Q2_K is taken
    out of the target's types here. The blocks are random bytes, only the type matters.)"""
    from hipc.base.errors import HipcError
    from hipc.compiler import quantize
    from hipc.compiler.codegen import environment

    gguf_writer = pytest.importorskip("gguf_writer")
    wtype = "q2_k"
    family = "cpu" if target == "cpu" else "hip"
    types = tuple(t for t in environment.KERNEL_WTYPES[family] if t != wtype)
    monkeypatch.setitem(environment.KERNEL_WTYPES, family, types)
    monkeypatch.setitem(
        quantize._QUANTIZERS,
        wtype,
        lambda b: np.random.default_rng(0).integers(0, 256, (len(b), 84), dtype=np.uint8),
    )
    path = gguf_writer.write_numpy_gguf(
        tmp_path / "m.gguf",
        hidden=256,
        ffn=512,
        types=lambda n: wtype if n == "blk.1.ffn_down.weight" else "q8_0",
    )
    with pytest.raises(HipcError) as e:
        compile_model(
            path,
            tmp_path / "m.hipc",
            CompileOptions(max_context=32, targets=(target,)),
            verbose=False,
        )
    msg = str(e.value)
    assert msg.startswith(f"blk.1.ffn_down.weight: weight type {wtype} has no {label} kernel")
    assert "(supported: float32, " in msg and "\n" not in msg


def test_long_rows_split_over_threads(tmp_path):
    """From 768 positions on, with several threads, the attention runs a row's positions in
    parts and merges their partial softmax states (where GT > 1 heads share a KV head: the
    AVX512 build). The logits at two threads are the one-thread logits within float rounding,
    and a row gives the same bits alone and in a step of two rows (the parts depend on its
    positions and the threads, not on the step)."""
    folder = write_tiny_hf(
        tmp_path / "m",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    out = tmp_path / "m.hipc"
    compile_model(folder, out, CompileOptions(max_context=1024), verbose=False)
    engine = load_engine(out, target="cpu", threads=1)
    ids = np.random.default_rng(5).integers(0, engine.vocab_size, 1000).tolist()
    gomp = ctypes.CDLL("libgomp.so.1")  # the library the artifact's OpenMP regions use
    old = gomp.omp_get_max_threads()

    def last_logits(threads: int) -> tuple[np.ndarray, np.ndarray]:
        gomp.omp_set_num_threads(threads)
        try:
            engine.forward(ids[:998], 0)
            alone = engine.forward([ids[998]], 998)
            pair = engine.forward(ids[997:999], 997)
            return alone, pair
        finally:
            gomp.omp_set_num_threads(old)

    one, _ = last_logits(1)
    alone, pair = last_logits(2)
    assert rel_err(alone, one) < 1e-5
    np.testing.assert_array_equal(alone, pair)
    engine.close()
