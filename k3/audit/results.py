"""The benchmark results ``k3 audit`` reads: ``benchmarks/results`` under the working directory, where ``k3 bench``
and the benchmark scripts write them (k3.bench.common.write_results); run the audit from a checkout or from a
directory that holds them. Nothing is read from where the package is installed."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path("benchmarks") / "results"


def read_results(path: Path) -> tuple[dict | None, str | None]:
    """(a results file as k3.bench.common.write_results wrote it, None) or (None, why it could not be read)."""
    if not path.is_file():
        return None, "not found"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return None, f"unreadable ({type(e).__name__})"
    if not isinstance(raw, dict) or not isinstance(raw.get("rows", []), list):
        return None, "not a results file (no rows list)"
    return raw, None
