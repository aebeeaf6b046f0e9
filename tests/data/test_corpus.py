"""Data: the stdlib corpus and its split, the loaders and their errors, packing semantics, resume."""

import json

import pytest
import torch

from k3.data.packing import (
    IGNORE_INDEX,
    Document,
    PackedDataset,
    load_corpus,
    load_documents,
    seeded_permutation,
    split_documents,
    stdlib_corpus,
    stream_tokens,
)


class CharTokenizer:
    """One token per character (ids 1..), EOS = 0: makes packing checks readable."""

    eos_id = 0

    def encode(self, text):
        return [ord(c) - ord("a") + 1 for c in text]


def toy_docs(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 25, (n,), generator=g).tolist()
    return [Document(f"doc{i}", "".join(chr(ord("a") + (i + j) % 26) for j in range(k))) for i, k in enumerate(lengths)]


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
    from k3.data.packing import MIXTURE, pydoc_topics_corpus

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
    from k3.data.packing import Document, tokenizer_texts

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

    from k3.data.packing import PACKAGE_SUFFIXES, corpus_parts, describe_corpus, packages_corpus, pydoc_topics_corpus

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


# ----------------------------------------------------------------------------------------------- packing


def stream_of(docs, seed):
    """The expected stream: documents in the seeded order, each followed by EOS."""
    tok = CharTokenizer()
    out = []
    for i in seeded_permutation(len(docs), seed, "documents"):
        out += tok.encode(docs[i].text) + [tok.eos_id]
    return torch.tensor(out)


def check_batch(batch, T, eos):
    ids, labels, cu = batch.input_ids, batch.labels, batch.cu_seqlens
    B = ids.shape[0]
    assert ids.dtype == labels.dtype == cu.dtype == torch.int64 and labels.shape == ids.shape == (B, T)
    assert cu[0] == 0 and cu[-1] == B * T and (cu[1:] > cu[:-1]).all()
    flat = ids.reshape(-1)
    expected = {0} | {b * T for b in range(B)} | {p + 1 for p in (flat == eos).nonzero().reshape(-1).tolist()}
    expected.add(B * T)
    assert set(cu.tolist()) == expected
    assert (labels[ids == eos] == IGNORE_INDEX).all() and (labels[ids != eos] != IGNORE_INDEX).all()


@pytest.mark.parametrize("T", [1, 7, 16])
def test_packing_semantics(T):
    docs = toy_docs()
    ds = PackedDataset(docs, CharTokenizer(), seq_len=T, seed=3)
    stream = stream_of(docs, 3)
    assert torch.equal(ds.tokens.long(), stream)
    assert ds.num_rows == (len(stream) - 1) // T and ds.num_documents == len(docs)
    assert ds.bytes_per_token == 1.0
    rows = [ds.row_tokens(r) for r in range(ds.num_rows)]
    assert all(r.numel() == T + 1 for r in rows)
    assert torch.equal(torch.cat([r[:-1] for r in rows]), stream[: ds.num_rows * T])  # inputs tile the stream
    for batch in ds.validation_batches(5):
        check_batch(batch, T, 0)
        unmasked = batch.labels != IGNORE_INDEX
        assert torch.equal(batch.labels[:, :-1][unmasked[:, :-1]], batch.input_ids[:, 1:][unmasked[:, :-1]])
    full = torch.cat([b.input_ids for b in ds.validation_batches(4)])
    assert torch.equal(full.reshape(-1), stream[: ds.num_rows * T])
    labels = torch.cat([b.labels for b in ds.validation_batches(4)]).reshape(-1)
    shifted = stream[1 : ds.num_rows * T + 1]
    keep = stream[: ds.num_rows * T] != 0
    assert torch.equal(labels[keep], shifted[keep]) and (labels[~keep] == IGNORE_INDEX).all()


def test_docstring_example():
    class Fixed:
        eos_id = 9

        def encode(self, text):
            return [int(c) for c in text]

    docs = [Document("a", "123"), Document("b", "45"), Document("c", "67")]
    ds = PackedDataset(docs, Fixed(), seq_len=8, shuffle=False)
    b = ds.rows_batch([0])
    assert b.input_ids.tolist() == [[1, 2, 3, 9, 4, 5, 9, 6]]
    assert b.labels.tolist() == [[2, 3, 9, -100, 5, 9, -100, 7]]
    assert b.cu_seqlens.tolist() == [0, 4, 7, 8]


