"""The CLI contract on the real SmolLM2 model and a tiny random one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hipc.cli.main import main

from support import write_tiny_hf


def test_info_reports_config_and_graph(capsys, tmp_path):
    folder = write_tiny_hf(tmp_path / "m")
    assert main(["info", str(folder)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["family"] == "llama"
    assert info["config"]["num_kv_heads"] == 2
    assert info["graph"]["ops"]["hipc::CachedAttention"] == 2
    assert info["graph"]["parameters"] == sum(
        np.prod(s)
        for s in [(97, 32), (97, 32), (32,)]
        + [(32,)] * 4
        + [(32, 32), (16, 32), (16, 32), (32, 32)] * 2
        + [(64, 32), (64, 32), (32, 64)] * 2
    )


def test_logits_shape_and_prefix_consistency(capsys, tmp_path):
    folder = write_tiny_hf(tmp_path / "m")
    out = tmp_path / "l.npy"
    assert (
        main(["logits", str(folder), "--tokens", "5,6,7,8", "--out", str(out), "--reference"]) == 0
    )
    full = np.load(out)
    assert full.shape == (4, 97) and full.dtype == np.float32
    # causality: the logits of a prefix do not depend on later tokens
    assert main(["logits", str(folder), "--tokens", "5,6", "--out", str(out), "--reference"]) == 0
    np.testing.assert_allclose(np.load(out), full[:2], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tokenize_smollm2(capsys, smollm2_gguf):
    assert main(["tokenize", str(smollm2_gguf), "--text", "The capital of France is"]) == 0
    assert json.loads(capsys.readouterr().out) == [504, 3575, 282, 4649, 314]
    assert main(["tokenize", "smollm2-135m", "--text", "Hi", "--chat"]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert ids[0] == 1 and ids[-3:] == [520, 9531, 198]  # <|im_start|>assistant\n


@pytest.mark.slow
def test_generate_json_contract(capsys):
    argv = [
        "generate",
        "smollm2-135m",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "6",
        "--reference",
        "--json",
        "--max-context",
        "64",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    result = json.loads(out[-1])
    assert set(result) >= {
        "text",
        "token_ids",
        "prompt_token_ids",
        "finish_reason",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
    }
    assert result["prompt_token_ids"] == [504, 3575, 282, 4649, 314]
    assert result["text"].startswith(" Paris")
    assert result["finish_reason"] in ("stop", "length")
    assert len(result["token_ids"]) <= 6
    assert "\n".join(out[:-1]).strip() == result["text"].strip()


@pytest.mark.slow
def test_generate_stop_string_and_seed(capsys):
    base = [
        "generate",
        "smollm2-135m",
        "--prompt",
        "Count: 1, 2, 3,",
        "--max-tokens",
        "12",
        "--reference",
        "--json",
        "--max-context",
        "64",
    ]
    assert main([*base, "--stop", " 5"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert " 5" not in result["text"] and result["finish_reason"] == "stop"
    sampled = [*base, "--temperature", "0.9", "--seed", "3", "--ignore-eos"]
    assert main(sampled) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert main(sampled) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"] == first["token_ids"]
