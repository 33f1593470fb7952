"""Bad input: one clear line on stderr naming what is at fault, exit 2, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from hipc.cli.main import main

from support import write_tiny_hf


def run_cli(capsys, *argv):
    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, err


def assert_one_line_error(rc, err, *needles):
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hipc: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_hf(tmp_path / "tiny")


def test_missing_file(capsys, tmp_path):
    rc, err = run_cli(capsys, "info", str(tmp_path / "nope.gguf"))
    assert_one_line_error(rc, err, "nope.gguf", "no such file")


def test_unknown_model_id(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    rc, err = run_cli(capsys, "info", "some-org/not-a-model")
    assert_one_line_error(rc, err, "some-org/not-a-model", "never downloads")


def test_truncated_gguf(capsys, tmp_path, smollm2_gguf):
    bad = tmp_path / "cut.gguf"
    with smollm2_gguf.open("rb") as f:
        bad.write_bytes(f.read(3_000_000))
    rc, err = run_cli(capsys, "info", str(bad))
    assert_one_line_error(rc, err, "cut.gguf")


def test_not_a_gguf(capsys, tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"this is not a model at all" * 10)
    rc, err = run_cli(capsys, "info", str(bad))
    assert_one_line_error(rc, err, "junk.gguf", "not a GGUF file")


def test_truncated_safetensors(capsys, tiny):
    st = tiny / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    rc, err = run_cli(capsys, "info", str(tiny))
    assert_one_line_error(rc, err, "model.safetensors", "truncated")


def test_corrupt_safetensors_header(capsys, tiny):
    st = tiny / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[8:20] = b"\xff" * 12
    st.write_bytes(bytes(data))
    rc, err = run_cli(capsys, "info", str(tiny))
    assert_one_line_error(rc, err, "model.safetensors", "corrupt")


def test_tensor_shape_mismatch(capsys, tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (tiny / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli(capsys, "info", str(tiny))
    assert_one_line_error(rc, err, "mlp.gate_proj.weight", "[64, 32]", "[48, 32]")


def test_missing_tensor(capsys, tmp_path):
    folder = write_tiny_hf(tmp_path / "m", num_hidden_layers=2)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli(capsys, "info", str(folder))
    assert_one_line_error(rc, err, "model.layers.2.")


def test_unknown_architecture(capsys, tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tiny / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli(capsys, "info", str(tiny))
    assert_one_line_error(rc, err, "GPTNeoXForCausalLM", "LlamaForCausalLM", "supported")


def test_malformed_config_json(capsys, tiny):
    (tiny / "config.json").write_text('{"hidden_size": 32,,}')
    rc, err = run_cli(capsys, "info", str(tiny))
    assert_one_line_error(rc, err, "config.json", "malformed")


def test_config_field_wrong_type(capsys, tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["num_hidden_layers"] = "two"
    (tiny / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli(capsys, "info", str(tiny))
    assert_one_line_error(rc, err, "num_layers")


def test_config_missing_field(capsys, tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    del cfg["vocab_size"]
    (tiny / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli(capsys, "info", str(tiny))
    assert_one_line_error(rc, err, "config.json", "vocab_size")


def test_tokens_out_of_vocabulary(capsys, tiny, tmp_path):
    rc, err = run_cli(
        capsys,
        "logits",
        str(tiny),
        "--tokens",
        "1,2,97",
        "--out",
        str(tmp_path / "l.npy"),
        "--reference",
    )
    assert_one_line_error(rc, err, "--tokens", "97", "out of vocabulary")
    assert not (tmp_path / "l.npy").exists()


def test_tokens_not_integers(capsys, tiny, tmp_path):
    rc, err = run_cli(
        capsys,
        "logits",
        str(tiny),
        "--tokens",
        "1,x",
        "--out",
        str(tmp_path / "l.npy"),
        "--reference",
    )
    assert_one_line_error(rc, err, "--tokens")


def test_logits_out_dir_missing(capsys, tiny, tmp_path):
    out = tmp_path / "no" / "such" / "l.npy"
    rc, err = run_cli(
        capsys, "logits", str(tiny), "--tokens", "1,2", "--out", str(out), "--reference"
    )
    assert_one_line_error(rc, err, "--out")


def test_console_script_has_no_traceback(tmp_path):
    exe = shutil.which("hipc")
    cmd = [exe] if exe else [sys.executable, "-m", "hipc.cli.main"]
    proc = subprocess.run(
        [*cmd, "info", str(tmp_path / "missing.gguf")], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("hipc: error: ")
