"""Training data for ``k3 train``: documents, the built-in corpus, and packing into fixed-length rows.

Documents
    A :class:`Document` is a name and a text. :func:`stdlib_corpus` gives the default corpus (the Python
    standard library's own ``.py`` files, so training works with no download); ``--data stdlib+pydoc-topics``
    (:data:`MIXTURE`) adds natural-language text shipped with Python, the help topics of ``pydoc_data.topics``
    (~465 KB of English prose, split on their own so both kinds are in validation); ``packages:NAME==VERSION,...``
    the text files of installed distributions (:func:`packages_corpus`; parts join with ``+``); :func:`load_documents`
    reads user data (a text file, a directory, ``.jsonl`` or ``.parquet``).

Split
    Train/validation is decided per document by a stable hash of its name (sha1, ~2% validation), so it never
    depends on file order, the machine or the Python hash seed; a corpus of >= 2 documents always gets at least
    one document in each split. ``k3 train`` evaluates on the first rows of the validation documents packed in an
    order shuffled with a fixed seed (k3.train.trainer.VALIDATION_SEED).

Packing (:class:`PackedDataset`)
    Documents are tokenised once, an EOS id is appended to each, and they are concatenated in a seeded shuffled
    order into one token stream s. Row r is ``s[r*T : r*T + T + 1]`` (T = seq_len; consecutive rows share one
    token), its inputs are ``row[:-1]`` and its labels ``row[1:]``, so every stream token is a label once.

    Segments: in a row a new segment starts right *after* each EOS input, so an EOS is the last token of its
    document's segment (the model learns to predict EOS at the end of a document). The label at an EOS input
    position would be the next document's first token, predicted across a boundary: it is set to -100 (ignored).
    A document continuing from the previous row starts a segment at position 0. ``cu_seqlens`` follow the
    FlashAttention convention: int64 [S+1], 0 = c_0 < c_1 < ... < c_S = number of input positions.

    Example, T = 8, stream ``a b c E x y E p q ...`` (E = EOS):
        inputs      a    b    c    E     x    y    E     p
        labels      b    c    E    -100  y    E    -100  q
        cu_seqlens  [0, 4, 7, 8]

    Chat data (k3.data.sft) packs conversations the same way, with a ``trained`` flag per stream token: a label
    whose token is not trained (anything the assistant does not say) is ignored too.

Batches and resuming
    Rows are visited in a seeded permutation per epoch (a new permutation each epoch). :meth:`batch` is a pure
    function of (seed, step, batch size): row g = step*B + b of the global visit order is row ``perm_e[g % R]``
    of epoch ``e = g // R``. :meth:`next_batch` walks the same order from :attr:`position`, a
    :class:`DataPosition` of plain ints that ``state_dict()``/``load_state_dict()`` save and restore, so a
    resumed run sees exactly the batches an uninterrupted run would.

Bits per byte
    ``bytes_per_token`` = UTF-8 bytes of the packed documents / their labels. The labels of a document are its
    tokens after the first, plus its EOS: as many as its text tokens, so
    ``bits_per_byte = mean_label_loss_in_nats / ln(2) / bytes_per_token`` (chat data: the trained tokens and the
    bytes of their text).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:  # torch is imported where a dataset is built, so the corpus specs load without it (k3 --help)
    from torch import Tensor

    from k3.ops.segments import Segments

VALIDATION_FRACTION = 0.02
SPLITS = ("train", "validation", "all")
TEXT_SUFFIXES = (".txt", ".md", ".py")
DATA_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")
# Directories of the stdlib that are not the library itself (tests, the IDE, the retired 2to3, installed packages).
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Document:
    """One training document. ``name`` is stable across machines (a relative path, plus ``:line`` for .jsonl
    and ``:row`` for .parquet); the train/validation split is a function of it."""

    name: str
    text: str


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha1(name.encode("utf-8")).digest()[:8], "big")


def split_documents(documents: Sequence[Document], split: str, fraction: float = VALIDATION_FRACTION) -> list[Document]:
    """The documents of ``split`` ("train", "validation" or "all"), in their input order.

    A document is in validation when sha1(name) / 2**64 < fraction. With >= 2 documents, if no document falls in
    validation the one of smallest hash moves there; if all do, the one of largest hash moves to train.
    """
    _check_split(split)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation fraction={fraction!r} must be in (0, 1)")
    if split == "all":
        return list(documents)
    hashes = [_name_hash(d.name) for d in documents]
    threshold = int(fraction * 2**64)
    validation = {i for i, h in enumerate(hashes) if h < threshold}
    if len(documents) >= 2:
        if not validation:
            validation = {min(range(len(hashes)), key=hashes.__getitem__)}
        elif len(validation) == len(documents):
            validation.discard(max(range(len(hashes)), key=hashes.__getitem__))
    want = split == "validation"
    return [d for i, d in enumerate(documents) if (i in validation) == want]


def _check_max(value: int | None, what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{what}={value!r} must be None or an int >= 1")


def stdlib_root() -> Path:
    """The directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(split: str = "train", max_docs: int | None = None) -> list[Document]:
    """The running Python's standard-library ``.py`` files as documents (the default training corpus).

    Files under ``STDLIB_SKIP_DIRS``, empty files and files that are not valid UTF-8 are skipped. Names are
    sorted relative paths (e.g. ``asyncio/events.py``); ``max_docs`` keeps the first that many of the split.
    The corpus depends on the Python version (3.11's: ~600 files, ~11 MB).
    """
    _check_split(split)
    _check_max(max_docs, "max_docs")
    root = stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"no standard library directory at {root}")
    docs = []
    for rel in _walk(root, (".py",), skip=STDLIB_SKIP_DIRS):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(Document(rel, text))
    if not docs:
        raise ValueError(f"no .py files found in the standard library at {root}")
    docs = split_documents(docs, split)
    return docs if max_docs is None else docs[:max_docs]


