"""A tokenizer rebuilt from GGUF metadata.

A GGUF file carries no tokenizer.json, only llama.cpp's description of one: the vocabulary,
the merges or scores, token types, the special ids and the name of a pre-tokenizer. This
module turns that back into a `tokenizers.Tokenizer` that splits text the way llama.cpp
does, wrapped in the runtime's `Tokenizer` with its BOS/EOS facts.

Two vocabulary kinds are supported:

* 'gpt2': byte-level BPE with explicit merges. How text is cut before merging depends on
  `tokenizer.ggml.pre`; the regexes are llama.cpp's (equivalently, the ones in the original
  models' tokenizer.json files).
* 'llama': SentencePiece BPE. GGUF keeps only token scores, so the merges are recovered
  from them: a token that is the concatenation of two others is a merge, ranked by its score.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from hipc.base.errors import HipcError
from hipc.base.tokenizer import Tokenizer

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The pre-tokenizers of byte-level vocabularies, by llama.cpp's `tokenizer.ggml.pre` name.
# GPT-2's regex is built into tokenizers' ByteLevel pre-tokenizer; the others are applied
# as a Split before a regex-less ByteLevel.
_GPT2_REGEX = None  # ByteLevel(use_regex=True)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class _PreTok:
    """How one `tokenizer.ggml.pre` family cuts text before BPE."""

    def __init__(
        self,
        regex: str | None,
        *,
        split_digits: bool = False,
        ignore_merges: bool = False,
        add_bos: bool = False,
        nfc: bool = False,
    ) -> None:
        self.regex = regex
        self.split_digits = split_digits  # each digit its own piece, before the regex
        self.ignore_merges = ignore_merges  # a piece that is a whole token is used as is
        self.add_bos = add_bos  # llama.cpp's default when the file does not say
        self.nfc = nfc


_GPT2 = _PreTok(_GPT2_REGEX)
_STARCODER = _PreTok(_GPT2_REGEX, split_digits=True)
_LLAMA3 = _PreTok(_LLAMA3_REGEX, ignore_merges=True, add_bos=True)
_QWEN2 = _PreTok(_QWEN2_REGEX, nfc=True)

PRE_TOKENIZERS: dict[str, _PreTok] = {
    # llama.cpp falls back to a four-regex legacy default for 'default'; files that say it
    # are GPT-2-style vocabularies, and transformers reads them as GPT-2 too.
    "default": _GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "jais": _GPT2,
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "command-r": _STARCODER,
    "codeshell": _STARCODER,
    "exaone": _STARCODER,
    "minerva-7b": _STARCODER,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
    "dbrx": _PreTok(_LLAMA3_REGEX),
    "smaug-bpe": _PreTok(_LLAMA3_REGEX),
    # Qwen2's tokenizer.json NFC-normalizes before splitting.
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "stablelm2": _PreTok(_QWEN2_REGEX),
}

# Control tokens llama.cpp also treats as end of generation when the file marks no EOT.
_END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
)


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
    """The runtime tokenizer that a GGUF file's `tokenizer.*` metadata describes."""
    model = _get(meta, "tokenizer.ggml.model", str)
    tokens = _strings(meta, "tokenizer.ggml.tokens")
    if not tokens:
        raise HipcError("GGUF metadata: tokenizer.ggml.tokens is empty")
    types = _ints(meta, "tokenizer.ggml.token_type", len(tokens), default=NORMAL)

    if model == "gpt2":
        pre_name = meta.get("tokenizer.ggml.pre") or "default"
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise HipcError(
                f"GGUF metadata: tokenizer.ggml.pre {pre_name!r} is not supported "
                f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        backend = _byte_level_bpe(tokens, types, _merges(meta), pre)
        default_add_bos = pre.add_bos
    elif model == "llama":
        add_space_prefix = _flag(meta, "tokenizer.ggml.add_space_prefix", True)
        scores = _floats(meta, "tokenizer.ggml.scores", len(tokens))
        unk_id = _optional_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
        backend = _sentencepiece_bpe(tokens, types, scores, unk_id, add_space_prefix)
        default_add_bos = True
    else:
        raise HipcError(
            f"GGUF metadata: tokenizer.ggml.model {model!r} is not supported "
            "(supported: 'gpt2', 'llama')"
        )

    bos_id = _optional_id(meta, "tokenizer.ggml.bos_token_id", len(tokens))
    eos_ids = _eos_ids(meta, tokens, types)
    add_bos = _flag(meta, "tokenizer.ggml.add_bos_token", default_add_bos) and bos_id is not None
    add_eos = _flag(meta, "tokenizer.ggml.add_eos_token", False) and bool(eos_ids)
    chat_template = meta.get("tokenizer.chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise HipcError("GGUF metadata: tokenizer.chat_template must be a string")

    return Tokenizer.from_json(
        backend.to_str(),
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        add_bos=add_bos,
        add_eos=add_eos,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_ids[0]] if eos_ids else None,
        chat_template=chat_template,
        source="GGUF tokenizer",
    )


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The metadata of a GGUF file as plain Python values, by key."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise HipcError(f"{path}: not a readable GGUF file: {exc}") from None
    return {name: field.contents() for name, field in reader.fields.items()}


# --------------------------------------------------------------------- builders


def _byte_level_bpe(
    tokens: list[str], types: list[int], merges: list[tuple[str, str]], pre: _PreTok
) -> Any:
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    try:
        model = models.BPE(
            vocab=_vocab(tokens),
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre.ignore_merges,
        )
    except Exception as exc:
        # e.g. a merge naming a token that is not in the vocabulary
        raise HipcError(f"GGUF metadata: tokenizer.ggml.merges: {exc}") from None
    backend = Backend(model)
    steps = []
    if pre.split_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pre.regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(pre.regex), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, types)
    return backend


