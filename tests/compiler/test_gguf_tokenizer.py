"""Tokenizers rebuilt from GGUF metadata, checked against transformers' own GGUF loader."""

from __future__ import annotations

from pathlib import Path

import pytest

from hipc.base.errors import HipcError
from hipc.base.tokenizer import IncrementalDecoder, Tokenizer, byte_level_alphabet
from hipc.compiler.source.gguf_tokenizer import read_gguf_metadata, tokenizer_from_gguf_metadata

from support import require, smollm2_path

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def load_with_transformers(path: Path):
    transformers = require("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def write_gguf(path: Path, tokenizer: dict) -> Path:
    """A GGUF holding a toy llama model's header and the given tokenizer.* entries."""
    gguf = require("gguf")
    np = require("numpy")
    writer = gguf.GGUFWriter(str(path), "llama")
    # transformers reads a model config even when it only loads the tokenizer.
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(tokenizer["model"])
    if "pre" in tokenizer:
        writer.add_tokenizer_pre(tokenizer["pre"])
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["types"])
    if "scores" in tokenizer:
        writer.add_token_scores(tokenizer["scores"])
    if "merges" in tokenizer:
        writer.add_token_merges(tokenizer["merges"])
    writer.add_bos_token_id(tokenizer["bos"])
    writer.add_eos_token_id(tokenizer["eos"])
    if "unk" in tokenizer:
        writer.add_unk_token_id(tokenizer["unk"])
    if "add_space_prefix" in tokenizer:
        writer.add_add_space_prefix(tokenizer["add_space_prefix"])
    writer.add_tensor(
        "token_embd.weight", np.zeros((len(tokenizer["tokens"]), 8), dtype=np.float32)
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ================================================================= SmolLM2 (byte-level BPE)

CORPUS = [
    "The capital of France is",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "Ünïcödé: naïve café, Straße, São Paulo, Ελληνικά, русский, עברית, العربية",
    "日本語のテキストと中文文本和한국어 텍스트",
    "Emoji 😀👍🏽🇫🇷 👨‍👩‍👧‍👦 and ✓ ✗ → ∑ ∞",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\t\tnewlines\n\n\nand\r\nCRLF  \n  mixed \t \n",
    "digits 0 12 345 6789 3.14159 1,000,000 2024-01-31 0x1F",
    "I'm sure you'll see they've done it, she'd said. DON'T SHOUT'S",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|endoftext|><file_sep>text<repo_name>x<|im_end|>",
    "<|im_start|> not quite special <|im_start",
    "ĠĠ literal byte-level spelling Ċ",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, dict, object]:
    path = smollm2_path()
    meta = read_gguf_metadata(str(path))
    return tokenizer_from_gguf_metadata(meta), meta, load_with_transformers(path)


def test_smollm2_known_ids(smollm2) -> None:
    tok, _, _ = smollm2
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.add_bos is False and tok.add_eos is False
    assert (tok.bos_token_id, tok.bos_token) == (1, "<|im_start|>")
    assert (tok.eos_token_ids[0], tok.eos_token) == (2, "<|im_end|>")
    # llama.cpp also ends generation on <|endoftext|>.
    assert 0 in tok.eos_token_ids
    assert tok.vocab_size == 49152
    assert "<|im_start|>" in tok.chat_template


@pytest.mark.oracle
@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_matches_transformers(smollm2, text: str) -> None:
    tok, _, theirs = smollm2
    ids = tok.encode(text)
    assert ids == theirs.encode(text)
    assert tok.decode(ids) == text
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.oracle
def test_smollm2_special_tokens_match_transformers(smollm2) -> None:
    tok, meta, theirs = smollm2
    specials = [
        t
        for t, kind in zip(
            meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], strict=True
        )
        if kind == CONTROL
    ]
    assert len(specials) == 17
    for token in specials:
        assert tok.encode(f"a{token}b") == theirs.encode(f"a{token}b")
        assert tok.token_to_id(token) == theirs.convert_tokens_to_ids(token)


