"""The built-in training corpora and corpus specs (``k3 train --data SPEC``): text that ships with Python or with
installed packages, so training works with no download.

:func:`stdlib_corpus` gives the default corpus (the Python standard library's own ``.py`` files);
``--data stdlib+pydoc-topics`` (:data:`MIXTURE`) adds natural-language text shipped with Python, the help topics
of ``pydoc_data.topics`` (~465 KB of English prose, split on their own so both kinds are in validation);
``packages:NAME==VERSION,...`` the text files of installed distributions (:func:`packages_corpus`; parts join with
``+``). :func:`load_corpus` reads a spec, or falls back to user data (k3.data.files.load_documents) for a path;
:func:`pin_corpus` and :func:`describe_corpus` name a corpus exactly for a run's record and report;
:func:`tokenizer_texts` samples a corpus for training a tokenizer.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

from k3.data.documents import Document, _check_max, _check_split, split_documents
from k3.data.files import _walk, load_documents
from k3.data.shuffle import seeded_permutation

# Directories of the stdlib that are not the library itself (tests, the IDE, the retired 2to3, installed packages).
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


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
