"""Documents and corpora: the stdlib corpus and its split, the built-in specs, the user-data loaders and their
errors."""

import pytest

from k3.data.corpus import load_corpus, stdlib_corpus
from k3.data.documents import Document, split_documents
from k3.data.files import load_documents


# ----------------------------------------------------------------------------------------------- corpus, split


def test_stdlib_corpus_split():
    train, val = stdlib_corpus("train"), stdlib_corpus("validation")
    assert len(train) > 100 and len(val) >= 1
    names_t, names_v = {d.name for d in train}, {d.name for d in val}
    assert not names_t & names_v
    assert [d.name for d in train] == sorted(names_t)
    assert all(d.text.strip() for d in train)
    assert not any(part in {"test", "tests", "idlelib", "site-packages"} for d in train for part in d.name.split("/"))
    assert [d.name for d in stdlib_corpus("train")] == [d.name for d in train]  # deterministic
    assert stdlib_corpus("train", max_docs=5) == train[:5]
    assert len(stdlib_corpus("all")) == len(train) + len(val)
    with pytest.raises(ValueError, match="split='dev' must be one of"):
        stdlib_corpus("dev")
    with pytest.raises(ValueError, match="max_docs=0"):
        stdlib_corpus("train", max_docs=0)


def test_code_and_prose_mixture():
    """stdlib+pydoc-topics: the stdlib sources and Python's help topics, each split on its own, so validation holds
    code and English prose."""
    from k3.data.corpus import MIXTURE, pydoc_topics_corpus

    val, train = load_corpus(MIXTURE, "validation"), load_corpus(MIXTURE, "train")
    prose = [d for d in val if d.name.startswith("pydoc_data/topics/")]
    assert prose and len(prose) < len(val)
    assert not {d.name for d in val} & {d.name for d in train}
    topics = pydoc_topics_corpus("all")
    assert len(topics) > 50 and sum(len(d.text) for d in topics) > 300_000
    assert len(load_corpus(MIXTURE, "train")) == len(stdlib_corpus("train")) + len(pydoc_topics_corpus("train"))
    assert load_corpus(MIXTURE, "train", max_docs=3) == train[:3]


def test_tokenizer_texts_sample_the_whole_split():
    """A tokenizer's training sample: whole documents in a fixed shuffled order up to the budget, so a mixture's
    later part (here the prose, after every code document) is in it in about its share; all when they fit."""
    from k3.data.corpus import tokenizer_texts
    from k3.data.documents import Document

    docs = [Document(f"code{i}", "c" * 100) for i in range(300)] + [
        Document(f"prose{i}", "p" * 100) for i in range(100)
    ]
    texts = tokenizer_texts(docs, 4_000)
    assert len(texts) == 40 and texts == tokenizer_texts(docs, 4_000)  # 40 documents reach 4,000 characters
    assert 4 <= sum(t[0] == "p" for t in texts) <= 20  # a quarter of the documents are prose: 10 expected
    assert sorted(tokenizer_texts(docs, 10**9)) == sorted(d.text for d in docs)
    assert tokenizer_texts([], 100) == []


def test_packages_corpus():
    """packages:NAME[==VERSION]: an installed distribution's text files as documents named DIST/PATH (no metadata
    folder), split like any corpus, pins checked against the installed version; parts join with +."""
    import importlib.metadata as metadata

    from k3.data.corpus import corpus_parts, describe_corpus, PACKAGE_SUFFIXES, packages_corpus, pydoc_topics_corpus

    version = metadata.version("tqdm").split("+")[0]
    every = packages_corpus("tqdm", "all")
    assert len(every) >= 10 and all(d.name.startswith("tqdm/") for d in every)
    assert all(d.name.endswith(PACKAGE_SUFFIXES) and ".dist-info/" not in d.name for d in every)
    assert any(d.name == "tqdm/tqdm/std.py" and "class tqdm" in d.text for d in every)
    train, val = packages_corpus(f"tqdm=={version}", "train"), packages_corpus("tqdm", "validation")
    assert val and {d.name for d in train} | {d.name for d in val} == {d.name for d in every}
    assert not {d.name for d in train} & {d.name for d in val}
    mixed = load_corpus("pydoc-topics+packages:tqdm", "train")
    assert mixed == pydoc_topics_corpus("train") + train
    assert corpus_parts("stdlib+packages:tqdm,torch") == ["stdlib", "packages:tqdm,torch"]
    assert corpus_parts("stdlib+nonsense") is None and corpus_parts("packages:") is None
    assert "tqdm" in describe_corpus("stdlib+packages:tqdm") and "prose" in describe_corpus("pydoc-topics")
    with pytest.raises(ValueError, match="the corpus names 0.0.1"):
        packages_corpus("tqdm==0.0.1")
    with pytest.raises(ValueError, match="'no-such-dist' is not installed"):
        load_corpus("packages:no-such-dist", "train")


