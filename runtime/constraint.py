"""Grammar-constrained decoding: a token mask per step from llguidance.

NOTE: llguidance over xgrammar, measured on this CPU-only machine with SmolLM2's 49,152-token
GGUF-built tokenizer (docs/API.md, "Structured outputs"): both install and both accept the
hipc tokenizer's tokenizer.json; xgrammar's mask is faster (~3 us against ~17 us median per
token, both far under a decode step of ~5 ms), but it needs torch and pulls triton and
apache-tvm-ffi, while llguidance is one Rust wheel that takes the tokenizer.json string the
runtime already has (no transformers object) and reports unsupported JSON-schema keywords
by name, which becomes the 400 a client sees.

A grammar is llguidance's own grammar string (from a JSON schema or Lark); a Constraint
follows one generation: `allowed(size)` is the mask over the logits, `advance(token)`
consumes the sampled token. It acts on host logits, so CPU and GPU targets share it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from hipc.base.errors import HipcError

# Compact JSON: no free whitespace, so a small model cannot spend its tokens on newlines.
_JSON_OPTIONS = {"whitespace_flexible": False}


MISSING = (
    "structured outputs and tool calls need the 'llguidance' package on the server "
    "(pip install -e '.[server]')"
)


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _llg():
    try:
        import llguidance
    except ImportError as exc:
        raise HipcError(MISSING) from exc
    return llguidance


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON documents valid against `schema`; HipcError names what is
    unsupported or invalid."""
    llg = _llg()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except Exception as exc:  # ValueError for bad JSON; anything else is the schema's too
        raise HipcError(_first_line(str(exc))) from None
    check_grammar(grammar)
    return grammar


def lark_grammar(lark: str) -> str:
    grammar = _llg().LLMatcher.grammar_from_lark(lark)
    check_grammar(grammar)
    return grammar


def check_grammar(grammar: str) -> None:
    is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise HipcError(_first_line(messages[0] if messages else "invalid grammar"))


def json_in_lark(schema: dict[str, Any]) -> str:
    """A Lark rule body matching one JSON value valid against `schema` (compact)."""
    body = {**schema, "x-guidance": _JSON_OPTIONS}
    return "%json " + json.dumps(body)


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer_json: str, vocab_size: int, eos: tuple[int, ...]):
    # ~0.4-1.3 s for a 49k vocabulary: built once per tokenizer
    return _llg().LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos))


def ll_tokenizer(tokenizer):
    cached = getattr(tokenizer, "_llg_tokenizer", None)
    if cached is None:
        cached = _ll_tokenizer(
            tokenizer.backend.to_str(), tokenizer.vocab_size, tuple(tokenizer.eos_token_ids)
        )
        tokenizer._llg_tokenizer = cached
    return cached


class Constraint:
    """One generation's position in a grammar."""

    def __init__(self, tokenizer, grammar: str) -> None:
        llg = _llg()
        self.vocab_size = tokenizer.vocab_size
        self.matcher = llg.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise HipcError(f"grammar: {_first_line(self.matcher.get_error())}")
        self._bits = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self, size: int) -> np.ndarray:
        """A boolean mask over `size` logits: the tokens the grammar allows next (ids past
        the tokenizer's vocabulary, padding rows of the output matrix, never)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        n = min(size, self.vocab_size)
        bits = np.unpackbits(self._bits.view(np.uint8), count=n, bitorder="little").view(bool)
        if n == size:
            return bits
        out = np.zeros(size, dtype=bool)
        out[:n] = bits
        return out

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise HipcError(f"grammar: token {token} was refused: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (only an end of sequence)."""
        return self.matcher.is_stopped()


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else "invalid grammar"
