"""A tiny synthetic vision-language task, rendered on the fly with Pillow.

Each example is a small RGB image on a plain light-grey background, a question about it and a one- or two-word
answer. It is meant for training a small multimodal model end to end on a CPU in minutes, so images are small and
every answer space is small:

================  ==============================  =============================================  ======
qtype             question                        answers                                        chance
================  ==============================  =============================================  ======
``count``         ``how many shapes ?``           one, two, three, four                          1/4
``colour``        ``what colour is the shape ?``  red, green, blue, yellow                       1/4
``position``      ``where is the shape ?``        top left, top right, bottom left, bottom right 1/4
``text``          ``what word is written ?``      cat, dog, sun, map, box, cup, pen, hat         1/8
================  ==============================  =============================================  ======

The answer sets of the four types are disjoint, so a prediction can be judged without knowing the question.

Images: width and height are each drawn from {56, 84, 112}, multiples of ``patch_size x merge_size = 28`` so the
image processor never resamples them, and their varied aspect ratios exercise native-resolution packing. Shapes are
circles, squares and upward triangles of "radius" (half the bounding-box side) >= 8 px, so each covers at least a
few 14-px patches; shapes in one image never overlap (their bounding boxes keep a gap). A ``count`` image holds 1-4
shapes of one kind and colour or of mixed kinds and colours; ``colour`` one shape in one of four saturated colours;
``position`` one shape lying wholly inside one quadrant, clear of the centre lines; ``text`` one black word drawn
with Pillow's built-in scalable font (``ImageFont.load_default(size)``, no font files) at 20, 24, 28 or 32 px
(the sizes that fit the image; letters must span several 14-px patches to be legible to the tower),
wholly inside the image. Each answer is drawn uniformly first and the image is rendered to match it.

Determinism: ``make_example(index, split, seed)`` seeds a ``random.Random`` from a SHA-256 digest of
``(seed, split, index)`` (not Python's salted ``hash``), so the same arguments give the same pixels and text in
every process, and "train" and "validation" are separate streams (their images coincide only by chance, which the
continuous positions, sizes and backgrounds make negligible). With ``qtype=None`` the type cycles with the index,
so any run of 4 consecutive indices holds one example of each type.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

QUESTION_TYPES = ("count", "colour", "position", "text")
SPLITS = ("train", "validation")
SIDES = (56, 84, 112)
FONT_SIZES = (20, 24, 28, 32)
SHAPES = ("circle", "square", "triangle")
MIN_RADIUS = 8
GAP = 3  # minimum pixels between the bounding boxes of two shapes
MARGIN = 2  # minimum pixels between a shape or word and the image border (or, for position, the centre lines)

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 225),
    "yellow": (240, 205, 20),
}
NUMBERS = ("one", "two", "three", "four")
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
WORDS = ("cat", "dog", "sun", "map", "box", "cup", "pen", "hat")

QUESTIONS: dict[str, str] = {
    "count": "how many shapes ?",
    "colour": "what colour is the shape ?",
    "position": "where is the shape ?",
    "text": "what word is written ?",
}
ANSWERS: dict[str, tuple[str, ...]] = {
    "count": NUMBERS,
    "colour": tuple(COLOURS),
    "position": QUADRANTS,
    "text": WORDS,
}


@dataclass
class Example:
    image: Image.Image
    question: str
    answer: str
    qtype: str


def chance_accuracy(qtype: str) -> float:
    """Accuracy of guessing uniformly among the answers of ``qtype`` (answers are drawn uniformly)."""
    if qtype not in ANSWERS:
        raise ValueError(f"qtype={qtype!r} must be one of {QUESTION_TYPES}")
    return 1.0 / len(ANSWERS[qtype])


def task_texts() -> list[str]:
    """Every question and answer string, e.g. to train a tiny tokenizer."""
    return [QUESTIONS[q] for q in QUESTION_TYPES] + [a for q in QUESTION_TYPES for a in ANSWERS[q]]


def _rng(seed: int, split: str, index: int) -> random.Random:
    digest = hashlib.sha256(f"k3.vision.task|{seed}|{split}|{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:16], "big"))


@lru_cache(maxsize=None)
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def _canvas(rng: random.Random) -> Image.Image:
    grey = rng.randint(225, 255)
    return Image.new("RGB", (rng.choice(SIDES), rng.choice(SIDES)), (grey, grey, grey))


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: int, cy: int, r: int, colour: tuple[int, int, int]) -> None:
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=colour)


def _centre_in(rng: random.Random, x0: int, y0: int, x1: int, y1: int, r: int) -> tuple[int, int]:
    """A random centre whose (2r+1)-px bounding box lies within [x0, x1] x [y0, y1] (inclusive pixel bounds)."""
    return rng.randint(x0 + r, x1 - r), rng.randint(y0 + r, y1 - r)


def _place(rng: random.Random, width: int, height: int, n: int, max_radius: int) -> list[tuple[int, int, int]]:
    """``n`` non-overlapping (cx, cy, r) inside the image: rejection sampling, a bounded number of tries per radius.

    If random placement keeps failing the radius is lowered; at MIN_RADIUS the fallback puts shape i centred in
    quadrant i, which never overlaps (a quadrant is >= 28 px > 2 * MIN_RADIUS + 1 + GAP).
    """
    for top in range(max_radius, MIN_RADIUS - 1, -1):
        placed: list[tuple[int, int, int]] = []
        for _ in range(100):
            r = rng.randint(MIN_RADIUS, top)
            cx, cy = _centre_in(rng, MARGIN, MARGIN, width - 1 - MARGIN, height - 1 - MARGIN, r)
            if all(abs(cx - px) > r + pr + GAP or abs(cy - py) > r + pr + GAP for px, py, pr in placed):
                placed.append((cx, cy, r))
                if len(placed) == n:
                    return placed
    cells = [
        (width // 4, height // 4),
        (3 * width // 4, height // 4),
        (width // 4, 3 * height // 4),
        (3 * width // 4, 3 * height // 4),
    ]
    return [(cx, cy, MIN_RADIUS) for cx, cy in cells[:n]]


def _shapes_image(rng: random.Random, n: int, colours: list[str] | None = None) -> Image.Image:
    image = _canvas(rng)
    width, height = image.size
    mixed = rng.random() < 0.5
    kinds = [rng.choice(SHAPES) for _ in range(n)] if mixed else [rng.choice(SHAPES)] * n
    if colours is None:
        colours = [rng.choice(tuple(COLOURS)) for _ in range(n)] if mixed else [rng.choice(tuple(COLOURS))] * n
    max_radius = max(MIN_RADIUS, min(width, height) // (4 if n > 1 else 3))
    draw = ImageDraw.Draw(image)
    for kind, colour, (cx, cy, r) in zip(kinds, colours, _place(rng, width, height, n, max_radius)):
        _draw_shape(draw, kind, cx, cy, r, COLOURS[colour])
    return image


def _position_image(rng: random.Random, quadrant: str) -> Image.Image:
    image = _canvas(rng)
    width, height = image.size
    # Inclusive pixel bounds of the quadrant, keeping MARGIN from the border and from the centre lines.
    top, left = quadrant.split()[0] == "top", quadrant.split()[1] == "left"
    x0, x1 = (MARGIN, width // 2 - 1 - MARGIN) if left else (width // 2 + MARGIN, width - 1 - MARGIN)
    y0, y1 = (MARGIN, height // 2 - 1 - MARGIN) if top else (height // 2 + MARGIN, height - 1 - MARGIN)
    r = rng.randint(MIN_RADIUS, max(MIN_RADIUS, min(x1 - x0, y1 - y0) // 2))
    cx, cy = _centre_in(rng, x0, y0, x1, y1, r)
    _draw_shape(ImageDraw.Draw(image), rng.choice(SHAPES), cx, cy, r, COLOURS[rng.choice(tuple(COLOURS))])
    return image


def _fits(box: tuple[int, int, int, int], width: int, height: int) -> bool:
    left, top, right, bottom = box
    return right - left <= width - 1 - 2 * MARGIN and bottom - top <= height - 1 - 2 * MARGIN


def _text_image(rng: random.Random, word: str) -> Image.Image:
    image = _canvas(rng)
    width, height = image.size
    fits = [s for s in FONT_SIZES if _fits(_font(s).getbbox(word), width, height)]
    font = _font(rng.choice(fits or FONT_SIZES[:1]))
    left, top, right, bottom = font.getbbox(word)  # ink box relative to the drawing origin
    x = rng.randint(MARGIN - left, width - 1 - MARGIN - right)
    y = rng.randint(MARGIN - top, height - 1 - MARGIN - bottom)
    ImageDraw.Draw(image).text((x, y), word, fill=(0, 0, 0), font=font)
    return image


def make_example(index: int, split: str = "train", seed: int = 0, qtype: str | None = None) -> Example:
    """Example ``index`` of ``split``; identical for identical (index, split, seed, qtype)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index={index!r} must be a non-negative integer")
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an integer")
    if qtype is not None and qtype not in QUESTION_TYPES:
        raise ValueError(f"qtype={qtype!r} must be None or one of {QUESTION_TYPES}")
    if qtype is None:
        qtype = QUESTION_TYPES[index % len(QUESTION_TYPES)]
    rng = _rng(seed, split, index)
    answer = rng.choice(ANSWERS[qtype])
    if qtype == "count":
        image = _shapes_image(rng, NUMBERS.index(answer) + 1)
    elif qtype == "colour":
        image = _shapes_image(rng, 1, colours=[answer])
    elif qtype == "position":
        image = _position_image(rng, answer)
    else:
        image = _text_image(rng, answer)
    return Example(image=image, question=QUESTIONS[qtype], answer=answer, qtype=qtype)


def score(predictions: list[str], examples: list[Example]) -> dict[str, float]:
    """Exact-match accuracy (after ``.strip().lower()``) per qtype present in ``examples``, plus "all"."""
    if len(predictions) != len(examples):
        raise ValueError(f"got {len(predictions)} predictions for {len(examples)} examples")
    if not examples:
        raise ValueError("score() needs at least one example")
    hits: dict[str, list[bool]] = {}
    for prediction, example in zip(predictions, examples):
        hits.setdefault(example.qtype, []).append(prediction.strip().lower() == example.answer.strip().lower())
    result = {q: sum(h) / len(h) for q, h in hits.items()}
    result["all"] = sum(sum(h) for h in hits.values()) / len(examples)
    return result