def test_corpus_spec_names_an_existing_path_first(tmp_path):
    """A directory whose name reads like a corpus spec is still read as a directory."""
    root = tmp_path / "stdlib+pydoc-topics"
    root.mkdir()
    for i in range(3):
        (root / f"f{i}.txt").write_text(f"text {i}")
    assert {d.name for d in load_corpus(root, "all")} == {"f0.txt", "f1.txt", "f2.txt"}
    assert {d.name for d in load_corpus(str(root), "all")} == {"f0.txt", "f1.txt", "f2.txt"}


def test_split_rule():
    docs = [Document(f"d{i}", "x") for i in range(1000)]
    val = split_documents(docs, "validation")
    train = split_documents(docs, "train")
    assert 5 <= len(val) <= 40 and len(val) + len(train) == 1000
    assert split_documents(list(reversed(docs)), "validation") == list(reversed(val))  # order-independent
    two = docs[:2]
    assert len(split_documents(two, "train")) == 1 and len(split_documents(two, "validation")) == 1
    assert split_documents(docs[:1], "validation") == [] and split_documents(docs[:1], "train") == docs[:1]


# ----------------------------------------------------------------------------------------------- loaders


def test_load_text_file_and_directory(tmp_path):
    (tmp_path / "one.txt").write_text("just one document")
    assert load_documents(tmp_path / "one.txt", "train") == [Document("one.txt", "just one document")]
    with pytest.raises(ValueError, match="the validation split is empty \\(1 document"):
        load_documents(tmp_path / "one.txt", "validation")

    root = tmp_path / "data"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "b.md").write_text("# markdown")
    (root / "a.txt").write_text("plain text")
    (root / "sub" / "c.py").write_text("print(1)\n")
    (root / "sub" / "deeper" / "d.jsonl").write_text('{"text": "j1"}\n\n{"text": "j2", "id": 3}\n')
    (root / "skip.csv").write_text("not,read")
    (root / "empty.txt").write_text("")
    (root / ".hidden" / "x.txt").write_text("hidden")
    docs = load_documents(root, "all")
    assert [d.name for d in docs] == ["a.txt", "b.md", "sub/c.py", "sub/deeper/d.jsonl:1", "sub/deeper/d.jsonl:3"]
    assert [d.text for d in docs] == ["plain text", "# markdown", "print(1)\n", "j1", "j2"]
    train, val = load_documents(root, "train"), load_documents(root, "validation")
    assert len(val) >= 1 and len(train) >= 1 and sorted(train + val, key=docs.index) == docs
    assert load_corpus(root, "all", max_docs=2) == docs[:2]


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no data at"):
        load_documents(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no documents"):
        load_documents(tmp_path / "empty")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_documents(bad, "all")
    bad.write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: expected a JSON object with a 'text' field"):
        load_documents(bad, "all")
    bad.write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'text' must be a string, got int"):
        load_documents(bad, "all")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"ok \xff\xfe")
    with pytest.raises(ValueError, match="bin.txt: not UTF-8 text"):
        load_documents(binary, "all")


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["first", None, "", "fourth"], "n": [1, 2, 3, 4]}), path)
    assert load_documents(path, "all") == [Document("d.parquet:0", "first"), Document("d.parquet:3", "fourth")]
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(ValueError, match=r"d.parquet: no 'text' column \(columns: body\)"):
        load_documents(path, "all")
    pq.write_table(pa.table({"text": [1, 2]}), path)
    with pytest.raises(ValueError, match="column 'text' must hold strings"):
        load_documents(path, "all")
    path.write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable parquet file"):
        load_documents(path, "all")
