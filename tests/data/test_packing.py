"""Packing: the token stream and its rows, segments and labels, the seeded visit order, resume."""

import json

import pytest
import torch

from k3.data.batch import IGNORE_INDEX
from k3.data.corpus import stdlib_corpus
from k3.data.documents import Document
from k3.data.packing import PackedDataset, stream_tokens
from k3.data.shuffle import seeded_permutation


class CharTokenizer:
    """One token per character (ids 1..), EOS = 0: makes packing checks readable."""

    eos_id = 0

    def encode(self, text):
        return [ord(c) - ord("a") + 1 for c in text]


def toy_docs(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 25, (n,), generator=g).tolist()
    return [Document(f"doc{i}", "".join(chr(ord("a") + (i + j) % 26) for j in range(k))) for i, k in enumerate(lengths)]


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
