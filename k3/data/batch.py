"""What a training batch is: token rows, their labels and the segments that keep documents apart.

Every dataset (packed text, k3.data.packing; chat, k3.data.sft; the vision-language task, k3.data.vision)
yields a :class:`Batch`, and the training step reads it; :data:`IGNORE_INDEX` marks a label that takes no loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the data modules load without torch (k3 --help)
    from torch import Tensor

    from k3.ops.segments import Segments

IGNORE_INDEX = -100


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
