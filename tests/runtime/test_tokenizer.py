"""hipc.base.tokenizer against transformers, on small tokenizers built with `tokenizers`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from hipc.base.errors import HipcError
from hipc.base.tokenizer import IncrementalDecoder, Tokenizer, byte_level_alphabet

from support import require

SPECIALS = ["<s>", "</s>", "<|eot|>"]
MERGES = [
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
]


def byte_level_backend(*, bos_post_processor: bool = False) -> Backend:
    """A tiny byte-level BPE: every byte a token, a few merges, three special tokens."""
    alphabet = byte_level_alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS + [alphabet[b] for b in range(256)])}
    for a, b in MERGES:
        vocab.setdefault(a + b, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    if bos_post_processor:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    return backend


def sentencepiece_backend() -> Backend:
    """A tiny SentencePiece-style BPE with byte fallback (the Llama-2 layout)."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁he", "llo", "▁hello"]
    pieces += ["▁w", "or", "▁wor", "ld", "▁world"]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [("h", "e"), ("l", "l"), ("▁", "he"), ("ll", "o"), ("▁he", "llo")]
    merges += [("▁", "w"), ("o", "r"), ("▁w", "or"), ("l", "d"), ("▁wor", "ld")]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken(s, special=True) for s in ["<unk>", "<s>", "</s>"]])
    return backend


def write_folder(
    folder: Path,
    backend: Backend,
    tokenizer_config: dict | None = None,
    generation_config: dict | None = None,
    config: dict | None = None,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    for name, data in [
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
        ("config.json", config),
    ]:
        if data is not None:
            (folder / name).write_text(json.dumps(data), encoding="utf-8")
    return folder


CORPUS = [
    "hello world",
    "hello  world\n",
    "héllo wörld 日本語 😀",
    "<s>hello</s> world<|eot|>",
    "",
    "   ",
]


# ----------------------------------------------------------------- from_hf_folder vs transformers

FOLDER_CASES = {
    # Llama-3 layout: the post-processor adds BOS, the config does not mention it.
    "post_processor_bos": (True, {"bos_token": "<s>", "eos_token": "</s>"}),
    # Llama-2 layout: both the post-processor and the config add BOS; it must appear once.
    "post_processor_and_config_bos": (
        True,
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True},
    ),
    # GPT-2 layout: nothing adds BOS.
    "no_bos": (False, {"bos_token": "<s>", "eos_token": "</s>"}),
    # The config cannot take away what the post-processor adds (transformers keeps it too).
    "config_says_no_bos": (
        True,
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False},
    ),
}


@pytest.mark.oracle
@pytest.mark.parametrize("case", sorted(FOLDER_CASES))
def test_hf_folder_encode_matches_transformers(tmp_path: Path, case: str) -> None:
    transformers = require("transformers")
    with_pp, tcfg = FOLDER_CASES[case]
    folder = write_folder(
        tmp_path / case,
        byte_level_backend(bos_post_processor=with_pp),
        {"tokenizer_class": "PreTrainedTokenizerFast", **tcfg},
    )
    ours = Tokenizer.from_hf_folder(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in CORPUS:
        for specials in (True, False):
            expected = theirs.encode(text, add_special_tokens=specials)
            assert ours.encode(text, add_special_tokens=specials) == expected, (text, specials)
        ids = theirs.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )


def test_post_processor_bos_is_not_doubled(tmp_path: Path) -> None:
    folder = write_folder(
        tmp_path,
        byte_level_backend(bos_post_processor=True),
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True},
    )
    tok = Tokenizer.from_hf_folder(folder)
    assert tok.add_bos
    ids = tok.encode("hello")
    assert ids[0] == 0 and ids[1] != 0
    assert tok.encode("hello", add_special_tokens=False)[0] != 0


def test_config_adds_bos_and_eos_the_post_processor_lacks(tmp_path: Path) -> None:
    # transformers 5 ignores add_*_token for a plain tokenizer.json; the flags are the
    # model's statement of how prompts start, so hipc honours them.
    folder = write_folder(
        tmp_path,
        byte_level_backend(),
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True},
    )
    tok = Tokenizer.from_hf_folder(folder)
    plain = tok.encode("hello world", add_special_tokens=False)
    assert tok.encode("hello world") == [0, *plain, 1]


