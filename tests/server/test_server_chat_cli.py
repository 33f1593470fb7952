"""`hipc chat`: the terminal conversation gives the replies the server gives for the same
conversation (greedy), turn after turn."""

from __future__ import annotations

import io

import pytest

from hipc.cli.main import main


def server_replies(server, model, turns, max_tokens):
    client = server.client()
    messages, replies = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0
        )
        reply = r.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


def run_chat(monkeypatch, capsys, artifact, lines, *flags):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["chat", str(artifact), *flags]) == 0
    return capsys.readouterr().out


def test_chat_matches_the_server_turn_by_turn(tiny_server, tiny_artifact, monkeypatch, capsys):
    turns = ["Hello there", "And then?", "Tell me more"]
    want = server_replies(tiny_server, "tiny", turns, 20)
    out = run_chat(monkeypatch, capsys, tiny_artifact, turns, "--max-tokens", "20")
    assert out == "".join(r + "\n" for r in want)


def test_chat_commands(tiny_artifact, monkeypatch, capsys):
    first = run_chat(monkeypatch, capsys, tiny_artifact, ["Hi"], "--max-tokens", "8")
    out = run_chat(
        monkeypatch, capsys, tiny_artifact, ["Hi", "/reset", "Hi", "/exit", "never read"],
        "--max-tokens", "8",
    )  # fmt: skip
    # after /reset the same first turn gives the same reply; /exit stops reading
    assert out == first + "(new conversation)\n" + first


def test_chat_drops_old_turns_when_the_context_fills(tiny_artifact, monkeypatch, capsys):
    turn = "word " * 60  # ~190 tokens with the template: one turn fits in 256, two do not
    first = run_chat(monkeypatch, capsys, tiny_artifact, [turn], "--max-tokens", "4")
    out = run_chat(monkeypatch, capsys, tiny_artifact, [turn] * 4, "--max-tokens", "4")
    # each new turn pushes the previous one out, leaving the prompt of the first turn
    assert out == first * 4
    assert main(["chat", str(tiny_artifact)]) == 0  # empty stdin: nothing to do


def test_chat_refuses_a_non_artifact(tmp_path, capsys):
    assert main(["chat", str(tmp_path)]) == 2
    assert "not a compiled artifact" in capsys.readouterr().err


@pytest.mark.slow
def test_chat_with_smollm2_matches_the_server(smol_server, smol_artifact, monkeypatch, capsys):
    turns = ["What is the capital of France?", "And of Italy?"]
    want = server_replies(smol_server, "smol", turns, 24)
    out = run_chat(monkeypatch, capsys, smol_artifact, turns, "--max-tokens", "24")
    assert out == "".join(r + "\n" for r in want)
