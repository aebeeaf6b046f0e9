"""Byte-level BPE tokenizers for ``k3 train``: train one with HF ``tokenizers``, or load a tiktoken file.

Every tokenizer here is byte-level: text is split by a regex into pieces, each piece's UTF-8 bytes are mapped
to printable characters (the GPT-2 byte alphabet) and merged by BPE, and decoding maps the characters back to
bytes. Any ``str`` therefore round-trips exactly: ``decode(encode(text)) == text``.

Two sources:

* :func:`train_bpe` trains a vocabulary on an iterable of texts (deterministic for a given input).
* :meth:`Tokenizer.from_tiktoken` reads a tiktoken-format file (K3's own vocabulary format: one
  ``base64(token bytes) rank`` per line) without the tiktoken package, and rebuilds the BPE merges from the
  ranks so that HF ``tokenizers`` encodes like tiktoken's rank-based BPE does.

``Tokenizer.save(dir)`` writes ``tokenizer.json`` (HF format) plus ``tokenizer_config.json`` naming the BOS, EOS
and pad tokens, the class transformers loads it as (``PreTrainedTokenizerFast``) and the chat template (Jinja,
k3.data.chat.chat_template), so ``transformers.AutoTokenizer.from_pretrained(dir)`` works and its
``apply_chat_template`` renders as k3's chat does. ``Tokenizer.load`` reads either a directory or a
``tokenizer.json`` file.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from k3.fs import atomic_file, atomic_write_text

# The cl100k_base pre-tokenizer regex: contractions, letter runs with one optional leading non-letter, numbers
# of at most 3 digits, punctuation runs (with trailing newlines), newline runs, and whitespace that leaves the
# last space to attach to the next word. K3/Kimi tokenizers use their own regex: pass it as ``pattern``.
CL100K_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's regex (what HF's ByteLevel pre-tokenizer uses when ``use_regex=True``).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# EOS comes first: it separates documents in packed training rows. The chat markers are Kimi's.
DEFAULT_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|im_end|>",
)
EOS_CANDIDATES = ("<|endoftext|>", "[EOS]", "</s>", "<|end_of_text|>", "<eos>")
BOS_CANDIDATES = ("[BOS]", "<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
PAD_CANDIDATES = ("[PAD]", "<pad>", "<|pad|>", "<|padding|>")  # none in the vocabulary: EOS pads


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte alphabet: byte value -> one printable character.

    Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68 bytes (controls,
    space, NBSP, soft hyphen) are shifted to U+0100 and up in byte order, so every character is visible.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _pre_tokenizer(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _special(content: str) -> AddedToken:
    return AddedToken(content, special=True, normalized=False)


class Tokenizer:
    """A thin wrapper over an HF ``tokenizers.Tokenizer`` with the ids the trainer needs.

    Attributes:
        hf: the wrapped HF tokenizer.
        vocab_size: largest id + 1 (the embedding rows the model needs; ids may have gaps).
        eos_token / eos_id: the end-of-document token (None if the vocabulary has none).
        bos_token / bos_id: the beginning-of-sequence token, or None.
        pad_token / pad_id: what pads a batch for transformers (a well-known pad token, else the EOS, else None).
    """

    def __init__(
        self,
        hf: HFTokenizer,
        eos_token: str | None = None,
        bos_token: str | None = None,
        pad_token: str | None = None,
    ):
        self.hf = hf
        vocab = hf.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ValueError("tokenizer has an empty vocabulary")
        self.vocab_size = max(vocab.values()) + 1
        self.eos_token = self._pick(vocab, eos_token, EOS_CANDIDATES, "eos_token")
        self.bos_token = self._pick(vocab, bos_token, BOS_CANDIDATES, "bos_token")
        self.pad_token = self._pick(vocab, pad_token, PAD_CANDIDATES, "pad_token") or self.eos_token
        self.eos_id = None if self.eos_token is None else vocab[self.eos_token]
        self.bos_id = None if self.bos_token is None else vocab[self.bos_token]
        self.pad_id = None if self.pad_token is None else vocab[self.pad_token]

    @staticmethod
    def _pick(vocab: dict[str, int], token: str | None, candidates: Sequence[str], what: str) -> str | None:
        if token is not None:
            if token not in vocab:
                raise ValueError(f"{what}={token!r} is not in the vocabulary")
            return token
        return next((c for c in candidates if c in vocab), None)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}, bos={self.bos_token!r})"

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """text -> token ids. With ``allow_special=False`` (the default, right for raw corpora) special-token
        strings inside ``text`` (e.g. a literal ``<|endoftext|>``) are encoded as ordinary text, so document
        boundaries come only from the EOS the data pipeline appends."""
        self.hf.encode_special_tokens = not allow_special
        return self.hf.encode(text, add_special_tokens=False).ids

    def prompt_ids(self, text: str) -> list[int]:
        """The ids a generation starts from: :meth:`encode` of ``text``, or for an empty text the BOS token alone
        (a model needs a token to continue from; OpenAI's completions take ``prompt: ""``), which counts as a
        prompt token. One ValueError when the text is empty and the vocabulary has no BOS token."""
        ids = self.encode(text)
        if ids:
            return ids
        if self.bos_id is None:
            raise ValueError(
                "the prompt is empty and this tokenizer has no BOS token to start from: give at least one character"
            )
        return [self.bos_id]

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        """Like :meth:`encode` for many texts at once (parallel, in Rust)."""
        self.hf.encode_special_tokens = not allow_special
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """token ids -> text (special tokens are kept as their text)."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (its piece of a multi-byte character too, which :meth:`decode` shows as
        U+FFFD): a byte-level token's characters mapped back to the bytes they stand for; a special token's text,
        or any token of a tokenizer that is not byte-level, in UTF-8."""
        piece = self.hf.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        if int(token_id) in self.hf.get_added_tokens_decoder() or not isinstance(self.hf.decoder, decoders.ByteLevel):
            return piece.encode("utf-8")
        try:
            return _to_bytes(piece)
        except ValueError:  # a character outside the byte alphabet
            return piece.encode("utf-8")

    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json`` (HF format) and ``tokenizer_config.json`` (the bos/eos/pad names, the chat
        template, ``tokenizer_class: PreTrainedTokenizerFast``) into ``directory``; returns the path of
        ``tokenizer.json``."""
        from k3.data.chat import chat_template

        directory = Path(directory)
        path = directory / "tokenizer.json"
        with atomic_file(path) as tmp:  # other processes may be reading the same files (resumed runs)
            self.hf.save(str(tmp))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "clean_up_tokenization_spaces": False,  # decoding is byte-exact
            "chat_template": chat_template(self),
        }
        atomic_write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
        return path

    @classmethod
    def load(
        cls,
        path: str | Path,
        eos_token: str | None = None,
        bos_token: str | None = None,
        pad_token: str | None = None,
    ) -> Tokenizer:
        """Read a directory holding ``tokenizer.json`` or the file itself. EOS/BOS/pad come from the arguments,
        else from a ``tokenizer_config.json`` beside it (HF convention), else from well-known token names."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer file at {file}")
        try:
            hf = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for bad JSON or unknown fields
            raise ValueError(f"{file}: not a valid HF tokenizer.json ({e})") from None
        config_file = file.parent / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{config_file}: invalid JSON ({e})") from None
            eos_token = eos_token if eos_token is not None else _token_name(config.get("eos_token"))
            bos_token = bos_token if bos_token is not None else _token_name(config.get("bos_token"))
            pad_token = pad_token if pad_token is not None else _token_name(config.get("pad_token"))
        return cls(hf, eos_token=eos_token, bos_token=bos_token, pad_token=pad_token)

    @classmethod
    def from_tiktoken(
        cls,
        path: str | Path,
        pattern: str = CL100K_PATTERN,
        special_tokens: dict[str, int] | None = None,
        eos_token: str | None = None,
        bos_token: str | None = None,
    ) -> Tokenizer:
        """Load a tiktoken-format BPE file (lines ``base64(token bytes) rank``) as a byte-level HF tokenizer.

        Token ids are the ranks. BPE merges are rebuilt from the ranks: for each multi-byte token t of rank r,
        rank-based BPE is run on t's bytes using only tokens of rank < r; it must stop at exactly two tokens
        (a, b), and (a, b) becomes the merge of priority r. HF then merges in rank order, as tiktoken does.

        Args:
            path: the tiktoken file.
            pattern: the pre-tokenizer regex (default cl100k's; pass the vocabulary's own regex).
            special_tokens: content -> id for special tokens (ids must not collide with ranks).
            eos_token, bos_token: names among ``special_tokens``; default: well-known names if present.
        """
        ranks = read_tiktoken_ranks(path)
        merges = derive_merges(ranks, source=str(path))
        vocab = {_to_chars(t): r for t, r in ranks.items()}
        specials = dict(special_tokens or {})
        taken = set(ranks.values())
        for content, i in specials.items():
            if not content or isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"special token {content!r}: needs non-empty text and an id >= 0, got {i!r}")
            if i in taken or content in vocab:
                raise ValueError(f"special token {content!r} (id {i}) collides with a token of {path}")
            taken.add(i)
            vocab[content] = i  # in the model's vocab so the id is kept; no merge can produce it
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=[(_to_chars(a), _to_chars(b)) for a, b in merges]))
        hf.pre_tokenizer = _pre_tokenizer(pattern)
        hf.decoder = decoders.ByteLevel()
        if specials:
            hf.add_special_tokens([_special(c) for c in sorted(specials, key=specials.__getitem__)])
        return cls(hf, eos_token=eos_token, bos_token=bos_token)

    def to_tiktoken(self, path: str | Path) -> Path:
        """Write the non-special tokens as a tiktoken file (``base64(bytes) id`` per line, in id order)."""
        added = {t.content for t in self.hf.get_added_tokens_decoder().values()}
        items = sorted((i, t) for t, i in self.hf.get_vocab(with_added_tokens=False).items() if t not in added)
        lines = [f"{base64.b64encode(_to_bytes(t)).decode('ascii')} {i}\n" for i, t in items]
        path = Path(path)
        path.write_text("".join(lines), encoding="ascii")
        return path


def _token_name(value: object) -> str | None:
    """tokenizer_config.json stores a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _to_chars(token: bytes) -> str:
    return "".join(_BYTE_TO_CHAR[b] for b in token)