def test_batches_visit_every_row_each_epoch():
    ds = PackedDataset(toy_docs(), CharTokenizer(), seq_len=8, seed=1)
    R, B = ds.num_rows, 3
    seen = torch.cat([ds.batch(s, B).input_ids for s in range(-(-2 * R // B))])[: 2 * R]
    all_rows = torch.stack([ds.row_tokens(r)[:-1] for r in range(R)])

    def as_set(x):
        return sorted(map(tuple, x.tolist()))

    assert as_set(seen[:R]) == as_set(all_rows) and as_set(seen[R:]) == as_set(all_rows)
    assert not torch.equal(seen[:R], seen[R:])  # a new permutation each epoch
    assert not torch.equal(seen[:R], all_rows)  # shuffled
    for s in range(4):
        check_batch(ds.batch(s, B), 8, 0)
    other = PackedDataset(toy_docs(), CharTokenizer(), seq_len=8, seed=2)
    assert not torch.equal(other.tokens, ds.tokens)


def test_resume_is_exact():
    docs, tok = toy_docs(), CharTokenizer()
    a = PackedDataset(docs, tok, seq_len=8, seed=5)
    uninterrupted = [a.next_batch(4) for _ in range(20)]  # spans several epochs
    for k, batch in enumerate(uninterrupted):
        pure = a.batch(k, 4)
        assert torch.equal(pure.input_ids, batch.input_ids) and torch.equal(pure.cu_seqlens, batch.cu_seqlens)
    b = PackedDataset(docs, tok, seq_len=8, seed=5)
    for _ in range(7):
        b.next_batch(4)
    state = b.state_dict()
    assert all(type(v) is int for v in state.values())
    c = PackedDataset(docs, tok, seq_len=8, seed=5)
    c.load_state_dict(json.loads(json.dumps(state)))
    for k in range(7, 20):
        got = c.next_batch(4)
        assert torch.equal(got.input_ids, uninterrupted[k].input_ids)
        assert torch.equal(got.labels, uninterrupted[k].labels)
        assert torch.equal(got.cu_seqlens, uninterrupted[k].cu_seqlens)
    with pytest.raises(ValueError, match="different stream: seed=5 here 6"):
        PackedDataset(docs, tok, seq_len=8, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="data state lacks next_row"):
        c.load_state_dict({"epoch": 0})


def test_validation_batches_deterministic():
    docs, tok = toy_docs(), CharTokenizer()
    one = [b.input_ids for b in PackedDataset(docs, tok, seq_len=8, seed=0).validation_batches(3)]
    two = [b.input_ids for b in PackedDataset(docs, tok, seq_len=8, seed=0).validation_batches(3)]
    assert len(one) == len(two) and all(torch.equal(x, y) for x, y in zip(one, two))
    assert sum(x.shape[0] for x in one) == PackedDataset(docs, tok, seq_len=8).num_rows


def test_max_tokens_and_errors():
    docs, tok = toy_docs(), CharTokenizer()
    capped = PackedDataset(docs, tok, seq_len=4, max_tokens=50)
    assert 50 <= capped.tokens.numel() < 50 + 26 and capped.num_documents < len(docs)
    with pytest.raises(ValueError, match="fewer than one row of seq_len \\+ 1 = 101"):
        PackedDataset(docs[:1], tok, seq_len=100)
    with pytest.raises(ValueError, match="seq_len=0"):
        PackedDataset(docs, tok, seq_len=0)
    with pytest.raises(ValueError, match="needs an EOS id"):
        PackedDataset(docs, type("NoEos", (), {"eos_id": None, "encode": CharTokenizer.encode})(), seq_len=4)
    with pytest.raises(ValueError, match="at least one document"):
        PackedDataset([], tok, seq_len=4)
    with pytest.raises(ValueError, match="produced the EOS id 0 inside the text"):
        PackedDataset([Document("x", "a`b")], tok, seq_len=1)  # '`' encodes to 0
    with pytest.raises(ValueError, match="batch_size=0"):
        capped.batch(0, 0)


def test_stream_tokens_cover_the_rows_a_run_reads():
    """max_tokens = stream_tokens(steps, B, T) packs more than steps x B rows (one spare); packing stops after the
    document that reaches the cap, so at most one document (< 25 characters + EOS here) more."""
    docs, tok = toy_docs(200), CharTokenizer()
    for steps, b, t in ((3, 2, 4), (5, 1, 7), (1, 4, 16)):
        n = stream_tokens(steps, b, t)
        rows = PackedDataset(docs, tok, seq_len=t, max_tokens=n).num_rows
        assert steps * b < rows <= (n + 25 - 1) // t, (steps, b, t, rows)


def test_real_tokenizer_stdlib_packing():
    from k3.data.tokenizer import train_bpe

    docs = stdlib_corpus("train", max_docs=40)
    tok = train_bpe((d.text for d in docs), vocab_size=512)
    ds = PackedDataset(docs, tok, seq_len=64, seed=0, max_tokens=20_000)
    assert 20_000 <= ds.tokens.numel() and 1.5 < ds.bytes_per_token < 6
    check_batch(ds.batch(0, 4), 64, tok.eos_id)
    text = tok.decode(ds.tokens[: ds.tokens.tolist().index(tok.eos_id)].tolist())
    assert text in {d.text for d in docs}