def test_special_token_facts_from_the_config_files(tmp_path: Path) -> None:
    folder = write_folder(
        tmp_path,
        byte_level_backend(),
        {
            "bos_token": {"content": "<s>", "lstrip": False},
            "eos_token": "<|eot|>",
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ messages[0]['content'] }}"},
            ],
        },
        generation_config={"eos_token_id": [1, 2]},
        config={"bos_token_id": 0, "eos_token_id": 1},
    )
    tok = Tokenizer.from_hf_folder(folder)
    assert tok.bos_token_id == 0 and tok.bos_token == "<s>"
    # The eos_token string leads; every id any file names ends generation.
    assert tok.eos_token_ids == (2, 1)
    assert tok.eos_token == "<|eot|>"
    assert tok.chat_template == "{{ messages[0]['content'] }}"


def test_ids_fall_back_to_config_json_and_template_file(tmp_path: Path) -> None:
    folder = write_folder(
        tmp_path, byte_level_backend(), config={"bos_token_id": 0, "eos_token_id": [1]}
    )
    (folder / "chat_template.jinja").write_text("T", encoding="utf-8")
    tok = Tokenizer.from_hf_folder(folder)
    assert (tok.bos_token_id, tok.eos_token_ids) == (0, (1,))
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert tok.chat_template == "T"


# ----------------------------------------------------------------- round trip through an artifact


def test_to_json_and_to_dict_rebuild_the_same_tokenizer(tmp_path: Path) -> None:
    folder = write_folder(
        tmp_path,
        byte_level_backend(bos_post_processor=True),
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ bos_token }}"},
    )
    tok = Tokenizer.from_hf_folder(folder)
    meta = json.loads(json.dumps(tok.to_dict()))
    again = Tokenizer.from_dict(meta, tok.to_json())
    assert again.to_dict() == tok.to_dict()
    for text in CORPUS:
        assert again.encode(text) == tok.encode(text)
    assert again.vocab_size == tok.vocab_size == 256 + 3 + len(MERGES)


def test_from_json_adds_bos_itself_without_post_processor() -> None:
    tok = Tokenizer.from_json(
        byte_level_backend().to_str(),
        bos_token_id=0,
        eos_token_ids=(1, 2),
        add_bos=True,
        add_eos=False,
        bos_token=None,
        eos_token=None,
    )
    assert tok.encode("hello")[0] == 0
    assert tok.encode("hello", add_special_tokens=False)[0] != 0
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert tok.token_to_id("hello") == tok.encode("hello", add_special_tokens=False)[0]
    assert tok.token_to_id("not a token") is None
    assert tok.id_to_token(3 + ord("a")) == "a"


def test_from_json_add_bos_false_drops_the_post_processor_bos() -> None:
    tok = Tokenizer.from_json(
        byte_level_backend(bos_post_processor=True).to_str(),
        bos_token_id=0,
        eos_token_ids=(1,),
        add_bos=False,
        add_eos=False,
        bos_token="<s>",
        eos_token="</s>",
    )
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)


# ----------------------------------------------------------------- errors


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(HipcError, match=r"tokenizer\.json: missing"):
        Tokenizer.from_hf_folder(tmp_path)


def test_malformed_config_names_file_and_line(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, byte_level_backend())
    (folder / "tokenizer_config.json").write_text('{\n  "bos_token": "<s>",\n}', encoding="utf-8")
    with pytest.raises(HipcError, match=r"tokenizer_config\.json: malformed JSON at line 3"):
        Tokenizer.from_hf_folder(folder)


