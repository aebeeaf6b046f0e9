"""Incremental detokenisation equals a full decode; stop strings never leak, streamed or whole."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from k3.infer.detok import IncrementalDecoder, StopMatcher


class ByteTokens:
    """A byte-level tokenizer: 256 single-byte tokens and a few multi-byte merges (pieces of UTF-8 characters)."""

    def __init__(self):
        alphabet = sorted(ByteLevel.alphabet())
        vocab = {c: i for i, c in enumerate(alphabet)}
        for piece in ("é", "€", "😀", " the", "ab"):
            vocab["".join(_map(b) for b in piece.encode())] = len(vocab)
        self.hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        self.hf.decoder = decoders.ByteLevel()
        self.size = len(vocab)

    def decode(self, ids):
        return self.hf.decode(list(ids), skip_special_tokens=False)


def _map(b: int) -> str:
    """GPT-2's byte-to-character map."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


TOK = ByteTokens()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, TOK.size - 1), max_size=40))
def test_incremental_decode_equals_a_full_decode(ids):
    d = IncrementalDecoder(TOK)
    assert "".join(d.push(i) for i in ids) + d.flush() == TOK.decode(ids)


def reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text a character at a time: at the first prefix holding a stop string, cut at its start."""
    for n in range(1, len(text) + 1):
        starts = [text[:n].find(s) for s in stops if s in text[:n]]
        if starts:
            return text[: min(starts)], True
    return text, False


@settings(max_examples=400, deadline=None)
@given(
    st.text(alphabet="abc xé", max_size=30),
    st.lists(st.text(alphabet="abc xé", min_size=1, max_size=5), min_size=1, max_size=4),
    st.integers(0, 2**32),
)
def test_stop_strings_never_leak(text, stops, seed):
    """Fed in random pieces: what is returned while running is always a prefix of the reference output (nothing
    of a stop string goes out early), and all of it at the end equals the reference."""
    rng = random.Random(seed)
    want, want_stopped = reference_stop(text, stops)
    m, out, stopped, i = StopMatcher(stops), "", False, 0
    while i < len(text) and not stopped:
        j = min(len(text), i + rng.randrange(1, 4))
        got, stopped = m.feed(text[i:j], final=j == len(text))
        out += got
        assert want.startswith(out), (out, want)
        i = j
    if not stopped:
        got, stopped = m.feed("", final=True)
        out += got
    assert (out, stopped) == (want, want_stopped)
