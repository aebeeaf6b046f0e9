"""User data as documents: a text file, a directory, ``.jsonl`` or ``.parquet`` (``k3 train --data PATH``).

Kept apart from the built-in corpora (k3.data.corpus) because it is where a user's own files are read and
checked: every malformed input (bad UTF-8, a bad JSON line, a parquet file without a string ``text`` column)
stops with one ValueError naming the file (and line).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from k3.data.documents import Document, _check_split, split_documents

TEXT_SUFFIXES = (".txt", ".md", ".py")
DATA_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")


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
