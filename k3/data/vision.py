"""Data for ``k3 train --task vision``: the embedded vision-language task (k3.vision.task) as packed batches.

One example is one segment of the packed row:

    <|media_begin|> <|media_pad|> x n <|media_end|>  " question"  " answer" <|endoftext|>

n = the image's merged tokens. Only the answer tokens and the EOS are predicted (labels elsewhere are -100), so
the loss is the answer's cross-entropy; the image embeddings replace the n placeholder rows (see
k3.model.multimodal). A batch of B examples is one row of their concatenation with ``cu_seqlens`` at the example
boundaries, plus every image's patches packed into one sequence for the tower. Examples are generated from
(seed, split, index): the training stream continues at ``next_index`` (saved in checkpoints); validation is
the first ``rows`` indices of the held-out split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3.config import VisionConfig
from k3.data.batch import IGNORE_INDEX
from k3.data.tokenizer import DEFAULT_SPECIAL_TOKENS, Tokenizer, train_bpe
from k3.vision.media import expand_placeholders, merged_tokens
from k3.vision.processor import ImageProcessor
from k3.vision.task import Example, make_example, task_texts

MEDIA_TOKENS = ("<|media_begin|>", "<|media_pad|>", "<|media_end|>")


def task_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """A byte-level BPE over every question and answer of the task, with the media special tokens."""
    texts = [" " + t for t in task_texts()] * 4
    return train_bpe(
        texts, min(vocab_size, 4096), special_tokens=DEFAULT_SPECIAL_TOKENS + MEDIA_TOKENS, min_frequency=1
    )


def media_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The vision config fields naming the tokenizer's media tokens (one ValueError if it lacks them)."""
    ids = [tokenizer.hf.token_to_id(t) for t in MEDIA_TOKENS]
    missing = [t for t, i in zip(MEDIA_TOKENS, ids) if i is None]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)} token(s): the vision task needs them")
    begin, pad, end = ids
    return {
        "vision.media_begin_token_id": begin,
        "vision.media_placeholder_token_id": pad,
        "vision.media_end_token_id": end,
    }


@dataclass
class VisionBatch:
    input_ids: Tensor  # [1, T] packed examples
    labels: Tensor  # [1, T] next token at answer positions, -100 elsewhere
    cu_seqlens: Tensor  # [B+1]
    pixel_patches: Tensor  # [N, 3*p*p] every image of the batch, packed
    grid_hws: Tensor  # [B, 2]


class VisionTaskData:
    """``next_batch(B)`` / ``rows_batch(indices)`` / ``state_dict()`` like k3.data.packing.PackedDataset."""

    def __init__(
        self, tokenizer: Tokenizer, vision: VisionConfig, split: str = "train", seed: int = 0, rows: int | None = None
    ):
        self.tokenizer, self.vision, self.split, self.seed = tokenizer, vision, split, seed
        self.processor = ImageProcessor.from_config(vision)
        self.num_rows = rows if rows is not None else 1 << 62
        self.next_index = 0
        answers = [make_example(i, split, seed) for i in range(64)]
        chars = sum(len((" " + e.answer).encode()) + 1 for e in answers)
        toks = sum(len(tokenizer.encode(" " + e.answer)) + 1 for e in answers)
        self.bytes_per_token = chars / toks  # of the predicted (answer + EOS) tokens

    def __repr__(self) -> str:
        return f"VisionTaskData(split={self.split}, seed={self.seed}, next_index={self.next_index})"

    def example(self, index: int) -> Example:
        return make_example(index, self.split, self.seed)

    def prompt(self, example: Example, grid_hw: tuple[int, int]) -> list[int]:
        """Token ids of the image + question (what generation is prompted with)."""
        v = self.vision
        ids = [v.media_placeholder_token_id] + self.tokenizer.encode(" " + example.question)
        return expand_placeholders(
            ids,
            [merged_tokens(grid_hw, v.merge_size)],
            v.media_placeholder_token_id,
            v.media_begin_token_id,
            v.media_end_token_id,
        )[0]

    def rows_batch(self, indices) -> VisionBatch:
        examples = [self.example(int(i)) for i in indices]
        patches, grids = self.processor.process([e.image for e in examples])
        ids, labels, cu = [], [], [0]
        for e, hw in zip(examples, grids.tolist()):
            prompt = self.prompt(e, tuple(hw))
            answer = self.tokenizer.encode(" " + e.answer) + [self.tokenizer.eos_id]
            seq = prompt + answer
            ids += seq
            # position t predicts seq[t + 1]: label the positions whose next token is part of the answer
            labels += [IGNORE_INDEX] * (len(prompt) - 1) + answer + [IGNORE_INDEX]
            cu.append(len(ids))
        return VisionBatch(torch.tensor([ids]), torch.tensor([labels]), torch.tensor(cu), patches, grids)

    def next_batch(self, batch_size: int) -> VisionBatch:
        batch = self.rows_batch(range(self.next_index, self.next_index + batch_size))
        self.next_index += batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_index = int(state["next_index"])