def _sentencepiece_bpe(
    tokens: list[str],
    types: list[int],
    scores: list[float],
    unk_id: int | None,
    add_space_prefix: bool,
) -> Any:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    vocab = _vocab(tokens)
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_scores(tokens, types, scores),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            # Characters outside the vocabulary become their UTF-8 bytes, <0xNN> tokens.
            byte_fallback=True,
        )
    )
    # SentencePiece (and llama.cpp) spell spaces as '▁' and add one before the text, and
    # again after each special token; a normalizer does exactly that, per text segment.
    steps = []
    if add_space_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = None
    undo = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        undo.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(undo)
    _add_special_tokens(backend, tokens, types)
    return backend


def _merges_from_scores(
    tokens: list[str], types: list[int], scores: list[float]
) -> list[tuple[str, str]]:
    """Every way to build a token from two others, best-scored result first.

    SentencePiece BPE merges the adjacent pair whose concatenation scores highest; ranking
    the merges by that score gives tokenizers' BPE the same choice. Control, byte and unused
    entries are never the result of a merge in SentencePiece, so they are left out.
    """
    index: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # The first of repeated spellings is the one the vocabulary keeps (see _vocab).
        if types[i] in (NORMAL, USER_DEFINED) and token not in index:
            index[token] = i
    found: list[tuple[float, int, int, str, str]] = []
    for token, token_id in index.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                # Ties in score are broken by the result's position in the vocabulary,
                # then by the shorter left piece, so the order is fully determined.
                found.append((-scores[token_id], token_id, cut, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _add_special_tokens(backend: Any, tokens: list[str], types: list[int]) -> None:
    """Make control and user-defined tokens match whole in text, as llama.cpp does.

    Control (and unknown) tokens are special: `skip_special_tokens` drops them when decoding.
    User-defined ones (say '<think>') are ordinary text that must not be cut into pieces.
    """
    from tokenizers import AddedToken

    special = [
        AddedToken(tokens[i], normalized=False, special=True)
        for i, kind in enumerate(types)
        if kind in (CONTROL, UNKNOWN) and tokens[i]
    ]
    user = [
        AddedToken(tokens[i], normalized=False, special=False)
        for i, kind in enumerate(types)
        if kind == USER_DEFINED and tokens[i]
    ]
    before = backend.get_vocab_size(with_added_tokens=True)
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
    # Each added token is already in the vocabulary, so it keeps its id; a new id would
    # mean the tokenizer and the model's embedding table disagree.
    if backend.get_vocab_size(with_added_tokens=True) != before:
        raise HipcError("GGUF metadata: a special token is missing from tokenizer.ggml.tokens")


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in vocab:
            # Some conversions repeat a placeholder. The id must still exist for the model's
            # embedding table, so the repeat gets a name no text can produce.
            token = f"<hipc-duplicate-{i}>\x00"
        vocab[token] = i
    return vocab


# --------------------------------------------------------------------- metadata access


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    merges = []
    for n, merge in enumerate(_strings(meta, "tokenizer.ggml.merges")):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise HipcError(f"GGUF metadata: tokenizer.ggml.merges[{n}] {merge!r} is not 'a b'")
        merges.append((parts[0], parts[1]))
    return merges


def _eos_ids(meta: dict[str, Any], tokens: list[str], types: list[int]) -> tuple[int, ...]:
    """End-of-generation ids: EOS first, then EOT/EOM, then llama.cpp's well-known names."""
    ids: list[int] = []
    for key in (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        token_id = _optional_id(meta, key, len(tokens))
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == CONTROL and token in _END_OF_TURN_TEXTS and i not in ids:
            ids.append(i)
    return tuple(ids)


def _get(meta: dict[str, Any], key: str, kind: type) -> Any:
    if key not in meta:
        raise HipcError(f"GGUF metadata: {key} is missing")
    value = meta[key]
    if not isinstance(value, kind):
        raise HipcError(f"GGUF metadata: {key} must be a {kind.__name__}")
    return value


def _sequence(meta: dict[str, Any], key: str) -> Sequence[Any]:
    value = meta.get(key)
    if value is None:
        raise HipcError(f"GGUF metadata: {key} is missing")
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise HipcError(f"GGUF metadata: {key} must be an array")
    return value


def _strings(meta: dict[str, Any], key: str) -> list[str]:
    values = list(_sequence(meta, key))
    if not all(isinstance(v, str) for v in values):
        raise HipcError(f"GGUF metadata: {key} must be an array of strings")
    return values


def _ints(meta: dict[str, Any], key: str, length: int, *, default: int) -> list[int]:
    if key not in meta:
        return [default] * length
    values = [int(v) for v in _sequence(meta, key)]
    if len(values) != length:
        raise HipcError(f"GGUF metadata: {key} has {len(values)} entries for {length} tokens")
    return values


def _floats(meta: dict[str, Any], key: str, length: int) -> list[float]:
    values = [float(v) for v in _sequence(meta, key)]
    if len(values) != length:
        raise HipcError(f"GGUF metadata: {key} has {len(values)} entries for {length} tokens")
    return values


def _optional_id(meta: dict[str, Any], key: str, vocab_size: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    try:
        # operator.index accepts numpy integers, as some readers return them.
        value = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        value = None
    if value is None:
        raise HipcError(f"GGUF metadata: {key} must be an integer")
    if not 0 <= value < vocab_size:
        raise HipcError(f"GGUF metadata: {key} {value} is outside the vocabulary of {vocab_size}")
    return value


def _flag(meta: dict[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HipcError(f"GGUF metadata: {key} must be a boolean")
    return value