def _to_bytes(chars: str) -> bytes:
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in chars)
    except KeyError as e:
        raise ValueError(f"token {chars!r} is not byte-level (character {e.args[0]!r})") from None


def train_bpe(
    texts: Iterable[str],
    vocab_size: int = 8192,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    pattern: str = CL100K_PATTERN,
    min_frequency: int = 2,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer (deterministic for the same texts and arguments).

    Args:
        texts: the training texts (any iterable; consumed once).
        vocab_size: total size: special tokens + 256 bytes + merges (fewer if the texts run out of pairs).
        special_tokens: get ids 0..len-1 in this order; the first well-known EOS name among them is the EOS.
        pattern: pre-tokenizer regex (default cl100k's, good for code and prose).
        min_frequency: a pair must occur this often to be merged.
    """
    specials = list(special_tokens)
    if len(set(specials)) != len(specials) or not all(isinstance(s, str) and s for s in specials):
        raise ValueError(f"special_tokens must be distinct non-empty strings, got {specials!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= 256 + {len(specials)} special tokens")
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
        raise ValueError(f"min_frequency={min_frequency!r} must be an int >= 1")
    seen = 0

    def counted() -> Iterable[str]:
        nonlocal seen
        for t in texts:
            if not isinstance(t, str):
                raise ValueError(f"train_bpe texts must be str, got {type(t).__name__}")
            seen += len(t)
            yield t

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = _pre_tokenizer(pattern)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[_special(s) for s in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(counted(), trainer=trainer)
    if seen == 0:
        raise ValueError("train_bpe got no text to train on")
    return Tokenizer(hf)


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken file into {token bytes: rank}, with one clear ValueError per malformed line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no tiktoken file at {path}")
    ranks: dict[bytes, int] = {}
    used: dict[int, int] = {}  # rank -> line
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            fields = line.split()
            where = f"{path}:{lineno}"
            if len(fields) != 2:
                raise ValueError(f"{where}: expected 'base64_token rank', got {line.strip()[:80]!r}")
            try:
                token = base64.b64decode(fields[0], validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"{where}: {fields[0][:40]!r} is not valid base64") from None
            try:
                rank = int(fields[1])
            except ValueError:
                raise ValueError(f"{where}: rank {fields[1][:40]!r} is not an integer") from None
            if not token or rank < 0:
                raise ValueError(f"{where}: needs a non-empty token and a rank >= 0")
            if token in ranks:
                raise ValueError(f"{where}: token {token!r} repeats (rank {ranks[token]} before)")
            if rank in used:
                raise ValueError(f"{where}: rank {rank} repeats (line {used[rank]} has it)")
            ranks[token] = rank
            used[rank] = lineno
    if not ranks:
        raise ValueError(f"{path}: no tokens")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"{path}: a byte-level vocabulary needs all 256 single bytes; {len(missing)} missing "
            f"(first: {missing[0]:#04x})"
        )
    return ranks


def bpe_split(token: bytes, ranks: dict[bytes, int], max_rank: int | None = None) -> list[bytes]:
    """Rank-based BPE (tiktoken's rule) on ``token``'s bytes: repeatedly merge the adjacent pair whose
    concatenation has the lowest rank (the leftmost on ties), using only ranks < ``max_rank``."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (max_rank is None or r < max_rank) and (best_rank is None or r < best_rank):
                best_rank, best_i = r, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def derive_merges(ranks: dict[bytes, int], source: str = "tiktoken ranks") -> list[tuple[bytes, bytes]]:
    """The BPE merge list implied by ``ranks``: one (a, b) per multi-byte token, in rank order."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = bpe_split(token, ranks, max_rank=rank)
        if len(parts) != 2:
            raise ValueError(
                f"{source}: token {token!r} (rank {rank}) is not the merge of two lower-ranked "
                f"tokens (BPE stops at {len(parts)} parts)"
            )
        merges.append((parts[0], parts[1]))
    return merges
