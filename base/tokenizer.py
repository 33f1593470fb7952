"""Text <-> token ids, on top of the `tokenizers` library.

A `Tokenizer` is the library's tokenizer plus the few facts the runtime needs beside it: which
ids begin and end a sequence, whether `encode` adds them, the special-token strings a chat
template expects, and the model's own chat template. It round-trips through `to_json()` and
`to_dict()` so an artifact can carry it without the original model folder.

`IncrementalDecoder` turns a stream of generated ids into a stream of text.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hipc.base.errors import HipcError

# Bumped when the meaning of a field in `to_dict()` changes, so old artifacts are refused
# instead of silently misread.
_META_VERSION = 1


@functools.cache
def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet byte-level BPE vocabularies
    spell their tokens in (bytes that print as themselves keep their character; the rest
    map to U+0100 onwards, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _backend():
    # Imported here so a missing `tokenizers` surfaces as one clear line, not a traceback.
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - it is a hard dependency
        raise HipcError(
            "the 'tokenizers' package is not installed (pip install tokenizers)"
        ) from exc
    return tokenizers


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Tokenizer:
    """A `tokenizers.Tokenizer` with the model's BOS/EOS conventions and chat template.

    `add_bos` / `add_eos` say what `encode(text)` puts around the text, whoever does it: when
    tokenizer.json's post-processor already adds BOS it is not added again, and when it adds
    one that `add_bos` says not to, that one is dropped. `eos_token_ids` lists every id that
    ends generation, the one `add_eos` appends first.
    """

    def __init__(
        self,
        backend: Any,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        add_eos: bool,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None = None,
    ) -> None:
        self._tok = backend
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._checked_id(bos_token_id, "bos_token_id")
        self.eos_token_ids = tuple(self._checked_id(i, "eos_token_ids") for i in eos_token_ids)
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        if add_bos and self.bos_token_id is None:
            raise HipcError("tokenizer: add_bos is set but there is no bos_token_id")
        if add_eos and not self.eos_token_ids:
            raise HipcError("tokenizer: add_eos is set but there is no eos_token_id")
        self.bos_token = (
            bos_token if bos_token is not None else self._token_or_none(self.bos_token_id)
        )
        eos0 = self.eos_token_ids[0] if self.eos_token_ids else None
        self.eos_token = eos_token if eos_token is not None else self._token_or_none(eos0)
        self.chat_template = chat_template
        self._pp_bos, self._pp_eos = self._probe_post_processor()

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_json(
        cls,
        json_str: str,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        add_eos: bool,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None = None,
        source: str = "tokenizer json",
    ) -> Tokenizer:
        """Build from a `tokenizer.json` document; `source` names it in error messages."""
        try:
            backend = _backend().Tokenizer.from_str(json_str)
        except Exception as exc:
            raise HipcError(f"{source}: not a valid tokenizer: {_first_line(exc)}") from exc
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            add_bos=add_bos,
            add_eos=add_eos,
            bos_token=bos_token,
            eos_token=eos_token,
            chat_template=chat_template,
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model folder.

        tokenizer.json is required; tokenizer_config.json, generation_config.json and
        config.json fill in the BOS/EOS facts and the chat template when present.
        """
        folder = Path(path)
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise HipcError(f"{tok_path}: missing (the model folder has no tokenizer.json)")
        json_str = _read_text(tok_path)
        _parse_json(json_str, tok_path)  # a clear message for broken JSON before the library's
        try:
            backend = _backend().Tokenizer.from_str(json_str)
        except Exception as exc:
            raise HipcError(f"{tok_path}: not a valid tokenizer: {_first_line(exc)}") from exc

        tcfg = _read_optional_json(folder / "tokenizer_config.json")
        gen = _read_optional_json(folder / "generation_config.json")
        cfg = _read_optional_json(folder / "config.json")
        cfg_name = folder / "tokenizer_config.json"
        vocab_size = backend.get_vocab_size(with_added_tokens=True)

        def lookup(token: str | None, field: str) -> int | None:
            if token is None:
                return None
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise HipcError(f"{cfg_name}: {field} {token!r} is not in the vocabulary")
            return token_id

        bos_token = _token_content(tcfg.get("bos_token"), cfg_name, "bos_token")
        eos_token = _token_content(tcfg.get("eos_token"), cfg_name, "eos_token")

        bos_id = lookup(bos_token, "bos_token")
        if bos_id is None:
            bos_id = _single_id(gen, "bos_token_id", folder / "generation_config.json", vocab_size)
        if bos_id is None:
            bos_id = _single_id(cfg, "bos_token_id", folder / "config.json", vocab_size)

        # Stop on every id any file calls EOS: instruct models often list the end-of-turn
        # token in generation_config.json and the end-of-text token elsewhere, and both end
        # a reply.
        eos_ids: list[int] = []
        for ids in (
            _id_list(gen, "eos_token_id", folder / "generation_config.json", vocab_size),
            _id_list(cfg, "eos_token_id", folder / "config.json", vocab_size),
            [i for i in [lookup(eos_token, "eos_token")] if i is not None],
        ):
            eos_ids.extend(i for i in ids if i not in eos_ids)
        if eos_token is not None and eos_ids:
            # The string a chat template sees as eos_token leads the list.
            primary = backend.token_to_id(eos_token)
            eos_ids.remove(primary)
            eos_ids.insert(0, primary)

        made = cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos=False,
            add_eos=False,
            bos_token=bos_token,
            eos_token=eos_token,
            chat_template=_chat_template(tcfg, folder),
        )
        # What tokenizer.json's post-processor adds stays (transformers keeps it too, whatever
        # the config says); add_*_token can only ask for what it does not add.
        made.add_bos = _optional_bool(tcfg, "add_bos_token", cfg_name, False) or made._pp_bos
        made.add_eos = _optional_bool(tcfg, "add_eos_token", cfg_name, False) or made._pp_eos
        if made.add_bos and made.bos_token_id is None:
            raise HipcError(f"{cfg_name}: add_bos_token is true but no BOS token is named")
        if made.add_eos and not made.eos_token_ids:
            raise HipcError(f"{cfg_name}: add_eos_token is true but no EOS token is named")
        return made

    @classmethod
    def from_dict(cls, meta: dict[str, Any], tokenizer_json: str) -> Tokenizer:
        """Rebuild from `to_dict()` metadata and the `to_json()` document."""
        if not isinstance(meta, dict):
            raise HipcError("tokenizer metadata: expected a JSON object")
        version = meta.get("version")
        if version != _META_VERSION:
            raise HipcError(
                f"tokenizer metadata: version {version!r} is not supported (expected {_META_VERSION})"
            )
        try:
            eos_ids = [int(i) for i in meta["eos_token_ids"]]
            return cls.from_json(
                tokenizer_json,
                bos_token_id=meta["bos_token_id"],
                eos_token_ids=eos_ids,
                add_bos=meta["add_bos"],
                add_eos=meta["add_eos"],
                bos_token=meta["bos_token"],
                eos_token=meta["eos_token"],
                chat_template=meta.get("chat_template"),
            )
        except KeyError as exc:
            raise HipcError(f"tokenizer metadata: missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise HipcError(f"tokenizer metadata: eos_token_ids is malformed ({exc})") from exc

    def to_json(self) -> str:
        """The `tokenizer.json` document of the underlying tokenizer."""
        return self._tok.to_str()

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable metadata that, with `to_json()`, rebuilds this tokenizer."""
        return {
            "version": _META_VERSION,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "chat_template": self.chat_template,
        }

    # ----------------------------------------------------------------- use

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._vocab_size

    @property
    def backend(self) -> Any:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model wants them."""
        if not isinstance(text, str):
            raise HipcError(f"tokenizer: encode expects text, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        # The post-processor may already add BOS/EOS (Llama-3, Llama-2 tokenizer.json);
        # add only what it does not, and drop what the config says not to add.
        if self.add_bos and not self._pp_bos:
            ids.insert(0, self.bos_token_id)
        elif self._pp_bos and not self.add_bos and ids and ids[0] == self.bos_token_id:
            del ids[0]
        if self.add_eos and not self._pp_eos:
            ids.append(self.eos_token_ids[0])
        elif self._pp_eos and not self.add_eos and ids and ids[-1] in self.eos_token_ids:
            del ids[-1]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; raises HipcError for an id outside the vocabulary."""
        checked = [self._checked_id(i, "decode") for i in ids]
        return self._tok.decode(checked, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry spelled exactly `token`, or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary entry of `token_id` as the tokenizer spells it (e.g. 'Ġthe', '▁the')."""
        token = self._tok.id_to_token(self._checked_id(token_id, "id_to_token"))
        if token is None:
            raise HipcError(f"tokenizer: token id {token_id} has no vocabulary entry")
        return token

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_token_ids

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` through the model's chat template (ChatML if none)."""
        from hipc.base.chat_template import CHATML_TEMPLATE, render_chat

        return render_chat(
            self.chat_template or CHATML_TEMPLATE,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            tools=tools,
            **extra,
        )

    # ----------------------------------------------------------------- internals

    def _checked_id(self, token_id: Any, field: str) -> Any:
        if token_id is None:
            return None
        try:
            # operator.index takes numpy integers too, and refuses floats and strings.
            as_int = None if isinstance(token_id, bool) else operator.index(token_id)
        except TypeError:
            as_int = None
        if as_int is None:
            raise HipcError(f"tokenizer: {field}: {token_id!r} is not a token id")
        if not 0 <= as_int < self._vocab_size:
            raise HipcError(
                f"tokenizer: {field}: token id {as_int} is out of the vocabulary "
                f"(size {self._vocab_size})"
            )
        return as_int

    def _token_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.id_to_token(token_id)

    def _probe_post_processor(self) -> tuple[bool, bool]:
        """Whether tokenizer.json's post-processor itself adds BOS / EOS."""
        if self._tok.post_processor is None:
            return False, False
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        adds_bos = bool(full) and full[0] == self.bos_token_id and plain[:1] != full[:1]
        adds_eos = (
            len(full) > int(adds_bos) and full[-1] in self.eos_token_ids and plain[-1:] != full[-1:]
        )
        return adds_bos, adds_eos

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self._vocab_size}, bos={self.bos_token_id}, "
            f"eos={list(self.eos_token_ids)}, add_bos={self.add_bos}, add_eos={self.add_eos})"
        )


class IncrementalDecoder:
    """Streams text from token ids fed one at a time.

    Each token is decoded together with a few tokens before it and only the new suffix is
    returned. That keeps what a tokenizer does across tokens right (SentencePiece's leading
    space, byte-level pieces of one character) and withholds text while it ends in U+FFFD,
    i.e. while a multi-byte character is still missing bytes that the next tokens bring.

    `context` holds ids already shown (say the prompt's last tokens): decoding after them
    keeps the leading space a SentencePiece decoder would strip from a first token.

    NOTE: the `tokenizers` library's DecodeStream runs that same window rule in one call
    per token (~1 us against ~13 for two decodes from Python, a serving loop's largest
    per-token cost on the host); the window is mirrored here for `flush` and for the
    Python path, which takes over if the library refuses a step.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = False,
        context: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # A handful of context tokens is enough for any decoder's cross-token behaviour.
        self._ids: list[int] = list(context)[-4:]
        self._prefix = 0  # start of the window decoded each step
        self._read = len(self._ids)  # ids before this have had their text emitted
        self._vocab = getattr(tokenizer, "vocab_size", None)
        self._stream = _decode_stream(tokenizer, self._ids, skip_special_tokens)

    def feed(self, token_id: int) -> str:
        """Add one id; returns the text it completes (often '', never a partial character)."""
        stream = self._stream
        if stream is not None:
            if type(token_id) is not int or not 0 <= token_id < self._vocab:
                token_id = self._tokenizer._checked_id(token_id, "decode")
            self._ids.append(token_id)
            try:
                new = stream[0].step(stream[1], token_id)
            except Exception:
                self._stream = None  # the window is mirrored: decode it from Python
                return self._feed_python()
            if new is None:
                return ""
            self._emitted()
            return new
        self._ids.append(token_id)
        return self._feed_python()

    def _feed_python(self) -> str:
        seen = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(seen) or text.endswith("\ufffd"):
            return ""
        self._emitted()
        return text[len(seen) :]

    def _emitted(self) -> None:
        self._prefix = self._read
        self._read = len(self._ids)
        # Trim what is no longer needed as context.
        if self._prefix > 0:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def flush(self) -> str:
        """Text still held back (an incomplete character shows as U+FFFD)."""
        seen = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        self._stream = None  # its window is behind now; a later feed decodes from Python
        return text[len(seen) :] if len(text) > len(seen) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""


def _decode_stream(tokenizer: Any, context: list[int], skip: bool) -> tuple[Any, Any] | None:
    """(a DecodeStream started after `context`, the library tokenizer), or None where the
    library has none (tokenizers < 0.21) or `tokenizer` is not one of ours."""
    backend = getattr(tokenizer, "backend", None) if isinstance(tokenizer, Tokenizer) else None
    if backend is None:
        return None
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=list(context), skip_special_tokens=skip), backend
    except (ImportError, TypeError):
        return None


# --------------------------------------------------------------------- file helpers


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise HipcError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise HipcError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _parse_json(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise HipcError(f"{path}: malformed JSON (nested too deeply)") from None
    except json.JSONDecodeError as exc:
        raise HipcError(
            f"{path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = _parse_json(_read_text(path), path)
    if not isinstance(data, dict):
        raise HipcError(f"{path}: expected a JSON object at the top level")
    return data


def _token_content(value: Any, path: Path, field: str) -> str | None:
    """Special tokens are written as a string or as an AddedToken dict with 'content'."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise HipcError(f"{path}: {field} must be a string or an object with 'content'")


def _single_id(data: dict[str, Any], field: str, path: Path, vocab_size: int) -> int | None:
    ids = _id_list(data, field, path, vocab_size)
    return ids[0] if ids else None


def _id_list(data: dict[str, Any], field: str, path: Path, vocab_size: int) -> list[int]:
    value = data.get(field)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise HipcError(f"{path}: {field} must be an integer or a list of integers")
    for v in values:
        if not 0 <= v < vocab_size:
            raise HipcError(f"{path}: {field} {v} is outside the vocabulary of {vocab_size}")
    return values


def _optional_bool(data: dict[str, Any], field: str, path: Path, default: bool) -> bool:
    value = data.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HipcError(f"{path}: {field} must be true or false")
    return value


def _chat_template(tcfg: dict[str, Any], folder: Path) -> str | None:
    path = folder / "tokenizer_config.json"
    value = tcfg.get("chat_template")
    if isinstance(value, list):
        # Named templates: the one called 'default' is what apply_chat_template uses.
        named = {}
        for entry in value:
            if not (isinstance(entry, dict) and isinstance(entry.get("template"), str)):
                raise HipcError(f"{path}: chat_template entries need 'name' and 'template'")
            named[entry.get("name")] = entry["template"]
        value = named.get("default", next(iter(named.values()), None))
    if value is not None and not isinstance(value, str):
        raise HipcError(f"{path}: chat_template must be a string or a list of templates")
    if value is None:
        # Newer exports keep the template in its own file.
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            return _read_text(jinja)
        legacy = folder / "chat_template.json"
        if legacy.is_file():
            data = _read_optional_json(legacy)
            if isinstance(data.get("chat_template"), str):
                return data["chat_template"]
    return value
