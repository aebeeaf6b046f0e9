"""Media tokens: where image features enter the text (docs/architecture.md#vision).

A prompt carries one placeholder token (``<|media_pad|>``, ``VisionConfig.media_placeholder_token_id``) per
image. Before the LM runs, each placeholder becomes

    begin_id, placeholder_id x n_i, end_id

where n_i = (h_i / merge) * (w_i / merge) is the number of merged tokens of image i (patch grid h_i x w_i), and
the n_i placeholder copies are the positions whose embeddings the vision tower's output replaces, image after
image in the order the placeholders appear.
"""

from __future__ import annotations

from collections.abc import Sequence


def merged_tokens(grid_hw: Sequence[int], merge: int) -> int:
    """Number of LM tokens of one image: patch grid (h, w) -> (h / merge) * (w / merge)."""
    h, w = (int(v) for v in grid_hw)
    if merge <= 0:
        raise ValueError(f"merge={merge} must be positive")
    if h <= 0 or w <= 0 or h % merge or w % merge:
        raise ValueError(f"patch grid ({h}, {w}) must be positive multiples of merge={merge}")
    return (h // merge) * (w // merge)


def expand_placeholders(
    token_ids: Sequence[int],
    tokens_per_image: Sequence[int],
    placeholder_id: int,
    begin_id: int | None,
    end_id: int | None,
) -> tuple[list[int], list[int]]:
    """Expand each media placeholder into ``begin + n x placeholder + end`` (no wrapping when both are None).

    token_ids: the prompt, holding exactly one ``placeholder_id`` per image; tokens_per_image [num_images]:
    n_i for each image in placeholder order (see :func:`merged_tokens`). Returns (expanded ids, positions),
    positions [sum n_i] being the indices into the expanded ids of the image tokens, image after image.
    Raises one ValueError when the placeholder and image counts differ, naming both.
    """
    if (begin_id is None) != (end_id is None):
        raise ValueError(f"begin_id={begin_id} and end_id={end_id}: give both or neither")
    wrap = begin_id is not None
    if wrap and len({placeholder_id, begin_id, end_id}) != 3:
        raise ValueError(f"placeholder_id={placeholder_id}, begin_id={begin_id} and end_id={end_id} must differ")
    counts = [int(n) for n in tokens_per_image]
    if any(n <= 0 for n in counts):
        raise ValueError(f"tokens_per_image={counts} must all be positive")
    found = sum(1 for t in token_ids if t == placeholder_id)
    if found != len(counts):
        raise ValueError(
            f"the prompt has {found} media placeholder token(s) (id {placeholder_id}) "
            f"but {len(counts)} image(s) were given"
        )
    expanded: list[int] = []
    positions: list[int] = []
    image = 0
    for t in token_ids:
        if t != placeholder_id:
            expanded.append(int(t))
            continue
        if wrap:
            expanded.append(begin_id)
        start = len(expanded)
        expanded.extend([placeholder_id] * counts[image])
        positions.extend(range(start, start + counts[image]))
        if wrap:
            expanded.append(end_id)
        image += 1
    return expanded, positions
