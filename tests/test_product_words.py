"""The tracked files describe the product, not how it was developed: no file is named after a development round
(``benchmarks/results/`` holds one current result per benchmark, its history is in git), and no text refers to
numbered work sessions or rounds, to remote-run mechanics, or to files named that way. Each offender is reported
as path:line. Skipped where git (or the clone) is not available."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A round-numbered file name: a name ending in "-s" or "_s", two digits and .md / .json / .txt.
ROUND_NAME = re.compile(r"[-_]s\d\d\.(?:md|json|txt)\b", re.IGNORECASE)

# Development-history wording. A pytest fixture's scope="session" or an HTTP session is not matched: every pattern
# needs a number after the word or a word that only the development sense takes.
HISTORY = [
    re.compile(r"\bsessions?\s+\d", re.IGNORECASE),  # the word, then a number
    re.compile(r"\bsession[-\s]\d", re.IGNORECASE),  # hyphenated to a number
    re.compile(r"\(session\s*\d", re.IGNORECASE),
    re.compile(
        r"\b(?:this|that|same|previous|earlier|later|next|each|every)\s+sessions?\b"
        r"(?!\s*(?:cookie|id|token|key|object|pool|scope))",
        re.IGNORECASE,
    ),
    re.compile(r"\bsession(?:'s|-to-session)\b", re.IGNORECASE),
    # a numbered round, not a duration
    re.compile(r"\bround\s+\d+\b(?!\s*(?:ms|us|s\b|steps?|tokens?))", re.IGNORECASE),
    re.compile(r"\bdevice\s+calls?\b", re.IGNORECASE),
    re.compile(r"\bgoals?\s+of\s+the\s+issue\b", re.IGNORECASE),
    re.compile(r"\bfiles\s+come\s+back\b", re.IGNORECASE),
    ROUND_NAME,
]


def _tracked() -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if res.returncode != 0:
        pytest.skip("not a git clone")
    return [p for p in res.stdout.decode("utf-8", "replace").split("\0") if p]


def _text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:  # listed by git but absent from the work tree (deleted, not yet committed)
        return None
    if b"\0" in data[:8192]:
        return None  # binary
    return data.decode("utf-8", "replace")


def test_no_file_is_named_after_a_round():
    bad = [p for p in _tracked() if ROUND_NAME.search(Path(p).name)]
    assert not bad, "files named after a development round:\n" + "\n".join(bad)


def test_no_text_speaks_of_development_history():
    bad = []
    for rel in _tracked():
        text = _text(ROOT / rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for pat in HISTORY:
                m = pat.search(line)
                if m:
                    bad.append(f"{rel}:{n}: {m.group(0)!r}: {line.strip()[:160]}")
                    break
    assert not bad, "development-history wording (describe the product and its measurements instead):\n" + "\n".join(
        bad
    )
