"""Byte-level BPE: training is deterministic, text round-trips exactly, save/load and tiktoken files
reproduce the same encodings (checked against a pure-Python rank-based BPE, tiktoken's rule)."""

import base64
import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.data.corpus import stdlib_corpus
from k3.data.tokenizer import (
    DEFAULT_SPECIAL_TOKENS,
    Tokenizer,
    bpe_split,
    bytes_to_unicode,
    read_tiktoken_ranks,
    train_bpe,
)

SAMPLES = [
    "",
    "hello world",
    "def f(x):\n    return x ** 2  # squared\n\n\n",
    "Ünïcödé — 日本語のテキスト, emoji 🙂🧪 and Ω≈ç√∫ mixed\twith\ttabs\r\nand CRLF",
    "   leading spaces and trailing   ",
    "numbers 1234567890 3.14159 -42 0x1F",
    "a literal <|endoftext|> inside text and <|im_end|>",
    "\x00\x01\x7f control bytes \u200b zero width",
    "class Foo(Bar):\n\t'''docstring'''\n\tpass",
]


@functools.lru_cache(maxsize=None)
def corpus_texts() -> tuple[str, ...]:
    """~400 KB of stdlib source for the small tokenizers."""
    texts, size = [], 0
    for d in stdlib_corpus("train"):
        texts.append(d.text)
        size += len(d.text)
        if size > 400_000:
            break
    return tuple(texts)


@functools.lru_cache(maxsize=None)
def small_tokenizer() -> Tokenizer:
    return train_bpe(corpus_texts(), vocab_size=512)


def test_byte_alphabet_matches_hf():
    from tokenizers.pre_tokenizers import ByteLevel

    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert set(table.values()) == set(ByteLevel.alphabet())
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ"


def test_train_is_deterministic_and_sized():
    tok = small_tokenizer()
    again = train_bpe(corpus_texts(), vocab_size=512)
    assert tok.hf.to_str() == again.hf.to_str()
    assert tok.vocab_size == 512
    assert tok.eos_token == "<|endoftext|>" and tok.eos_id == 0 and tok.bos_id is None
    assert [tok.hf.token_to_id(s) for s in DEFAULT_SPECIAL_TOKENS] == list(range(len(DEFAULT_SPECIAL_TOKENS)))


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_samples(text):
    tok = small_tokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_any_text(text):
    tok = small_tokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_token_bytes_are_the_raw_bytes():
    """Each token's raw bytes: joined, a text's UTF-8 exactly (also where a token holds part of a character, which
    decode shows as U+FFFD); alone, what HF's ByteLevel decoder makes of the token; special tokens as their text."""
    tok = small_tokenizer()
    for text in SAMPLES:
        assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == text.encode("utf-8")
    for i in range(tok.vocab_size):
        assert tok.token_bytes(i).decode("utf-8", errors="replace") == tok.decode([i]), i
    assert tok.token_bytes(tok.eos_id) == b"<|endoftext|>"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.token_bytes(10**6)


def test_special_tokens_only_when_allowed():
    tok = small_tokenizer()
    text = "end<|endoftext|>start"
    assert tok.eos_id not in tok.encode(text)
    assert tok.encode(text, allow_special=True).count(tok.eos_id) == 1
    assert tok.decode(tok.encode(text, allow_special=True)) == text
    assert tok.encode_batch([text, "x"]) == [tok.encode(text), tok.encode("x")]


def test_save_load_round_trip(tmp_path):
    tok = small_tokenizer()
    path = tok.save(tmp_path / "tok")
    assert path.name == "tokenizer.json" and (tmp_path / "tok" / "tokenizer_config.json").is_file()
    for source in (tmp_path / "tok", path):
        loaded = Tokenizer.load(source)
        assert (loaded.vocab_size, loaded.eos_id, loaded.bos_id) == (tok.vocab_size, tok.eos_id, tok.bos_id)
        for text in SAMPLES:
            assert loaded.encode(text) == tok.encode(text)
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        Tokenizer.load(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not a valid HF tokenizer.json"):
        Tokenizer.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="eos_token='<nope>' is not in the vocabulary"):
        Tokenizer.load(path, eos_token="<nope>")


def test_train_bpe_rejects_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe(["abc"], vocab_size=100)
    with pytest.raises(ValueError, match="special_tokens must be distinct"):
        train_bpe(["abc"], vocab_size=300, special_tokens=("<a>", "<a>"))
    with pytest.raises(ValueError, match="no text"):
        train_bpe([], vocab_size=300)


def reference_encode(ranks: dict[bytes, int], tok: Tokenizer, text: str) -> list[int]:
    """tiktoken's algorithm in pure Python: regex pieces, then rank-based BPE on each piece's bytes."""
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ids = []
    for piece, _ in tok.hf.pre_tokenizer.pre_tokenize_str(text):
        ids += [ranks[p] for p in bpe_split(bytes(char_to_byte[c] for c in piece), ranks)]
    return ids


