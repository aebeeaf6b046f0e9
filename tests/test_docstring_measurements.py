"""Library docstrings and comments say what the code does and why; measurements live in benchmarks/results/ and
docs/decisions.md. A docstring or comment block in k3/ that names a GPU model together with a time or a rate tells a
measurement story and fails (k3/plan and k3/bench are excepted: their constants and reports are measurements). Every
``docs/decisions.md, "TITLE"`` a docstring or comment cites must start a heading of that file. Offenders are reported
as path:line."""

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXEMPT = ("k3/plan/", "k3/bench/")

# GPU models by name (not architectures: "Hopper" or sm_90a say what a kernel is compiled for).
GPU = re.compile(
    r"\b(?:[AHB]100|[AH]800|H200|H20|GH200|GB200|B200|A10G?|A30|A40|L4|L40S?|T4|V100|MI[23]\d\dX?|RTX\s?\d{4})\b"
)
# A number with a time unit (4.5 ms, ~5 us, 11.6-18.5 us), a rate (4.2 TB/s, 150 tokens/s), or the unit's name.
_NUM = r"(?<![\w.])\d+(?:\.\d+)?(?:\s?(?:-|to)\s?\d+(?:\.\d+)?)?\s?"
TIME = re.compile(
    _NUM + r"(?:ns|us|µs|ms|s|sec|seconds?|minutes?)\b"
    r"|" + _NUM + r"(?:[KMGTP]i?B|[KMGTP]?FLOP|tok(?:en)?s)/s\b"
    r"|\b(?:nano|micro|milli)seconds?\b",
)
CITE = re.compile(r'docs/decisions\.md, "([^"]+)"')


@functools.cache
def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each docstring (module, class, function) and each block of consecutive comment lines,
    whitespace collapsed so that text wrapped over lines reads as one."""
    source = path.read_text(encoding="utf-8")
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    out.append((first.lineno, " ".join(first.value.value.split())))
    block: list[str] = []
    start = last = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if block and line != last + 1:
            out.append((start, " ".join(" ".join(block).split())))
            block = []
        if not block:
            start = line
        block.append(tok.string.lstrip("#"))
        last = line
    if block:
        out.append((start, " ".join(" ".join(block).split())))
    return out


def _library() -> list[Path]:
    return sorted(p for p in (ROOT / "k3").rglob("*.py") if not p.relative_to(ROOT).as_posix().startswith(EXEMPT))


def measurement_stories(path: Path, root: Path = ROOT) -> list[str]:
    rel = path.relative_to(root).as_posix()
    bad = []
    for line, text in sorted(_texts(path)):
        gpu, time = GPU.search(text), TIME.search(text)
        if gpu and time:
            bad.append(f"{rel}:{line}: {gpu.group(0)!r} with {time.group(0)!r}")
    return bad


def test_detector_flags_a_measurement_story_and_passes_a_rule(tmp_path):
    story = tmp_path / "story.py"
    story.write_text(
        '"""One warp: on an H200 at B=64\n10.1 us with one warp, 14.4 with four."""\n\n'
        "# at B=1 / 4K on an H200 it cut the step\n# from 1.65 to 1.40 ms\nX = 1\n\n"
        'def f():\n    """Reads its latents at 4.47 TB/s on one H100."""\n'
    )
    assert [b.split(":")[1] for b in measurement_stories(story, tmp_path)] == ["1", "4", "9"]
    rule = tmp_path / "rule.py"
    rule.write_text(
        '"""One warp at 4 or more programs an SM, else 4 (docs/decisions.md, "KDA decode").\n\n'
        'Compiled for Hopper (sm_90a); the H200 holds 141 GB; B=64 rows of 4.5 GB each."""\n'
        "# 8 H200 nodes\n\n# a 2 s timeout (a comment block apart from the one above)\n"
        'X = f"{t:.1f} ms on an H100"  # strings are not docstrings\n'
    )
    assert measurement_stories(rule, tmp_path) == []


def test_library_docstrings_tell_no_measurement_stories():
    bad = [b for p in _library() for b in measurement_stories(p)]
    assert not bad, (
        "a docstring or comment names a GPU and a timing: state the rule and why, and point to the evidence "
        "(benchmarks/results/*.md or a docs/decisions.md record by name):\n" + "\n".join(bad)
    )


def test_cited_decision_records_exist():
    headings = [
        " ".join(line.lstrip("#").split())
        for line in (ROOT / "docs" / "decisions.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("## ") or line.startswith("### ")
    ]
    bad = []
    for path in sorted((ROOT / "k3").rglob("*.py")):
        for line, text in _texts(path):
            rel = path.relative_to(ROOT).as_posix()
            if "docs/decisions.md, '" in text:  # titles hold apostrophes: quote them with double quotes
                bad.append(f"{rel}:{line}: a title in single quotes")
            for title in CITE.findall(text):
                if not any(h.startswith(title) for h in headings):
                    bad.append(f"{rel}:{line}: {title!r}")
    assert not bad, "cite a docs/decisions.md heading by its title (or the title's start), in double quotes:\n" + (
        "\n".join(bad)
    )
