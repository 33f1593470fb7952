"""Bad input: one clear line on stderr naming what is at fault, exit 2, no traceback."""

from __future__ import annotations

import argparse
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


# ------------------------------------------------------------------ the command line itself


def test_version(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"hipc {importlib.metadata.version('hipc-compiler')}"


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ["generate", "m", "--prompt", "x", "--tempature", "0.5"],
            ["--tempature", "did you mean --temperature?"],
        ),
        (["compile", "m", "--max-contxt", "64"], ["did you mean --max-context?"]),
        (
            ["compile", "m", "--prefil-chunk=64"],
            ["--prefil-chunk", "did you mean --prefill-chunk?"],
        ),
        (
            ["generate", "m", "--prompt", "x", "--zzz"],
            ["unknown option --zzz", "hipc generate --help"],
        ),
        (["generat", "m"], ["'generat'", "did you mean generate?"]),
        (["cache", "wipe"], ["'wipe'", "info, clear"]),
        (["generate", "m", "--prompt", "x", "extra"], ["unexpected argument 'extra'"]),
        (["generate", "m"], ["--prompt"]),
        (["generate", "m", "--prompt", "x", "--top-k", "many"], ["--top-k", "'many'"]),
        ([], ["COMMAND"]),
    ],
)
def test_bad_command_lines_are_one_line(capsys, argv, needles):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals exit from inside parse
        rc = e.code
    assert_one_line_error(rc, capsys.readouterr().err, *needles)


def test_every_generate_flag_has_help_and_its_default(capsys):
    from hipc.cli.main import build_parser

    parser = build_parser()
    for name in ("generate", "chat"):
        sub = parser._subcommands[name]
        for action in sub._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            assert action.help, (name, action.option_strings)
            if action.nargs != 0 and not action.required:  # takes a value: say its default
                assert "default" in action.help, (name, action.option_strings)


def test_model_commands_given_an_artifact_say_they_take_a_model(capsys, tiny, tmp_path):
    out = tmp_path / "t.hipc"
    assert main(["compile", str(tiny), "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    for command in ("verify", "compile"):
        rc, err = run_cli(capsys, command, str(out))
        assert_one_line_error(rc, err, str(out), f"hipc {command}` takes a model", str(tiny))


def test_compile_prefill_chunk_and_its_deprecated_spelling(capsys, tiny, tmp_path):
    def chunk(out):
        return json.loads((out / "plan.json").read_text())["max_tokens"]

    assert (
        main(["compile", str(tiny), "-o", str(tmp_path / "a.hipc"), "--prefill-chunk", "8", "-q"])
        == 0
    )
    assert chunk(tmp_path / "a.hipc") == 8
    assert "deprecated" not in capsys.readouterr().err
    assert (
        main(["compile", str(tiny), "-o", str(tmp_path / "b.hipc"), "--max-tokens", "16", "-q"])
        == 0
    )
    assert chunk(tmp_path / "b.hipc") == 16
    err = capsys.readouterr().err
    assert (
        "hipc: warning:" in err
        and "--max-tokens` is deprecated" in err
        and "--prefill-chunk" in err
    )
    rc, err = run_cli(capsys, "compile", str(tiny), "--prefill-chunk", "8", "--max-tokens", "16")
    assert_one_line_error(rc, err, "--prefill-chunk")
    rc, err = run_cli(capsys, "compile", str(tiny), "--prefill-chunk", "0")
    assert_one_line_error(rc, err, "--prefill-chunk must be in 1..8192")


def test_a_capped_context_is_said(capsys, tmp_path):
    model = write_tiny_hf(tmp_path / "long", max_position_embeddings=8192)
    assert main(["compile", str(model), "-o", str(tmp_path / "a.hipc"), "-q"]) == 0
    err = capsys.readouterr().err
    assert "max context capped at 4096 for cpu (the model allows 8192" in err
    assert json.loads((tmp_path / "a.hipc" / "plan.json").read_text())["max_context"] == 4096
    assert (
        main(["compile", str(model), "-o", str(tmp_path / "b.hipc"), "--max-context", "64", "-q"])
        == 0
    )
    assert "max context capped" not in capsys.readouterr().err