def test_tiktoken_round_trip(tmp_path):
    tok = small_tokenizer()
    path = tok.to_tiktoken(tmp_path / "k3.tiktoken")
    ranks = read_tiktoken_ranks(path)
    assert len(ranks) == tok.vocab_size - len(DEFAULT_SPECIAL_TOKENS)
    specials = {s: tok.hf.token_to_id(s) for s in DEFAULT_SPECIAL_TOKENS}
    loaded = Tokenizer.from_tiktoken(path, special_tokens=specials)
    assert (loaded.vocab_size, loaded.eos_id) == (tok.vocab_size, tok.eos_id)
    texts = list(SAMPLES) + [d.text for d in stdlib_corpus("validation", max_docs=3)]
    for text in texts:
        ids = loaded.encode(text)
        assert ids == tok.encode(text)
        assert loaded.decode(ids) == text
    for text in SAMPLES:  # the reference BPE is slow: short texts only
        assert loaded.encode(text) == reference_encode(ranks, loaded, text)
    assert loaded.encode("a<|im_end|>", allow_special=True)[-1] == specials["<|im_end|>"]
    again = Tokenizer.load(loaded.save(tmp_path / "saved"))
    assert again.encode(SAMPLES[3]) == tok.encode(SAMPLES[3])


def write_ranks(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def byte_lines():
    return [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]


def test_tiktoken_errors(tmp_path):
    good = byte_lines()
    ab = base64.b64encode(b"ab").decode()
    cases = {
        "fields": (good + [f"{ab} 256 extra"], r"bad.tiktoken:257: expected 'base64_token rank'"),
        "base64": (good + ["!!!! 256"], r"bad.tiktoken:257: '!!!!' is not valid base64"),
        "rank": (good + [f"{ab} x1"], r"bad.tiktoken:257: rank 'x1' is not an integer"),
        "dup-rank": (good + [f"{ab} 5"], r"bad.tiktoken:257: rank 5 repeats \(line 6 has it\)"),
        "dup-token": (good + [good[0].split()[0] + " 300"], r"bad.tiktoken:257: token b'\\x00' repeats"),
        "missing-byte": (good[1:], r"needs all 256 single bytes; 1 missing \(first: 0x00\)"),
    }
    for name, (lines, message) in cases.items():
        path = write_ranks(tmp_path / "bad.tiktoken", lines)
        with pytest.raises(ValueError, match=message):
            read_tiktoken_ranks(path)
    # "abc" with ranks a,b,c < abc but no "ab"/"bc": BPE cannot build it from two tokens.
    path = write_ranks(tmp_path / "bad.tiktoken", good + [f"{base64.b64encode(b'abc').decode()} 256"])
    with pytest.raises(ValueError, match=r"token b'abc' \(rank 256\) is not the merge of two"):
        Tokenizer.from_tiktoken(path)
    path = write_ranks(tmp_path / "ok.tiktoken", good + [f"{ab} 256"])
    with pytest.raises(ValueError, match="collides"):
        Tokenizer.from_tiktoken(path, special_tokens={"<|endoftext|>": 256})
    with pytest.raises(FileNotFoundError, match="no tiktoken file"):
        Tokenizer.from_tiktoken(tmp_path / "none.tiktoken")
    tiny = Tokenizer.from_tiktoken(path, special_tokens={"[EOS]": 300})
    assert tiny.eos_id == 300 and tiny.vocab_size == 301 and tiny.encode("abab") == [256, 256]


def test_save_writes_through_temp_files(tmp_path):
    """Saving over a tokenizer another process may be reading replaces each file whole (temp file + rename)."""
    tok = train_bpe(["def f(x):\n    return x + 1\n" * 50], 300)
    tok.save(tmp_path)
    tok.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    again = Tokenizer.load(tmp_path)
    assert again.encode("return x") == tok.encode("return x") and again.eos_id == tok.eos_id


def test_saved_tokenizer_config_loads_in_transformers(tmp_path):
    """tokenizer_config.json names the class, the bos / eos / pad tokens and the chat template, so
    transformers' AutoTokenizer loads the directory and encodes as k3 does; pad comes back on load."""
    import json

    transformers = pytest.importorskip("transformers")
    tok = train_bpe([" ".join(SAMPLES) * 5], 300, special_tokens=("<|endoftext|>", "[BOS]", "[PAD]"))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("[BOS]", "<|endoftext|>", "[PAD]")
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (
        config["tokenizer_class"] == "PreTrainedTokenizerFast"
        and "{%- for message in messages" in config["chat_template"]
    )
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("[BOS]", "<|endoftext|>", "[PAD]")
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    for text in SAMPLES:
        assert hf(text)["input_ids"] == tok.encode(text, allow_special=True)  # no BOS / EOS added
    assert Tokenizer.load(tmp_path).pad_id == tok.pad_id
    no_pad = train_bpe([" ".join(SAMPLES) * 5], 300)
    assert no_pad.pad_token == no_pad.eos_token == "<|endoftext|>"  # no pad token: EOS pads
    assert Tokenizer.load(tmp_path, pad_token="[BOS]").pad_id == tok.bos_id
