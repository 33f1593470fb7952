"""`hipc chat`: an interactive conversation in the terminal, on the same engine and pieces
the server uses (chat template, generation loop, <think> splitter), streamed as it comes.

Commands: /reset clears the conversation, /exit (or Ctrl-D) leaves; Ctrl-C stops a reply.
When the conversation outgrows the context, the oldest turns are dropped.
On a terminal, reasoning shows dimmed; piped, only the reply is printed (one reply per
input line), unless --show-reasoning.
"""

from __future__ import annotations

import sys
from typing import TextIO

from hipc.base.errors import HipcError
from hipc.runtime.generate import Generation, GenerationRequest
from hipc.runtime.sampler import SamplingParams
from hipc.runtime.server.reasoning import ReasoningSplitter, prompt_opens_think
from hipc.runtime.server.service import reasoning_enabled, render_prompt

DIM, RESET = "\x1b[2m", "\x1b[0m"
HELP = "commands: /reset (new conversation), /exit (or Ctrl-D); Ctrl-C stops a reply"


def run_chat(
    engine,
    *,
    sampling: SamplingParams,
    max_tokens: int | None = None,
    system: str | None = None,
    chat_template: str | None = None,
    reasoning: str = "auto",
    show_reasoning: bool = False,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
) -> int:
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    tokenizer = engine.tokenizer
    template = chat_template or tokenizer.chat_template
    split = reasoning_enabled(reasoning, tokenizer, template)
    tty = stdin.isatty() and stdout.isatty()
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    if tty:
        stdout.write(f"hipc chat: {HELP}\n")
    while True:
        line = _read(stdin, stdout, tty)
        if line is None or line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = list(base)
            stdout.write("(new conversation)\n")
            continue
        if line.strip() == "/help":
            stdout.write(HELP + "\n")
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids, text = _fit(tokenizer, template, messages, len(base), engine.max_context)
        except HipcError as e:
            messages.pop()
            stdout.write(f"hipc: {e}\n")
            continue
        request = GenerationRequest(prompt_ids=tuple(ids), max_tokens=max_tokens, sampling=sampling)
        splitter = ReasoningSplitter(prompt_opens_think(text)) if split else None
        reply = []
        try:
            for step in Generation(engine, tokenizer, request).steps():
                _show(stdout, splitter, step.text, reply, tty or show_reasoning, tty)
        except KeyboardInterrupt:
            stdout.write(" [stopped]")
        if splitter is not None:
            r, c = splitter.finish()
            _write(stdout, r, c, reply, tty or show_reasoning, tty)
        stdout.write("\n")
        stdout.flush()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _read(stdin: TextIO, stdout: TextIO, tty: bool) -> str | None:
    try:
        if tty:
            return input("> ")
        line = stdin.readline()
        return line.rstrip("\n") if line else None
    except EOFError:
        return None
    except KeyboardInterrupt:
        stdout.write("\n")
        return None


def _fit(tokenizer, template, messages: list[dict], keep: int, context: int):
    """The prompt, dropping the oldest turns (after `keep` system messages) until it fits."""
    while True:
        ids, text = render_prompt(tokenizer, template, messages, {})
        if len(ids) < context:
            return ids, text
        if len(messages) - keep <= 1:
            raise HipcError(
                f"this message makes a {len(ids)}-token prompt; the context holds {context}"
            )
        del messages[keep : keep + 2]  # the oldest user turn and its reply


def _show(stdout, splitter, text: str, reply: list[str], show_r: bool, tty: bool) -> None:
    if not text:
        return
    r, c = splitter.feed(text) if splitter is not None else ("", text)
    _write(stdout, r, c, reply, show_r, tty)


def _write(stdout, r: str, c: str, reply: list[str], show_r: bool, tty: bool) -> None:
    if r and show_r:
        stdout.write(f"{DIM}{r}{RESET}" if tty else r)
    if c:
        stdout.write(c)
        reply.append(c)
    stdout.flush()
