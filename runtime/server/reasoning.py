"""Splitting a reply into reasoning (`<think>...</think>`) and content, as text streams in.

A state machine over text deltas, so streaming and non-streaming split the same way: feeding
the whole text at once gives exactly the concatenation of what feeding it piece by piece
gives. Text that might still be the start of a tag is held back until it cannot be.

- START: the reply may open with `<think>` (after whitespace). Seeing it enters REASONING;
  anything else makes the whole reply content.
- REASONING: text up to `</think>` is reasoning; the rest is content. A chat template can
  open the think block itself (DeepSeek-R1, Qwen3-thinking templates end the prompt with
  `<think>`): then the reply starts here.
- CONTENT: everything passes through, later tags included.

The tags themselves are dropped; the text between and after them is kept verbatim.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def prompt_opens_think(prompt: str) -> bool:
    """Whether a rendered chat prompt leaves a think block open for the reply."""
    return prompt.rstrip().endswith(OPEN)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, in_reasoning: bool = False) -> None:
        self.state = _REASONING if in_reasoning else _START
        self.opened = in_reasoning  # whether the reply has a think block at all
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Add text; returns (reasoning, content) released by it."""
        if self.state == _CONTENT:
            return "", text
        self._buf += text
        if self.state == _START:
            head = self._buf.lstrip()
            if head.startswith(OPEN):
                self.state, self._buf = _REASONING, head[len(OPEN) :]
                self.opened = True
            elif OPEN.startswith(head):
                return "", ""  # still possibly '<think>' (or only whitespace so far)
            else:
                self.state, out, self._buf = _CONTENT, self._buf, ""
                return "", out
        end = self._buf.find(CLOSE)
        if end >= 0:
            reasoning, content = self._buf[:end], self._buf[end + len(CLOSE) :]
            self.state, self._buf = _CONTENT, ""
            return reasoning, content
        keep = _partial_suffix(self._buf, CLOSE)
        out = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep :]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """The end of the reply: release what was held back."""
        held, self._buf = self._buf, ""
        if self.state == _REASONING:
            return held, ""
        return "", held


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning or None if there was no think block, content) of a whole reply."""
    splitter = ReasoningSplitter(in_reasoning)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2 if splitter.opened else None), c1 + c2
