"""Artifacts and running servers shared by the server tests (built once per session)."""

from __future__ import annotations

import pytest

from hipc.cli.main import main

from serving import API_KEY, running
from support import THINK_TEMPLATE, smollm2_path, write_tiny_chat_model

TINY_CONTEXT = 256


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory):
    """A random 2-layer Llama with a 384-token byte-level BPE tokenizer, compiled for the CPU."""
    root = tmp_path_factory.mktemp("tiny")
    write_tiny_chat_model(root / "tiny", max_context=TINY_CONTEXT)
    out = root / "tiny.hipc"
    assert main(["compile", str(root / "tiny"), "-o", str(out), "-q"]) == 0
    return out


@pytest.fixture(scope="session")
def smol_artifact(tmp_path_factory):
    smollm2_path()  # skips (or fails under CI) without the model package
    out = tmp_path_factory.mktemp("smol") / "smol.hipc"
    assert main(["compile", "smollm2-135m", "-o", str(out), "-q"]) == 0
    return out


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def tiny_server(tiny_artifact, server_logs):
    with running(
        tiny_artifact,
        "--served-model-name", "tiny",
        "--threads", "1",
        "--max-body-bytes", "65536",
        log_dir=server_logs,
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="session")
def think_server(tiny_artifact, server_logs, tmp_path_factory):
    """The tiny model behind a template that opens <think> itself; configured through
    HIPC_* variables only, to show they work."""
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    env = {
        "HIPC_API_KEY": API_KEY,
        "HIPC_SERVED_MODEL_NAME": "thinker",
        "HIPC_CHAT_TEMPLATE": str(template),
        "HIPC_THREADS": "1",
    }
    with running(tiny_artifact, log_dir=server_logs, env=env) as server:
        yield server


@pytest.fixture(scope="session")
def smol_server(smol_artifact, server_logs):
    with running(smol_artifact, "--served-model-name", "smol", log_dir=server_logs) as server:
        yield server
