"""Starting and stopping `hipc serve`: refusals at startup are one-line errors (exit 2);
SIGTERM stops accepting, finishes or cancels in-flight work, and exits 0."""

from __future__ import annotations

import signal
import socket
import threading
import time

import openai
import pytest

from hipc.cli.main import main

from serving import ServerProcess


def serve_error(capsys, *argv, env=None, monkeypatch=None) -> str:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    assert main(["serve", *argv]) == 2
    return capsys.readouterr().err


def test_kv_storage_the_cpu_cannot_store_is_refused(tiny_artifact, capsys, monkeypatch):
    err = serve_error(capsys, str(tiny_artifact), "--kv-storage", "bf16", "--port", "0")
    assert (
        "--kv-storage bf16: this artifact's KV cache is float32 on the cpu target" in err
        and "hipc compile MODEL --kv-storage bfloat16 (GPU targets only)" in err
    )
    err = serve_error(
        capsys, str(tiny_artifact), env={"HIPC_KV_STORAGE": "int8"}, monkeypatch=monkeypatch
    )
    assert "--kv-storage int8" in err and "float32" in err


def test_more_context_than_the_artifact_holds_is_refused(tiny_artifact, capsys):
    err = serve_error(capsys, str(tiny_artifact), "--max-context-tokens", "100000")
    assert "the artifact's KV cache holds 256 positions" in err
    assert "recompile with a larger --max-context" in err


def test_not_an_artifact(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HIPC_ARTIFACT", raising=False)
    assert "no artifact to serve" in serve_error(capsys)
    assert "not a compiled artifact" in serve_error(capsys, str(tmp_path))


def test_an_artifact_without_a_tokenizer(tiny_artifact, tmp_path, capsys):
    import shutil

    copy = tmp_path / "notok.hipc"
    shutil.copytree(tiny_artifact, copy)
    (copy / "tokenizer.json").unlink()
    assert "the artifact has no tokenizer" in serve_error(capsys, str(copy))


def test_bad_environment_value(tiny_artifact, capsys, monkeypatch):
    err = serve_error(
        capsys, str(tiny_artifact), env={"HIPC_PORT": "eighty"}, monkeypatch=monkeypatch
    )
    assert "HIPC_PORT='eighty'" in err


def test_port_in_use(tiny_artifact, capsys, monkeypatch):
    from hipc.runtime.server import serve

    loads = []
    real_load = serve.load
    monkeypatch.setattr(serve, "load", lambda config: loads.append(config) or real_load(config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = serve_error(capsys, str(tiny_artifact), "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in err
    assert loads == []  # refused before loading the model, not after warming it


def test_a_missing_prometheus_multiproc_dir_is_refused_before_loading(
    tiny_artifact, tmp_path, capsys, monkeypatch
):
    from hipc.runtime.server import serve

    loads = []
    monkeypatch.setattr(serve, "load", lambda config: loads.append(config))
    missing = tmp_path / "metrics"
    env = {"PROMETHEUS_MULTIPROC_DIR": str(missing)}
    err = serve_error(capsys, str(tiny_artifact), "--port", "0", env=env, monkeypatch=monkeypatch)
    line = f"hipc: error: PROMETHEUS_MULTIPROC_DIR={missing}: not a directory (create it first)"
    assert err.strip().splitlines() == [line]
    assert "Traceback" not in err and loads == []


def refused(server) -> bool:
    try:
        socket.create_connection((server.host, server.port), timeout=1).close()
        return False
    except OSError:
        return True


@pytest.mark.slow
def test_sigterm_lets_the_running_stream_finish(smol_artifact, server_logs):
    server = ServerProcess(smol_artifact, "--served-model-name", "smol", log_dir=server_logs)
    # the port opened after the warmup: ready from the first connection
    assert server.request("GET", "/ready", auth=False)[:1] == (200,)
    client = server.client()
    stream = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 3
    while not refused(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert refused(server)  # no new connections ...
    rest = list(chunks)  # ... but the running stream goes on to its end
    assert rest[-1].usage.completion_tokens == 48
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert server.proc.wait(30) == 0
    assert "stopped" in server.log()


@pytest.mark.slow
def test_sigterm_cancels_what_outlasts_the_grace_period(smol_artifact, server_logs):
    server = ServerProcess(
        smol_artifact, "--served-model-name", "smol", "--shutdown-timeout", "0.5",
        "--no-eager-load", "--max-batch", "1", log_dir=server_logs,
    )  # fmt: skip
    # (--max-batch 1: one at a time, so that the second request waits in the queue)
    client = server.client()
    kw = dict(
        model="smol", messages=[{"role": "user", "content": "Count to a million."}], temperature=0
    )
    stream = client.chat.completions.create(
        **kw, max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks)
    queued = {}

    def waiting():
        try:
            client.chat.completions.create(**kw, max_tokens=4)
            queued["status"] = 200
        except openai.APIStatusError as e:
            queued["status"] = e.status_code

    t = threading.Thread(target=waiting)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError, match="shut down"):
        for _ in chunks:
            pass
    t.join(30)
    assert queued["status"] == 503
    assert server.proc.wait(30) == 0
    assert time.monotonic() - t0 < 10
