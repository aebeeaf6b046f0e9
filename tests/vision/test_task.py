"""Synthetic vision-language task: determinism, split separation, answer coverage, image geometry, scoring."""

import numpy as np
import pytest
from PIL import Image

from k3.vision.task import (
    ANSWERS,
    QUESTION_TYPES,
    SIDES,
    WORDS,
    Example,
    chance_accuracy,
    make_example,
    score,
    task_texts,
)


def test_deterministic():
    for index in range(12):
        a, b = make_example(index, "validation", seed=3), make_example(index, "validation", seed=3)
        assert a.image.tobytes() == b.image.tobytes() and a.image.size == b.image.size
        assert (a.question, a.answer, a.qtype) == (b.question, b.answer, b.qtype)
    assert make_example(5, seed=0).image.tobytes() != make_example(5, seed=1).image.tobytes()


def test_splits_are_disjoint():
    train = {make_example(i, "train").image.tobytes() for i in range(100)}
    validation = {make_example(i, "validation").image.tobytes() for i in range(100)}
    assert len(train) == 100 and len(validation) == 100  # no repeats within a split either
    assert not train & validation


def test_answers_cover_answer_space_and_images_are_well_formed():
    seen = {q: set() for q in QUESTION_TYPES}
    for index in range(400):
        ex = make_example(index)
        assert ex.qtype == QUESTION_TYPES[index % 4]
        assert ex.answer in ANSWERS[ex.qtype] and ex.question in task_texts() and ex.answer in task_texts()
        assert ex.image.mode == "RGB" and ex.image.width in SIDES and ex.image.height in SIDES
        assert ex.image.width % 28 == 0 and ex.image.height % 28 == 0
        seen[ex.qtype].add(ex.answer)
    assert seen == {q: set(a) for q, a in ANSWERS.items()}
    sizes = {make_example(i).image.size for i in range(200)}
    assert len({w / h for w, h in sizes}) > 1  # varied aspect ratios


def test_fixed_qtype_and_answer_sets():
    for qtype in QUESTION_TYPES:
        assert all(make_example(i, qtype=qtype).qtype == qtype for i in range(8))
        assert chance_accuracy(qtype) == pytest.approx(1 / len(ANSWERS[qtype]))
    answers = [a for q in QUESTION_TYPES for a in ANSWERS[q]]
    assert len(answers) == len(set(answers))  # answer sets of different types are disjoint


def _ink(image: Image.Image) -> np.ndarray:
    """Pixels differing from the (uniform grey) background colour at the top-left corner."""
    pixels = np.asarray(image).astype(int)
    return np.abs(pixels - pixels[0, 0]).sum(-1) > 0


def test_rendered_content_is_visible():
    for index in range(40):
        ex = make_example(index, qtype="text")
        ink = _ink(ex.image)
        assert ink.sum() > 20, ex  # the word changed pixels
        assert not (ink[0].any() or ink[-1].any() or ink[:, 0].any() or ink[:, -1].any())  # inside the image
        dark = np.asarray(ex.image).max(-1) < 100
        assert dark.sum() > 10  # black strokes, not only antialiasing
    for index in range(40):
        ex = make_example(index, qtype="position")
        ys, xs = np.nonzero(_ink(ex.image))
        w, h = ex.image.size
        vertical, horizontal = ex.answer.split()
        assert (ys < h // 2).all() if vertical == "top" else (ys >= h // 2).all()
        assert (xs < w // 2).all() if horizontal == "left" else (xs >= w // 2).all()
        assert len(ys) >= 100  # radius >= 8 px


def test_colour_answer_matches_pixels():
    targets = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 225), "yellow": (240, 205, 20)}
    for index in range(20):
        ex = make_example(index, qtype="colour")
        pixels = np.asarray(ex.image).reshape(-1, 3)
        assert (pixels == targets[ex.answer]).all(-1).sum() >= 100


def test_bad_arguments_raise():
    for kwargs in (
        {"index": -1},
        {"index": 1.0},
        {"index": True},
        {"index": 0, "split": "test"},
        {"index": 0, "seed": "0"},
        {"index": 0, "qtype": "size"},
    ):
        with pytest.raises(ValueError):
            make_example(**kwargs)
    with pytest.raises(ValueError):
        chance_accuracy("nope")
    with pytest.raises(ValueError):
        score(["one"], [])


def test_score():
    blank = Image.new("RGB", (56, 56), "white")
    examples = [
        Example(blank, "q", "two", "count"),
        Example(blank, "q", "three", "count"),
        Example(blank, "q", "top left", "position"),
        Example(blank, "q", WORDS[0], "text"),
    ]
    result = score(["  Two ", "four", "top left\n", WORDS[1]], examples)
    assert result == {"count": 0.5, "position": 1.0, "text": 0.0, "all": 0.5}