MIXTURE = "stdlib+pydoc-topics"  # code + prose, both shipped with Python
PACKAGES = "packages:"  # a corpus part: the text files of installed distributions, packages:NAME[==VERSION],...
# ~50M tokens of code and prose for runs that must not repeat their data: Python's own, plus the sources and
# docstrings of torch, three of its dependencies and transformers
PACKAGES_MIXTURE = MIXTURE + "+" + PACKAGES + "torch,transformers,sympy,numpy,networkx"
PACKAGE_SUFFIXES = (".py", ".md", ".rst", ".txt")


def pydoc_topics_corpus(split: str = "train") -> list[Document]:
    """Python's help topics (``pydoc_data.topics.topics``: the language reference's prose, one document per topic,
    named ``pydoc_data/topics/NAME``), split by :func:`split_documents`."""
    _check_split(split)
    from pydoc_data.topics import topics

    docs = [Document(f"pydoc_data/topics/{name}", text) for name, text in sorted(topics.items()) if text.strip()]
    if len(docs) < 2:
        raise ValueError("pydoc_data.topics holds fewer than 2 topics: no train/validation split")
    return split_documents(docs, split)


def _walk(root: Path, suffixes: Sequence[str], skip: frozenset[str] = frozenset()) -> list[str]:
    """Sorted POSIX paths relative to ``root`` of the files ending in ``suffixes``; hidden entries (".x") and
    directories named in ``skip`` are not entered."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        base = Path(dirpath).relative_to(root)
        found += [(base / f).as_posix() for f in filenames if f.endswith(suffixes) and not f.startswith(".")]
    return sorted(found)


def load_documents(path: str | Path, split: str = "train") -> list[Document]:
    """Read user data as documents, keeping those of ``split`` (see :func:`split_documents`).

    ``path`` may be:
      * a directory: every ``.txt``, ``.md``, ``.py``, ``.jsonl`` and ``.parquet`` file under it (recursively,
        hidden entries skipped), in sorted relative-path order; names are relative to the directory;
      * a ``.jsonl`` file: one document per non-blank line, from the string field ``text``;
      * a ``.parquet`` file: one document per row of the string column ``text`` (needs pyarrow);
      * any other file: one UTF-8 text document.
    Empty texts (and null parquet values) are skipped.
    """
    _check_split(split)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no data at {path}")
    if path.is_dir():
        files = [(path / rel, rel) for rel in _walk(path, DATA_SUFFIXES)]
    else:
        files = [(path, path.name)]
    docs = [doc for file, name in files for doc in _read_file(file, name)]
    if not docs:
        raise ValueError(f"{path}: no documents (looked for non-empty {', '.join(DATA_SUFFIXES)} files)")
    chosen = split_documents(docs, split)
    if not chosen:
        raise ValueError(
            f"{path}: the {split} split is empty ({len(docs)} document(s); a train/validation split needs at least 2)"
        )
    return chosen


def _package_pins(names: str) -> list[tuple[str, str]]:
    """``NAME[==VERSION],...`` -> [(name, version or "")]."""
    return [n.strip().partition("==")[::2] for n in names.split(",") if n.strip()]


def _public_version(name: str) -> str:
    """The installed version of distribution ``name`` without its local part (``2.11.0+cu130`` -> ``2.11.0``);
    ValueError when it is not installed."""
    import importlib.metadata as metadata

    try:
        return metadata.version(name).split("+")[0]
    except metadata.PackageNotFoundError:
        raise ValueError(f"{PACKAGES}{name}: distribution {name!r} is not installed") from None


def packages_corpus(names: str, split: str = "train") -> list[Document]:
    """The text files (``PACKAGE_SUFFIXES``) that installed distributions list in their metadata, one document
    each, named ``DIST/PATH`` (the version left out, so the split of a file survives an upgrade). ``names``: comma-
    separated distribution names, each optionally pinned as ``NAME==VERSION``, checked against the installed
    version's public part (``2.11.0`` matches ``2.11.0+cu130``), so a corpus named with pins is the same text on any
    machine that accepts it. Metadata folders (``*.dist-info``), empty and non-UTF-8 files are skipped."""
    import importlib.metadata as metadata

    _check_split(split)
    docs = []
    for name, pin in _package_pins(names):
        version = _public_version(name)
        if pin and version != pin:
            raise ValueError(f"{PACKAGES}{names}: {name} is {version} here, the corpus names {pin}")
        dist = metadata.distribution(name)
        files = sorted(
            (f for f in dist.files or () if f.suffix in PACKAGE_SUFFIXES and not f.parts[0].endswith(".dist-info")),
            key=lambda f: f.as_posix(),
        )
        for f in files:
            try:
                text = Path(f.locate()).read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                docs.append(Document(f"{name}/{f.as_posix()}", text))
    if len(docs) < 2:
        raise ValueError(f"{PACKAGES}{names}: fewer than 2 text files ({', '.join(PACKAGE_SUFFIXES)}) found")
    return split_documents(docs, split)


def corpus_parts(source: str) -> list[str] | None:
    """The parts of a built-in corpus spec: ``stdlib``, ``pydoc-topics`` and ``packages:NAME[==VERSION],...``
    joined by ``+`` (e.g. :data:`MIXTURE`); None when ``source`` is not one (it is then a path)."""
    parts = source.split("+")
    known = all(p in ("stdlib", "pydoc-topics") or (p.startswith(PACKAGES) and len(p) > len(PACKAGES)) for p in parts)
    return parts if known and not Path(source).exists() else None


def pin_corpus(source: str | None) -> str | None:
    """A built-in corpus spec with every ``packages:`` name pinned to its installed version (``torch`` ->
    ``torch==2.11.0``), so a run records the exact text it read; anything else unchanged."""
    parts = None if source is None else corpus_parts(source)
    if parts is None:
        return source
    out = []
    for p in parts:
        if p.startswith(PACKAGES):
            pins = _package_pins(p[len(PACKAGES) :])
            p = PACKAGES + ",".join(f"{n}=={pin or _public_version(n)}" for n, pin in pins)
        out.append(p)
    return "+".join(out)


def load_corpus(source: str | Path | None, split: str = "train", max_docs: int | None = None) -> list[Document]:
    """``source=None``: the stdlib corpus; a built-in corpus spec (:func:`corpus_parts`, e.g. :data:`MIXTURE`):
    its parts in order, each split on its own (so each has documents in validation); otherwise
    :func:`load_documents`. The first ``max_docs`` are kept."""
    _check_max(max_docs, "max_docs")
    parts = ["stdlib"] if source is None else corpus_parts(str(source))
    docs = load_documents(source, split) if parts is None else [d for p in parts for d in _corpus_part(p, split)]
    return docs if max_docs is None else docs[:max_docs]


def _corpus_part(part: str, split: str) -> list[Document]:
    if part == "stdlib":
        return stdlib_corpus(split)
    if part == "pydoc-topics":
        return pydoc_topics_corpus(split)
    return packages_corpus(part[len(PACKAGES) :], split)


def describe_corpus(source: str | None) -> str:
    """A corpus named for a report: what each part of a built-in spec holds, else the path."""
    if source is None:
        return "the Python standard library's sources (code)"
    parts = corpus_parts(source)
    if parts is None:
        return f"`{source}`"
    words = {
        "stdlib": "the standard library's sources (code)",
        "pydoc-topics": "Python's help topics (English prose from `pydoc_data.topics`)",
    }
    said = [
        words.get(p)
        or f"the {', '.join(PACKAGE_SUFFIXES)} files of the distributions {p[len(PACKAGES) :]} (code and docstrings)"
        for p in parts
    ]
    return f"`{source}`: " + "; ".join(said) + ("; each split on its own" if len(parts) > 1 else "")


def _read_file(file: Path, name: str) -> Iterator[Document]:
    if file.suffix == ".jsonl":
        yield from _read_jsonl(file, name)
    elif file.suffix == ".parquet":
        yield from _read_parquet(file, name)
    else:
        try:
            text = file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{file}: not UTF-8 text (bad byte at offset {e.start})") from None
        if text:
            yield Document(name, text)


def _read_jsonl(file: Path, name: str) -> Iterator[Document]:
    with file.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{file}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict) or "text" not in record:
                raise ValueError(f"{where}: expected a JSON object with a 'text' field")
            text = record["text"]
            if not isinstance(text, str):
                raise ValueError(f"{where}: field 'text' must be a string, got {type(text).__name__}")
            if text:
                yield Document(f"{name}:{lineno}", text)


def _read_parquet(file: Path, name: str) -> Iterator[Document]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{file}: reading .parquet needs pyarrow (pip install 'k3[data]')") from None
    try:
        pf = pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{file}: not a readable parquet file ({e})") from None
    schema = pf.schema_arrow
    if "text" not in schema.names:
        raise ValueError(f"{file}: no 'text' column (columns: {', '.join(schema.names) or 'none'})")
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{file}: column 'text' must hold strings, got {kind}")
    row = 0
    for chunk in pf.iter_batches(columns=["text"]):
        for text in chunk.column(0).to_pylist():
            if text:
                yield Document(f"{name}:{row}", text)
            row += 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (uint64 arithmetic wraps)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seeded_permutation(n: int, seed: int, stream: str) -> np.ndarray:
    """A permutation of range(n) fixed by (seed, stream) on every platform and library version: indices sorted
    by a keyed bijective hash (distinct keys, so no ties)."""
    key = int.from_bytes(hashlib.sha256(f"{seed}/{stream}".encode()).digest()[:8], "little")
    return np.argsort(_splitmix64(np.arange(n, dtype=np.uint64) ^ np.uint64(key)), kind="stable")


def stream_tokens(steps: int, rows_per_step: int, seq_len: int) -> int:
    """Tokens of the packed stream for ``steps`` steps of ``rows_per_step`` rows of ``seq_len`` (row r is
    s[r T : r T + T + 1]), one row spare: what to tokenise (``max_tokens``) for a run that reads each token once."""
    return (steps * rows_per_step + 1) * seq_len + 1


def tokenizer_texts(docs: Sequence[Document], budget: int) -> list[str]:
    """About ``budget`` characters of ``docs`` to train a tokenizer on: whole documents in a fixed shuffled order
    until the budget is reached (all of them when they hold less), so every part of a mixture is in the sample in
    proportion to its size, not only the split's first part."""
    out, used = [], 0
    for i in seeded_permutation(len(docs), 0, "tokenizer"):
        if used >= budget:
            break
        out.append(docs[i].text)
        used += len(docs[i].text)
    return out