def test_malformed_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{", encoding="utf-8")
    with pytest.raises(HipcError, match=r"tokenizer\.json: malformed JSON"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Nope"}}', encoding="utf-8")
    with pytest.raises(HipcError, match=r"tokenizer\.json: not a valid tokenizer"):
        Tokenizer.from_hf_folder(tmp_path)


def test_unknown_special_token_and_bad_field_types(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, byte_level_backend(), {"eos_token": "<nope>"})
    with pytest.raises(HipcError, match=r"tokenizer_config\.json: eos_token '<nope>'"):
        Tokenizer.from_hf_folder(folder)
    write_folder(tmp_path, byte_level_backend(), {}, generation_config={"eos_token_id": "x"})
    with pytest.raises(HipcError, match=r"generation_config\.json: eos_token_id"):
        Tokenizer.from_hf_folder(folder)
    write_folder(tmp_path, byte_level_backend(), {}, generation_config={"eos_token_id": 5000})
    with pytest.raises(HipcError, match=r"generation_config\.json: eos_token_id 5000 is outside"):
        Tokenizer.from_hf_folder(folder)


def test_decode_rejects_ids_outside_the_vocabulary() -> None:
    tok = Tokenizer.from_json(
        byte_level_backend().to_str(),
        bos_token_id=0,
        eos_token_ids=(1,),
        add_bos=False,
        add_eos=False,
        bos_token=None,
        eos_token=None,
    )
    with pytest.raises(HipcError, match=r"decode: token id 100000 is out of the vocabulary"):
        tok.decode([5, 100000])
    with pytest.raises(HipcError, match="decode"):
        tok.decode([-1])
    with pytest.raises(HipcError, match="eos_token_ids"):
        Tokenizer.from_json(
            byte_level_backend().to_str(),
            bos_token_id=0,
            eos_token_ids=(9999,),
            add_bos=False,
            add_eos=False,
            bos_token=None,
            eos_token=None,
        )


def test_bad_tokenizer_json_and_metadata() -> None:
    with pytest.raises(HipcError, match="tokenizer json: not a valid tokenizer"):
        Tokenizer.from_json(
            "[]",
            bos_token_id=None,
            eos_token_ids=(),
            add_bos=False,
            add_eos=False,
            bos_token=None,
            eos_token=None,
        )
    json_str = byte_level_backend().to_str()
    with pytest.raises(HipcError, match="missing field 'add_bos'"):
        Tokenizer.from_dict({"version": 1, "bos_token_id": 0, "eos_token_ids": [1]}, json_str)
    with pytest.raises(HipcError, match="version"):
        Tokenizer.from_dict({"version": 99}, json_str)


# ----------------------------------------------------------------- incremental decoding


class _Refusing:
    """A DecodeStream that refuses its third step: the decoder goes on from Python."""

    def __init__(self, stream) -> None:
        self.stream, self.steps = stream, 0

    def step(self, backend, token_id):
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("refused")
        return self.stream.step(backend, token_id)


@pytest.fixture(params=["library", "python", "library-then-python"])
def decode_path(request, monkeypatch):
    """IncrementalDecoder's three ways: the tokenizers library's DecodeStream, the Python
    window (a library without it), and the library refusing a step midway."""
    import hipc.base.tokenizer as tokenizer

    real = tokenizer._decode_stream
    if request.param == "python":
        monkeypatch.setattr(tokenizer, "_decode_stream", lambda *a: None)
    elif request.param == "library-then-python":

        def refusing(*a):
            made = real(*a)
            return None if made is None else (_Refusing(made[0]), made[1])

        monkeypatch.setattr(tokenizer, "_decode_stream", refusing)
    return request.param


def _stream(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    decoder = IncrementalDecoder(tok, **kwargs)
    pieces = [decoder.feed(i) for i in ids]
    pieces.append(decoder.flush())
    return pieces


def test_incremental_decoder_holds_back_split_characters(decode_path) -> None:
    tok = Tokenizer.from_json(
        byte_level_backend().to_str(),
        bos_token_id=0,
        eos_token_ids=(1,),
        add_bos=False,
        add_eos=False,
        bos_token=None,
        eos_token=None,
    )
    text = "hello é日😀 world"
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    emoji_bytes = len("😀".encode())
    first = ids.index(tok.token_to_id(byte_level_alphabet()["😀".encode()[0]]))
    assert pieces[first : first + emoji_bytes] == [""] * (emoji_bytes - 1) + ["😀"]


def test_incremental_decoder_flush_and_special_tokens(decode_path) -> None:
    tok = Tokenizer.from_json(
        byte_level_backend().to_str(),
        bos_token_id=0,
        eos_token_ids=(1,),
        add_bos=False,
        add_eos=False,
        bos_token=None,
        eos_token=None,
    )
    truncated = tok.encode("ok 😀")[:-1]  # the last byte of the emoji never arrives
    pieces = _stream(tok, truncated)
    assert "".join(pieces[:-1]) == "ok "
    assert pieces[-1] == "\ufffd"
    ids = tok.encode("hello</s>")
    assert "".join(_stream(tok, ids)) == "hello</s>"
    assert "".join(_stream(tok, ids, skip_special_tokens=True)) == "hello"


@pytest.mark.oracle
def test_incremental_decoder_sentencepiece_spaces_and_byte_fallback(
    tmp_path: Path, decode_path
) -> None:
    transformers = require("transformers")
    folder = write_folder(
        tmp_path,
        sentencepiece_backend(),
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"},
    )
    tok = Tokenizer.from_hf_folder(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = "hello world ünï 😀 world"
    ids = tok.encode(text)
    assert ids == theirs.encode(text)
    assert tok.decode(ids) == theirs.decode(ids) == text
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # Decoding tokens alone drops the space SentencePiece puts in front of a word; with the
    # prompt as context the first generated word keeps it.
    prompt = tok.encode("hello", add_special_tokens=False)
    reply = tok.encode("world", add_special_tokens=False)
    assert "".join(_stream(tok, reply)) == "world"
    assert "".join(_stream(tok, reply, context=prompt)) == " world"
