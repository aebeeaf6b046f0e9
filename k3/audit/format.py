"""Text formatting shared by ``k3 info`` and ``k3 audit``: human-readable counts and bytes, markdown tables."""

from __future__ import annotations

from collections.abc import Sequence


def human(n: float, unit: str = "") -> str:
    """1.23T / 4.56B / 7.89M / 1.00K style (decimal prefixes), with an optional unit suffix."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def human_bytes(n: float) -> str:
    """Binary prefixes: 1.50 GiB, 27.00 KiB, 512 B."""
    for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f} B"


def tokens(n: float) -> str:
    """Context lengths: 4K, 128K, 1M (binary: 4096 -> 4K), anything else as a plain number."""
    n = int(n)
    for scale, suffix in ((2**20, "M"), (2**10, "K")):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{suffix}"
    return f"{n:,}"


def pct(x: float, digits: int = 2) -> str:
    return f"{100 * x:.{digits}f}%"


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A markdown table; ``align`` is one character per column ('l' or 'r', default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