class TokenizerLike(Protocol):
    """What packing needs: ``encode`` (``encode_batch`` is used when present) and the EOS id."""

    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...


@dataclass
class Batch:
    """B rows of T tokens.

    input_ids: [B, T] int64.
    labels: [B, T] int64, the next token, -100 at EOS input positions (no prediction across documents).
    cu_seqlens: [S+1] int64 segment offsets into the flattened B*T positions; every row boundary (b*T) and every
        position right after an EOS input starts a segment. (A context-parallel rank's local batch holds its
        k3.ops.segments.Segments instead, which carry the shard.)
    """

    input_ids: Tensor
    labels: Tensor
    cu_seqlens: Tensor | Segments


@dataclass
class DataPosition:
    """Where :meth:`PackedDataset.next_batch` continues: row ``next_row`` of epoch ``epoch``'s visit order."""

    epoch: int = 0
    next_row: int = 0


class PackedDataset:
    """Documents tokenised once and packed into rows of ``seq_len + 1`` tokens (see the module docstring).

    Args:
        documents: the documents (their order does not matter beyond the seeded shuffle).
        tokenizer: an object with ``encode(text) -> list[int]`` and ``eos_id``.
        seq_len: T, the input positions per row.
        seed: fixes the document order and the per-epoch row orders.
        max_tokens: stop adding (whole) documents once the stream holds at least this many tokens.
        shuffle: shuffle the document order (False: keep the given order).
        encode_chunk: documents per ``encode_batch`` (or ``encode``) call.
        encode: documents -> ``[(ids, trained, num_bytes)]``, in place of the tokenizer's text encoding (chat
            data, k3.data.sft): ``trained`` [len(ids) + 1] marks which of the ids and of the EOS after them are
            loss targets (the others' labels are ignored), ``num_bytes`` the UTF-8 bytes of the trained text.

    Attributes: ``tokens`` (the stream, int32 [N]), ``trained`` (bool [N], which stream tokens are loss targets;
    None: all), ``num_rows`` R = (N - 1) // T, ``num_documents``, ``num_bytes``, ``num_text_tokens`` (N minus the
    EOS ids), ``num_labels`` (loss targets), ``bytes_per_token`` (num_bytes / num_labels), ``position``.
    """

    def __init__(
        self,
        documents: Iterable[Document],
        tokenizer: TokenizerLike,
        seq_len: int,
        seed: int = 0,
        max_tokens: int | None = None,
        shuffle: bool = True,
        encode_chunk: int = 256,
        encode=None,
    ):
        import torch

        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be an int >= 1")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed={seed!r} must be an int")
        _check_max(max_tokens, "max_tokens")
        _check_max(encode_chunk, "encode_chunk")
        eos = getattr(tokenizer, "eos_id", None)
        if isinstance(eos, bool) or not isinstance(eos, int) or eos < 0:
            raise ValueError(f"tokenizer eos_id={eos!r}: packing needs an EOS id to separate documents")
        docs = list(documents)
        if not docs:
            raise ValueError("PackedDataset needs at least one document")
        self.seq_len, self.seed, self.eos_id = seq_len, seed, eos
        order = seeded_permutation(len(docs), seed, "documents") if shuffle else np.arange(len(docs))
        encode_batch = getattr(tokenizer, "encode_batch", None)
        pieces: list[np.ndarray] = []
        flags: list[np.ndarray] = []  # with ``encode``: per document, which of its ids and its EOS are trained
        total = num_bytes = num_docs = num_labels = 0
        for start in range(0, len(docs), encode_chunk):
            chunk = [docs[i] for i in order[start : start + encode_chunk]]
            if encode is not None:
                encoded = encode(chunk)
            else:
                texts = [d.text for d in chunk]
                ids_list = encode_batch(texts) if encode_batch is not None else [tokenizer.encode(t) for t in texts]
                encoded = [(ids, None, len(d.text.encode("utf-8"))) for d, ids in zip(chunk, ids_list)]
            for doc, (ids, trained, doc_bytes) in zip(chunk, encoded):
                arr = np.asarray(ids, dtype=np.int64)
                if arr.size and (arr.min() < 0 or arr.max() >= 2**31):
                    raise ValueError(f"document {doc.name!r}: token ids must be in [0, 2**31)")
                if (arr == eos).any():
                    raise ValueError(
                        f"document {doc.name!r}: the tokenizer produced the EOS id {eos} inside the "
                        "text (encode special-token strings as plain text)"
                    )
                pieces += [arr, np.array([eos], dtype=np.int64)]
                if encode is not None:
                    trained = np.asarray(trained, dtype=bool)
                    if trained.shape != (arr.size + 1,):
                        raise ValueError(
                            f"document {doc.name!r}: {trained.size} trained flags for {arr.size} ids + EOS"
                        )
                    flags.append(trained)
                    num_labels += int(trained.sum())
                else:  # every token after the stream's first is a label once: as many as the text tokens
                    num_labels += arr.size
                total += arr.size + 1
                num_bytes += doc_bytes
                num_docs += 1
                if max_tokens is not None and total >= max_tokens:
                    break
            if max_tokens is not None and total >= max_tokens:
                break
        self.tokens = torch.from_numpy(np.concatenate(pieces).astype(np.int32))
        self.trained = torch.from_numpy(np.concatenate(flags)) if encode is not None else None
        self.num_documents = num_docs
        self.num_bytes = num_bytes
        self.num_text_tokens = total - num_docs
        self.num_labels = num_labels
        self.bytes_per_token = num_bytes / max(num_labels, 1)
        self.num_rows = (total - 1) // seq_len
        if self.num_rows < 1:
            raise ValueError(
                f"{num_docs} document(s) give {total} tokens, fewer than one row of seq_len + 1 = {seq_len + 1}"
            )
        self.position = DataPosition()
        self._perms: dict[int, Tensor] = {}

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return (
            f"PackedDataset(documents={self.num_documents}, tokens={self.tokens.numel()}, rows={self.num_rows}"
            f", seq_len={self.seq_len}, bytes_per_token={self.bytes_per_token:.3f})"
        )

    def row_tokens(self, row: int) -> Tensor:
        """Row ``row`` (in stream order) as int64 [T + 1]."""
        if not 0 <= row < self.num_rows:
            raise ValueError(f"row={row} out of range [0, {self.num_rows})")
        return self.tokens[row * self.seq_len : (row + 1) * self.seq_len + 1].long()

    def rows_batch(self, rows: Tensor | Sequence[int]) -> Batch:
        """A :class:`Batch` of the given stream-order rows (in that order)."""
        import torch

        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if rows.numel() == 0 or rows.min() < 0 or rows.max() >= self.num_rows:
            raise ValueError(f"rows must be a non-empty list of indices in [0, {self.num_rows})")
        B, T = rows.numel(), self.seq_len
        at = rows[:, None] * T + torch.arange(T + 1)  # [B, T+1] stream positions
        full = self.tokens[at].long()
        input_ids, labels = full[:, :-1].contiguous(), full[:, 1:].clone()
        is_eos = input_ids == self.eos_id
        labels[is_eos] = IGNORE_INDEX
        if self.trained is not None:
            labels[~self.trained[at[:, 1:]]] = IGNORE_INDEX
        starts = torch.zeros(B * T, dtype=torch.bool)
        starts[::T] = True
        starts[1:] |= is_eos.reshape(-1)[:-1]
        cu_seqlens = torch.cat([starts.nonzero().reshape(-1), torch.tensor([B * T])])
        return Batch(input_ids, labels, cu_seqlens)

    def _epoch_order(self, epoch: int) -> Tensor:
        import torch

        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = torch.from_numpy(seeded_permutation(self.num_rows, self.seed, f"rows/{epoch}"))
        return self._perms[epoch]

    def _visit(self, start: int, count: int) -> Tensor:
        """Stream-order rows at global visit positions start .. start+count-1."""
        import torch

        g = torch.arange(start, start + count)
        epochs, within = g // self.num_rows, g % self.num_rows
        rows = torch.empty(count, dtype=torch.long)
        for e in epochs.unique().tolist():
            sel = epochs == e
            rows[sel] = self._epoch_order(e)[within[sel]]
        return rows

    def batch(self, step_index: int, batch_size: int) -> Batch:
        """Batch ``step_index`` of the seeded visit order: a pure function of (seed, step_index, batch_size)."""
        for what, v, low in (("step_index", step_index, 0), ("batch_size", batch_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{what}={v!r} must be an int >= {low}")
        return self.rows_batch(self._visit(step_index * batch_size, batch_size))

    def next_batch(self, batch_size: int) -> Batch:
        """The next ``batch_size`` rows of the visit order from :attr:`position`, which then moves past them."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
        start = self.position.epoch * self.num_rows + self.position.next_row
        out = self.rows_batch(self._visit(start, batch_size))
        end = start + batch_size
        self.position = DataPosition(epoch=end // self.num_rows, next_row=end % self.num_rows)
        return out

    def validation_batches(self, batch_size: int) -> Iterator[Batch]:
        """Every row once, in stream order, ``batch_size`` rows per batch (the last may be smaller)."""
        import torch

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
        for start in range(0, self.num_rows, batch_size):
            yield self.rows_batch(torch.arange(start, min(start + batch_size, self.num_rows)))

    def state_dict(self) -> dict[str, int]:
        """The data position plus what identifies the packed stream (plain ints)."""
        return {
            "epoch": self.position.epoch,
            "next_row": self.position.next_row,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_rows": self.num_rows,
            "num_tokens": int(self.tokens.numel()),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position saved by :meth:`state_dict`; the stream must be the same one (same documents,
        tokenizer, seq_len, seed and max_tokens), else the resumed batches would differ: ValueError."""
        mine = self.state_dict()
        missing = [k for k in mine if k not in state]
        if missing:
            raise ValueError(f"data state lacks {', '.join(missing)}")
        for k in ("seed", "seq_len", "num_rows", "num_tokens"):
            if int(state[k]) != mine[k]:
                raise ValueError(f"data state is for a different stream: {k}={state[k]} here {mine[k]}")
        epoch, next_row = int(state["epoch"]), int(state["next_row"])
        if epoch < 0 or not 0 <= next_row < self.num_rows:
            raise ValueError(f"data state position epoch={epoch}, next_row={next_row} is out of range")
        self.position = DataPosition(epoch=epoch, next_row=next_row)
