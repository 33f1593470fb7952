"""Hybrid linear/full attention (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers.

The delta rule's two forms against each other and against transformers' own recurrence;
then random-init models of the three types with prompts shorter than, equal to and several
times the 64-token chunk: prefill, prefill continued from a state (a multi-token chunk
on a non-zero state), token-by-token decode, <= 1e-4 relative, and 32 greedy tokens equal.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest

from hipc.compiler.reference import delta_rule
from hipc.compiler.reference.engine import ReferenceEngine
from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import build_graph, load_model
from hipc.runtime.engine import load_engine

from support import HYBRID_FAMILIES, greedy, hf_greedy, make_hybrid_hf, rel_err, require


def _delta_inputs(T: int, H: int = 3, dk: int = 8, dv: int = 6, dtype=np.float64, seed: int = 0):
    rng = np.random.default_rng(seed)

    def unit(*shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q, k = unit(T, H, dk), unit(T, H, dk)
    v = rng.standard_normal((T, H, dv))
    g = -np.abs(0.3 * rng.standard_normal((T, H)))  # log decays, some near 0
    beta = 1 / (1 + np.exp(-rng.standard_normal((T, H))))
    state = rng.standard_normal((H, dk, dv))
    return [a.astype(dtype) for a in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 200])
def test_chunked_delta_rule_equals_the_recurrence(T):
    """From a non-zero state, across chunk boundaries: outputs and final state agree
    (float64 to rounding; float32 to its precision)."""
    q, k, v, g, beta, s0 = _delta_inputs(T)
    want_o, want_s = delta_rule.recurrent(q, k, v, g, beta, s0)
    got_o, got_s = delta_rule.chunked(q, k, v, g, beta, s0, chunk=64)
    assert rel_err(got_o, want_o) <= 1e-12 and rel_err(got_s, want_s) <= 1e-12
    f32 = [a.astype(np.float32) for a in (q, k, v, g, beta, s0)]
    got_o, got_s = delta_rule.chunked(*f32, chunk=64)
    assert got_o.dtype == np.float32
    assert rel_err(got_o, want_o) <= 1e-5 and rel_err(got_s, want_s) <= 1e-5


def test_delta_rule_recurrence_matches_transformers():
    """Our recurrence against transformers' torch_recurrent_gated_delta_rule (grouped key
    heads, its own l2 norm and query scale off: we pass normalised, scaled inputs)."""
    torch = require("torch")
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, s0 = _delta_inputs(30, H=4, seed=1)
    qk = [x[:, ::2] for x in (q, k)]  # 2 key heads for 4 value heads
    dk = q.shape[-1]
    out, final = torch_recurrent_gated_delta_rule(
        *(torch.tensor(x)[None] for x in (qk[0] * dk**0.5, qk[1], v, g, beta)),
        initial_state=torch.tensor(s0)[None],
        output_final_state=True,
    )
    eq = [delta_rule.expand_heads(x, 4, tiled=False) for x in qk]
    want_o, want_s = delta_rule.recurrent(eq[0], eq[1], v, g, beta, s0)
    # transformers computes in float32 whatever it is given
    assert rel_err(out[0].numpy(), want_o) <= 1e-6
    assert rel_err(final[0].numpy(), want_s) <= 1e-6
    tiled = [delta_rule.expand_heads(x, 4, tiled=True) for x in qk]
    assert not np.allclose(tiled[0], eq[0])  # the two orders differ: the switch matters


@pytest.fixture(scope="module", params=sorted(HYBRID_FAMILIES))
def hybrid(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return make_hybrid_hf(request.param, folder), folder


def _hf_pieces(model, tokens, cuts):
    """transformers' logits over tokens fed in pieces ending at `cuts` (then one at a time)
    on one cache: chunks from a non-zero state, then decode steps."""
    torch = require("torch")
    bounds = [0, *cuts, *range(cuts[-1] + 1, len(tokens) + 1)]
    past, steps = None, []
    with torch.no_grad():
        ids = torch.tensor([tokens])
        for a, b in itertools.pairwise(bounds):
            out = model(ids[:, a:b], past_key_values=past, use_cache=True)
            past = out.past_key_values
            steps.append(out.logits[0].numpy())
    return bounds, np.concatenate(steps)


@pytest.mark.oracle
@pytest.mark.parametrize("T", [9, 64, 200])
def test_reference_matches_transformers(hybrid, T):
    torch = require("torch")
    hf, folder = hybrid
    tokens = np.random.default_rng(T).integers(0, hf.config.vocab_size, size=T).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].numpy()
    ex = ReferenceExecutor(build_graph(load_model(folder), max_ctx=256))
    assert rel_err(ex.logits(tokens), want) <= 1e-4

    # a prefill, a multi-token piece continuing the states, then single tokens
    cuts = [max(1, T // 3), max(2, T - 4)]
    bounds, want = _hf_pieces(hf, tokens, cuts)
    ex.reset()
    got = np.concatenate([ex.logits(tokens[a:b], a) for a, b in itertools.pairwise(bounds)])
    assert rel_err(got, want) <= 1e-4


@pytest.mark.oracle
def test_greedy_32_tokens_equal(hybrid):
    hf, folder = hybrid
    prompt = np.random.default_rng(5).integers(0, hf.config.vocab_size, size=70).tolist()
    engine = ReferenceEngine(load_model(folder), 128)
    assert greedy(engine, prompt, 32) == hf_greedy(hf, prompt, 32)


@pytest.mark.oracle
def test_every_switch_is_exercised(hybrid):
    """Turning a switch off moves the logits far from transformers': each is tested above."""
    torch = require("torch")
    hf, folder = hybrid
    tokens = np.random.default_rng(1).integers(0, hf.config.vocab_size, size=20).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].numpy()
    model = load_model(folder)
    cfg = model.config
    for change in (dict(linear_v_tiled=True), dict(norm_weight_offset=0.0), dict(rotary_dim=0)):
        model.config = dataclasses.replace(cfg, **change)
        got = ReferenceExecutor(build_graph(model, max_ctx=32)).logits(tokens)
        assert rel_err(got, want) > 1e-2, change


