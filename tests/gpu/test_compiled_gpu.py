"""Compiled GPU artifacts on a real GPU: every family against the reference executor.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). The GPU
kernels dequantize weights exactly and accumulate in float32; compiled with
`--prefill-precision split` (activations as bf16 hi + lo, the float32 attention) the bar is
the float32 one: relative logit error <= 2e-3, greedy tokens equal for 32 steps. The KV
cache is bfloat16 by default on GPUs: the reference stores its cache the same way
(rounded to nearest even), and float32 caches are checked too. The default policy
(`bf16`: the sm_90 wgmma GEMM and the flash attention round operands to bf16) is held to a
bar that bf16 rounding meets and a wrong kernel does not (test_bf16_prefill_policy_on_gpu).
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.compiler.reference.engine import ReferenceEngine
from hipc.graphs import load_model
from hipc.runtime.engine import load_engine

from gguf_writer import (
    q2_k_dense_type,
    q3_k_m_dense_type,
    write_mixed_glu_gguf,
    write_numpy_gguf,
    write_q6k_head_gguf,
)
from support import TINY_FAMILIES, greedy, rel_err, write_tiny_hf

pytestmark = pytest.mark.gpu
TARGET = "sm_90"


def check(model_path, tmp_path, ctx=64, kv_storage="auto"):
    out = tmp_path / "m.hipc"
    options = CompileOptions(
        targets=(TARGET,),
        max_context=ctx,
        max_tokens=8,
        kv_storage=kv_storage,
        prefill_precision="split",
    )
    compile_model(model_path, out, options, verbose=False)
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


def test_float32_gemm_k_splits_on_gpu(tmp_path):
    """Float32 linears over K of 512 and 1024: at these 8-token steps linear_sgemm splits K
    4 and 8 ways (the parts in the plan's scratch, then the _sum launches)."""
    model = write_tiny_hf(tmp_path / "m", **TINY_FAMILIES["llama"], hidden_size=512,
                          intermediate_size=1024)  # fmt: skip
    check(model, tmp_path)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16"])
def test_quantized_on_gpu(qtype, tmp_path):
    check(write_numpy_gguf(tmp_path / "m.gguf", qtype), tmp_path)


@pytest.mark.parametrize("wtype", ["iq4_nl", "iq4_xs"])
def test_iq4_on_gpu(wtype, tmp_path):
    """IQ4_NL and IQ4_XS in every matrix (the embedding too): the GEMVs, the prefill GEMM's
    tiles and the embedding look the nibbles up in IQ4_NL's table."""
    path = write_numpy_gguf(tmp_path / "m.gguf", hidden=256, ffn=512, types=lambda n: wtype)
    # float32 KV: with bf16 KV this 256-wide model's stepwise decode reads ~2.4e-3 whatever
    # the weights' type (the H200, 2026-12-05: Q8_0 2.40e-3, IQ4_XS 2.46e-3, Q4_0 1.62e-3;
    # ulp flips of the rounded K/V), which is no measure of the IQ4 kernels
    check(path, tmp_path, kv_storage="float32")


def test_gate_and_up_in_different_types_on_gpu(tmp_path):
    """ffn_gate Q4_K beside ffn_up Q5_0: two GEMVs and the glu kernel (compiler/kernels/glu.py)
    where one GLU epilogue cannot read both."""
    check(write_mixed_glu_gguf(tmp_path / "m.gguf"), tmp_path, kv_storage="float32")


def test_mixed_qkv_types_on_gpu(tmp_path):
    """Q4_K q and k beside Q6_K v and down (llama.cpp's Q4_K_M layers given more bits): q+k
    merged, v its own GEMV and GEMM, each with its own copy of the norm, against the
    reference."""
    types = lambda n: "q6_k" if n.endswith(("attn_v.weight", "ffn_down.weight")) else "q4_k"  # noqa: E731
    check(write_numpy_gguf(tmp_path / "m.gguf", hidden=256, ffn=512, types=types), tmp_path,
          kv_storage="float32")  # fmt: skip


def test_q3_k_m_layers_on_gpu(tmp_path):
    """llama-quantize's Q3_K_M of a Llama (Q3_K q+k, gate/up and embedding; Q4_K v, o, down;
    Q6_K output): the Q3_K GEMVs, prefill GEMM tiles and embedding against the reference."""
    path = write_numpy_gguf(tmp_path / "m.gguf", hidden=256, ffn=512, types=q3_k_m_dense_type)
    check(path, tmp_path, kv_storage="float32")  # float32 KV: as test_iq4_on_gpu says


def test_q2_k_layers_on_gpu(tmp_path):
    """A Q2_K file of a Llama (Q2_K q+k, o, gate/up and embedding; Q3_K v and down; Q6_K
    output): the Q2_K GEMVs, prefill GEMM tiles and embedding against the reference."""
    path = write_numpy_gguf(tmp_path / "m.gguf", hidden=256, ffn=512, types=q2_k_dense_type)
    check(path, tmp_path, kv_storage="float32")  # float32 KV: as test_iq4_on_gpu says


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
    options = CompileOptions(
        targets=(TARGET,), max_context=2048, max_tokens=256, prefill_precision="split"
    )
    compile_model(folder, out, options, verbose=False)
    gpu = load_engine(out, target="cuda")
    ref = ReferenceEngine(load_model(folder), 2048, kv_storage=gpu.artifact.kv_storage)
    tokens = np.random.default_rng(7).integers(0, gpu.vocab_size, 1112).tolist()
    want = [ref.logits(tokens[:1100], 0)[-1]]
    want += [ref.logits([t], 1100 + i)[-1] for i, t in enumerate(tokens[1100:])]
    got = [gpu.forward(tokens[:1100], 0)]
    got += [gpu.forward([t], 1100 + i) for i, t in enumerate(tokens[1100:])]
    assert rel_err(np.stack(got), np.stack(want)) <= 2e-3
    gpu.close()


def prompt_under_default_policy(model_path, tmp_path, seed: int, n: int):
    """`model_path` compiled under the default (bf16) prefill policy, context 512 in 128-token
    steps, beside the reference executor; `n` random tokens, the first 300 of them prefilled
    as one prompt by both and held to the bf16-policy bar (test_bf16_prefill_policy_on_gpu).
    Returns (gpu engine, reference, tokens) for the steps after the prompt."""
    out = tmp_path / "m.hipc"
    compile_model(
        model_path, out, CompileOptions(targets=(TARGET,), max_context=512, max_tokens=128),
        verbose=False,
    )  # fmt: skip
    gpu = load_engine(out, target="cuda")
    ref = ReferenceEngine(load_model(model_path), 512, kv_storage=gpu.artifact.kv_storage)
    tokens = np.random.default_rng(seed).integers(0, gpu.vocab_size, n).tolist()
    got, want = gpu.logits(tokens[:300]), ref.logits(tokens[:300], 0)
    assert rel_err(got, want) <= 0.1, rel_err(got, want)
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
    return gpu, ref, tokens


@pytest.mark.parametrize("family", ["llama", "qwen3-qknorm", "mistral-window", "qwen2-bias"])
def test_bf16_prefill_policy_on_gpu(family, tmp_path):
    """The default policy on bf16 weights (wgmma GEMMs, flash attention): a 300-token prompt
    in 128-token steps (the flash kernel after a cached prefix, the window past 0) and decode
    after it. These tiny random models' logits are small, so bf16 rounding moves them by up to
    5e-2 of the largest (NumPy emulation of the GEMM rounding alone; top-1 0.97-0.99): the bar
    is 0.1 and 90% top-1, which a wrong fragment, mask or softmax (O(1) errors) cannot meet."""

    cfg = {**TINY_FAMILIES[family], "hidden_size": 128, "intermediate_size": 256}
    cfg["max_position_embeddings"] = 1024
    if "head_dim" in cfg:
        cfg["head_dim"] = 32  # whole 16s: the flash kernel (12 keeps the SIMT one)
    folder = write_tiny_hf(tmp_path / family, dtype="bfloat16", **cfg)
    gpu, ref, tokens = prompt_under_default_policy(folder, tmp_path, seed=9, n=304)
    kinds = {
        x["kernel"].rsplit("_", 1)[-1]
        for x in gpu.artifact.plan["targets"][TARGET]["steps"]["prefill"]
    }
    assert "flash" in kinds and any(k.startswith("wg") for k in kinds), kinds
    steps = [gpu.forward([t], 300 + i) for i, t in enumerate(tokens[300:])]
    refs = [ref.logits([t], 300 + i)[-1] for i, t in enumerate(tokens[300:])]
    assert rel_err(np.stack(steps), np.stack(refs)) <= 0.1
    gpu.close()


def _kquant_mix(name: str) -> str:
    """Q4_K_M-like: Q6_K for the down projections and the LM head, Q4_K elsewhere."""
    return "q6_k" if "ffn_down" in name or name == "output.weight" else "q4_k"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q5_1", "k-mix"])
def test_quantized_bf16_prefill_policy_on_gpu(qtype, tmp_path):
    """Quantized weights under the default policy: a prefill step of 128 tokens or more
    dequantizes each linear's W to bf16 rows for the wgmma GEMM (linear_dequant), a shorter
    one multiplies the quants on the mma GEMM, decode runs the quantized GEMVs. 300 tokens in
    128-token steps, then a 40-token step, then decode, against the reference executor with
    the bf16-policy bar of test_bf16_prefill_policy_on_gpu (bf16 rounding of x and now of W)."""
    if qtype == "k-mix":
        path = write_numpy_gguf(
            tmp_path / "m.gguf", hidden=256, ffn=512, types=_kquant_mix, context=512
        )
    else:
        path = write_numpy_gguf(tmp_path / "m.gguf", qtype, hidden=128, ffn=256, context=512)
    gpu, ref, tokens = prompt_under_default_policy(path, tmp_path, seed=11, n=345)
    steps = gpu.artifact.plan["targets"][TARGET]["steps"]["prefill"]
    assert any(x["kernel"].endswith("_dq") for x in steps)
    got = gpu.forward(tokens[300:340], 300)  # one step of 40: the mma GEMM on the quants
    want = ref.logits(tokens[300:340], 300)[-1]
    assert rel_err(got, want) <= 0.1, rel_err(got, want)
    dec = [gpu.forward([t], 340 + i) for i, t in enumerate(tokens[340:])]
    refs = [ref.logits([t], 340 + i)[-1] for i, t in enumerate(tokens[340:])]
    assert rel_err(np.stack(dec), np.stack(refs)) <= 0.1
    gpu.close()


def test_glu_bf16_handoff_is_exact_on_gpu(tmp_path, monkeypatch):
    """The gate/up GEMM's output written in bf16 and read directly by down's TMA (linear.py's
    bf16_reader) gives the same logits, bit for bit, as the same model compiled with down's
    own _xb pass: the hand-off rounds exactly as _xb does. 300 tokens in 128-token steps."""
    from hipc.compiler.kernels import linear

    cfg = {**TINY_FAMILIES["llama"], "hidden_size": 128, "intermediate_size": 256}
    cfg.update(max_position_embeddings=1024, num_hidden_layers=2, vocab_size=97)
    folder = write_tiny_hf(tmp_path / "m", dtype="bfloat16", **cfg)
    tokens = np.random.default_rng(3).integers(0, cfg["vocab_size"], 300).tolist()

    def prefill(out):
        options = CompileOptions(targets=(TARGET,), max_context=512, max_tokens=128)
        compile_model(folder, out, options, verbose=False)
        gpu = load_engine(out, target="cuda")
        steps = gpu.artifact.plan["targets"][TARGET]["steps"]["prefill"]
        got = gpu.logits(tokens)
        gpu.close()
        return got, [x["kernel"] for x in steps]

    handed, kernels = prefill(tmp_path / "a.hipc")
    monkeypatch.setattr(linear, "bf16_reader", lambda *a: None)
    own_xb, kernels_xb = prefill(tmp_path / "b.hipc")
    assert sum(k.endswith("_yb") for k in kernels) == cfg["num_hidden_layers"], kernels
    assert not any(k.endswith("_yb") for k in kernels_xb)
    assert len(kernels_xb) == len(kernels) + cfg["num_hidden_layers"]  # down's _xb passes
    assert np.array_equal(handed.view(np.uint32), own_xb.view(np.uint32))


def test_attention_bf16_handoff_is_exact_on_gpu(tmp_path, monkeypatch):
    """The flash attention's output written in bf16 for the o projection's TMA
    (Attention.bf16_reader) gives the same logits, bit for bit, as the same model compiled with
    o's own _xb pass (300 tokens in 128-token steps); batch steps' SIMT attention writes bf16
    too, in each of its split-context kernels (_battn_sN; their rows checked against lone runs
    by test_batch_gpu.py)."""
    from hipc.compiler.kernels.attention import Attention

    cfg = {**TINY_FAMILIES["llama"], "hidden_size": 128, "intermediate_size": 256}
    cfg.update(max_position_embeddings=1024, num_hidden_layers=2, vocab_size=97)
    folder = write_tiny_hf(tmp_path / "m", dtype="bfloat16", **cfg)
    tokens = np.random.default_rng(4).integers(0, cfg["vocab_size"], 300).tolist()

    def prefill(out):
        options = CompileOptions(targets=(TARGET,), max_context=512, max_tokens=128)
        compile_model(folder, out, options, verbose=False)
        gpu = load_engine(out, target="cuda")
        plan = gpu.artifact.plan["targets"][TARGET]["steps"]
        got = gpu.logits(tokens)
        gpu.close()
        return got, [x["kernel"] for x in plan["prefill"]], [x["kernel"] for x in plan["batch"]]

    handed, kernels, batch = prefill(tmp_path / "a.hipc")
    monkeypatch.setattr(Attention, "bf16_reader", lambda *a: None)
    own_xb, kernels_xb, _ = prefill(tmp_path / "b.hipc")
    layers = cfg["num_hidden_layers"]
    assert sum(k.endswith("_ob_flash") for k in kernels) == layers, kernels
    # the batch step's split-context attention: one kernel per split count a layer, each bf16
    batch_attention = [k for k in batch if "_battn_s" in k]
    assert len(batch_attention) >= layers, batch
    assert all("_ob_battn_s" in k for k in batch_attention), batch
    assert not any("_ob_" in k for k in kernels_xb)
    assert len(kernels_xb) == len(kernels) + layers  # o's _xb passes
    assert np.array_equal(handed.view(np.uint32), own_xb.view(np.uint32))
