"""Markdown tables of result rows: the one writer the benchmarks' results files and the placement report use."""

from __future__ import annotations


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of ``rows`` under ``columns``: floats to 3 significant digits (thousands separated from
    10^4), booleans as yes / no, missing values and None as empty cells."""

    def fmt(v):
        if v is None:
            return ""
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