@pytest.mark.oracle
def test_multimodal_checkpoint_text_model(tmp_path, capsys):
    """A Qwen3.5 image-text checkpoint: its language model is read (tensors under
    model.language_model., config under text_config), the vision tower is not (neither by
    the reference nor into a compiled artifact), and `hipc info` says so."""
    transformers = require("transformers")
    torch = require("torch")
    from hipc.cli.main import main

    text = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=97,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        intermediate_size=40,
        layer_types=["linear_attention", "full_attention"],
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        num_heads=2,
        intermediate_size=32,
        out_hidden_size=32,
        patch_size=4,
        spatial_merge_size=2,
        num_position_embeddings=16,
    )
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(2)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                p.add_(0.5 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    tokens = np.random.default_rng(0).integers(0, 97, size=12).tolist()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens])).logits[0].numpy()
    got = ReferenceExecutor(build_graph(load_model(tmp_path), max_ctx=32)).logits(tokens)
    assert rel_err(got, want) <= 1e-4
    assert main(["info", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["hybrid"]["vision_tower"].startswith("skipped")
    assert info["hybrid"]["linear_attention_layers"] == [0]
    # compiled for the CPU: the text model's weights only, the same logits
    out = tmp_path / "m.hipc"
    assert main(["compile", str(tmp_path), "--target", "cpu", "-o", str(out), "-q"]) == 0
    engine = load_engine(out)
    assert not any("visual" in w["name"] for w in engine.artifact.plan["weights"])
    assert rel_err(engine.logits(tokens), got) <= 1e-3


@pytest.mark.parametrize("target", ["sm_90", "gfx1100"])
def test_gpu_compile_refuses_a_too_wide_deltanet_block_in_one_line(target, tmp_path, capsys):
    """The GPU deltanet kernel holds a thread per state column of a key head's value heads:
    more than 1024 of them is refused in one line naming the layer (tests/compiler/
    test_hybrid_compile_gpu.py compiles the shapes it covers)."""
    from hipc.cli.main import main

    make_hybrid_hf(
        "qwen3_5", tmp_path / "hf", linear_num_key_heads=1, linear_num_value_heads=9,
        linear_value_head_dim=128,
    )  # fmt: skip
    rc = main(["compile", str(tmp_path / "hf"), "--target", target, "-o", str(tmp_path / "m")])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert rc == 2 and len(err) == 1 and err[0].startswith("hipc: error: l0.lin.delta")
    assert "1152 threads" in err[0], err[0]
