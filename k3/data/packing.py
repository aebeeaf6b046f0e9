"""Documents packed into fixed-length rows of one token stream (:class:`PackedDataset`), visited in a seeded,
resumable order: what ``k3 train`` reads.

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

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from k3.data.batch import IGNORE_INDEX, Batch
from k3.data.documents import Document, _check_max
from k3.data.shuffle import seeded_permutation

if TYPE_CHECKING:  # torch is imported where a dataset is built, so the corpus specs load without it (k3 --help)
    from torch import Tensor


def stream_tokens(steps: int, rows_per_step: int, seq_len: int) -> int:
    """Tokens of the packed stream for ``steps`` steps of ``rows_per_step`` rows of ``seq_len`` (row r is
    s[r T : r T + T + 1]), one row spare: what to tokenise (``max_tokens``) for a run that reads each token once."""
    return (steps * rows_per_step + 1) * seq_len + 1


class TokenizerLike(Protocol):
    """What packing needs: ``encode`` (``encode_batch`` is used when present) and the EOS id."""

    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...


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