def test_smollm2_splits_every_digit_like_llama_cpp(smollm2) -> None:
    # SmolLM2's own tokenizer.json (and llama.cpp's 'smollm' pre-tokenizer) cut out each
    # numeric character before the GPT-2 regex. transformers' GGUF loader skips that step;
    # it only shows on numerals that have merges, like '½' (bytes 'Â½').
    tok, _, _ = smollm2
    ids = tok.encode(" ½")
    assert [tok.id_to_token(i) for i in ids] == ["Ġ", "Â½"]
    assert [tok.id_to_token(i) for i in tok.encode("x 12")] == ["x", "Ġ", "1", "2"]


def test_smollm2_streams_multibyte_text(smollm2) -> None:
    tok, _, _ = smollm2
    text = "日本語のテキスト 😀👍🏽 naïve ٣ done"
    ids = tok.encode(text)
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.feed(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # Some characters span several tokens here, so some steps must have held text back.
    assert "" in pieces[:-1]


def test_smollm2_round_trips_through_artifact_form(smollm2) -> None:
    tok, _, _ = smollm2
    again = Tokenizer.from_dict(tok.to_dict(), tok.to_json())
    assert again.to_dict() == tok.to_dict()
    for text in CORPUS[:6]:
        assert again.encode(text) == tok.encode(text)


# ================================================================= SentencePiece ('llama')

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
# (piece, score). Scores are deliberately not in id order: 'ab' comes before 'bc' but
# scores lower, so 'abc' must split as a + bc, which only a score-ranked merge gets right.
SPM_PIECES = [
    ("▁", -1.0),
    *[(c, -2.0 - i * 0.01) for i, c in enumerate("abcdeghilnorstw")],
    ("ab", -9.0),
    ("bc", -3.0),
    ("he", -4.0),
    ("ll", -4.5),
    ("llo", -5.0),
    ("hello", -5.5),
    ("▁hello", -6.0),
    ("▁w", -6.5),
    ("or", -6.6),
    ("▁wor", -6.7),
    ("ld", -6.8),
    ("▁world", -6.9),
    ("▁t", -7.0),
    ("▁the", -7.1),
    ("th", -7.2),
    ("in", -7.3),
    ("ing", -7.4),
    ("▁s", -7.5),
    ("▁st", -7.6),
    ("▁string", -7.7),
    ("st", -7.8),
    ("ring", -7.9),
    ("▁▁", -8.0),
]


def spm_tokenizer_dict(**overrides) -> dict:
    tokens = ["<unk>", "<s>", "</s>", *BYTE_TOKENS, "<tool>"] + [p for p, _ in SPM_PIECES]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [USER_DEFINED]
    types += [NORMAL] * len(SPM_PIECES)
    scores = [0.0] * (3 + 256) + [0.0] + [s for _, s in SPM_PIECES]
    return {
        "model": "llama",
        "tokens": tokens,
        "types": types,
        "scores": scores,
        "bos": 1,
        "eos": 2,
        "unk": 0,
        **overrides,
    }


SPM_CORPUS = [
    "hello world",
    "the string abc abcabc bc ab",
    "hello   world, the  string",  # space runs between words
    "naïve café 😀 中文",  # none of these characters are pieces: byte fallback
    "line one\nline two\ttab",
    "hellohello worldworld",
    "ende <tool>",
    "",
]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", spm_tokenizer_dict())


@pytest.fixture(scope="module")
def spm(spm_gguf) -> Tokenizer:
    return tokenizer_from_gguf_metadata(read_gguf_metadata(str(spm_gguf)))


@pytest.mark.oracle
def test_sentencepiece_matches_transformers(spm_gguf, spm) -> None:
    theirs = load_with_transformers(spm_gguf)
    assert spm.vocab_size == len(theirs)
    for text in SPM_CORPUS:
        ids = spm.encode(text)
        assert ids == theirs.encode(text), text
        assert spm.decode(ids) == theirs.decode(ids)
        assert spm.decode(ids, skip_special_tokens=True) == text
        # Both halves of what makes this vocabulary a real test actually happened:
    pieces = [spm.id_to_token(i) for i in spm.encode("abc naïve")]
    assert pieces[:3] == ["<s>", "▁", "a"] and pieces[3] == "bc"
    assert "<0xC3>" in pieces and "<0xAF>" in pieces


def test_sentencepiece_metadata(spm) -> None:
    assert spm.add_bos is True and spm.add_eos is False
    assert (spm.bos_token, spm.eos_token, spm.eos_token_ids) == ("<s>", "</s>", (2,))
    assert spm.encode("hello", add_special_tokens=False) == [spm.token_to_id("▁hello")]


def test_sentencepiece_leading_space_like_sentencepiece(spm) -> None:
    # SentencePiece and llama.cpp always add the dummy '▁', also before text that already
    # starts with a space ('▁▁hello'); transformers' Metaspace(prepend_scheme='first') does
    # not, and reads ' hello' as 'hello'.
    pieces = [spm.id_to_token(i) for i in spm.encode(" hello", add_special_tokens=False)]
    assert pieces == ["▁", "▁hello"]
    assert spm.decode(spm.encode(" hello"), skip_special_tokens=True) == " hello"
    # llama.cpp starts each text segment after a special token with a space too.
    pieces = [spm.id_to_token(i) for i in spm.encode("hello</s>world")]
    assert pieces == ["<s>", "▁hello", "</s>", "▁world"]


def test_repeated_token_keeps_every_id() -> None:
    d = spm_tokenizer_dict()
    d["tokens"] = [*d["tokens"], "▁hello"]
    d["types"] = [*d["types"], NORMAL]
    d["scores"] = [*d["scores"], -20.0]
    tok = tokenizer_from_gguf_metadata(_as_metadata(d))
    assert tok.vocab_size == len(d["tokens"])
    assert tok.encode("hello", add_special_tokens=False) == [d["tokens"].index("▁hello")]


def test_sentencepiece_without_space_prefix(tmp_path: Path) -> None:
    meta = read_gguf_metadata(
        str(write_gguf(tmp_path / "x.gguf", spm_tokenizer_dict(add_space_prefix=False)))
    )
    tok = tokenizer_from_gguf_metadata(meta)
    ids = tok.encode("hello world", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["hello", "▁world"]
    assert tok.decode(ids) == "hello world"


def test_sentencepiece_streams_byte_fallback(spm) -> None:
    text = "hello 😀 中 world"
    ids = spm.encode(text)
    decoder = IncrementalDecoder(spm, skip_special_tokens=True)
    pieces = [decoder.feed(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    emoji = [spm.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    start = ids.index(emoji[0])
    assert ids[start : start + 4] == emoji
    assert pieces[start : start + 4] == ["", "", "", "😀"]


# ================================================================= byte-level pre-tokenizers


# Every token these merges make is also what BPE reaches for its whole piece, so Llama-3's
# ignore_merges (tested on its own below) changes nothing and transformers can be the oracle.
BPE_MERGES = [
    "Ġ t", "h e", "Ġt he", "i n", "in g", "1 2", "12 3", "4 5", "45 6", "' s", "' S",
    "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ", "e r", "Ġ w", "Ġw e",
]  # fmt: skip


def bpe_tokenizer_dict(pre: str, extra_tokens: tuple[str, ...] = ()) -> dict:
    alphabet = byte_level_alphabet()
    specials = ["<|endoftext|>", "<|im_end|>"]
    tokens = specials + [alphabet[b] for b in range(256)]
    for merge in BPE_MERGES:
        joined = merge.replace(" ", "")
        if joined not in tokens:
            tokens.append(joined)
    tokens += extra_tokens
    types = [CONTROL] * len(specials) + [NORMAL] * (len(tokens) - len(specials))
    return {
        "model": "gpt2",
        "pre": pre,
        "tokens": tokens,
        "types": types,
        "merges": BPE_MERGES,
        "bos": 0,
        "eos": 1,
    }


BPE_CORPUS = [
    "the weather's 1234567 THE'S we're\n\n\n  testing   123",
    "x1234y 9876543210 ½ ٣٤٥",
    "hello 😀 日本語\r\n\tend  ",
    "<|endoftext|>the<|im_end|> the",
]


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2", "default", "smollm"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path: Path, pre: str) -> None:
    path = write_gguf(tmp_path / f"{pre}.gguf", bpe_tokenizer_dict(pre))
    tok = tokenizer_from_gguf_metadata(read_gguf_metadata(str(path)))
    theirs = load_with_transformers(path)
    corpus = BPE_CORPUS if pre != "smollm" else BPE_CORPUS[2:]  # see the SmolLM2 digit test
    for text in corpus:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == text


def _pieces(pre: str, text: str, extra_tokens: tuple[str, ...] = ()) -> list[str]:
    tok = tokenizer_from_gguf_metadata(_as_metadata(bpe_tokenizer_dict(pre, extra_tokens)))
    return [tok.id_to_token(i) for i in tok.encode(text, add_special_tokens=False)]


def _as_metadata(d: dict) -> dict:
    meta = {
        "tokenizer.ggml.model": d["model"],
        "tokenizer.ggml.tokens": d["tokens"],
        "tokenizer.ggml.token_type": d["types"],
        "tokenizer.ggml.bos_token_id": d["bos"],
        "tokenizer.ggml.eos_token_id": d["eos"],
    }
    for key, name in [("pre", "pre"), ("merges", "merges"), ("scores", "scores")]:
        if key in d:
            meta[f"tokenizer.ggml.{name}"] = d[key]
    if "unk" in d:
        meta["tokenizer.ggml.unknown_token_id"] = d["unk"]
    return meta


def test_digit_grouping_per_pre_tokenizer() -> None:
    assert _pieces("llama-bpe", "1234567") == ["123", "456", "7"]
    assert _pieces("qwen2", "1234567") == list("1234567")
    assert _pieces("gpt-2", "123456") == ["123", "456"]
    assert _pieces("smollm", "123456") == list("123456")


def test_llama3_uses_whole_tokens_without_merges() -> None:
    # Llama-3's tokenizer.json sets ignore_merges (llama.cpp does the same): a piece that is
    # a vocabulary entry is used whole even if no merge chain builds it.
    assert _pieces("llama-bpe", " xyz", ("Ġxyz",)) == ["Ġxyz"]
    assert _pieces("qwen2", " xyz", ("Ġxyz",)) == ["Ġ", "x", "y", "z"]


def test_qwen2_normalizes_to_nfc() -> None:
    assert _pieces("qwen2", "e\u0301") == _pieces("qwen2", "\u00e9")
    assert _pieces("gpt-2", "e\u0301") != _pieces("gpt-2", "\u00e9")


def test_llama3_adds_bos_by_default() -> None:
    meta = _as_metadata(bpe_tokenizer_dict("llama-bpe"))
    assert tokenizer_from_gguf_metadata(meta).encode("the")[0] == 0
    meta["tokenizer.ggml.add_bos_token"] = False
    assert tokenizer_from_gguf_metadata(meta).encode("the")[0] != 0


# ================================================================= errors


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model 'bert' is not supported"),
        ({"tokenizer.ggml.pre": "mystery"}, "tokenizer.ggml.pre 'mystery' is not supported"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens is missing"),
        ({"tokenizer.ggml.token_type": [1, 2]}, "tokenizer.ggml.token_type has 2 entries"),
        ({"tokenizer.ggml.merges": ["Ġt"]}, r"tokenizer.ggml.merges\[0\] 'Ġt' is not 'a b'"),
        ({"tokenizer.ggml.bos_token_id": 10**6}, "tokenizer.ggml.bos_token_id 1000000 is outside"),
        ({"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token must be a boolean"),
    ],
)
def test_bad_metadata_names_the_key(change: dict, message: str) -> None:
    meta = _as_metadata(bpe_tokenizer_dict("gpt-2"))
    meta.update(change)
    meta = {k: v for k, v in meta.items() if v is not None}
    with pytest.raises(HipcError, match=message):
        tokenizer_from_gguf_metadata(meta)


def test_merge_of_unknown_tokens() -> None:
    meta = _as_metadata(bpe_tokenizer_dict("gpt-2"))
    meta["tokenizer.ggml.merges"] = [*BPE_MERGES, "zz top"]
    with pytest.raises(HipcError, match=r"tokenizer\.ggml\.merges: .*out of vocabulary"):
        tokenizer_from_gguf_metadata(meta)


def test_sentencepiece_needs_scores() -> None:
    meta = _as_metadata(spm_tokenizer_dict())
    meta["tokenizer.ggml.scores"] = [0.0]
    with pytest.raises(HipcError, match=r"tokenizer\.ggml\.scores has 1 entries"):
        tokenizer_from_gguf_metadata(meta)
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(HipcError, match=r"tokenizer\.ggml\.scores is missing"):
        tokenizer_from_gguf_metadata(meta)


def test_unreadable_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(HipcError, match=r"bad\.gguf: not a readable GGUF file"):
        read_gguf_metadata(str(bad))
