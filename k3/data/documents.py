"""Documents and their train/validation split: what every source of training text yields, and the one rule that
decides which documents are held out.

A :class:`Document` is a name and a text. The built-in corpora (k3.data.corpus), user data (k3.data.files) and
chat data (k3.data.sft) all produce documents and split them with :func:`split_documents`, so the rule is the
same wherever the text comes from.

Split
    Train/validation is decided per document by a stable hash of its name (sha1, ~2% validation), so it never
    depends on file order, the machine or the Python hash seed; a corpus of >= 2 documents always gets at least
    one document in each split. ``k3 train`` evaluates on the first rows of the validation documents packed in an
    order shuffled with a fixed seed (k3.train.trainer.VALIDATION_SEED).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

VALIDATION_FRACTION = 0.02
SPLITS = ("train", "validation", "all")


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
