"""The measured runs the placement report sets its predictions beside (``k3 plan --report``): per results file of
the benchmarks, its environment and the rows the comparison reads.

The package ships one (``calibration.json``, next to this module) so an installed ``k3`` reports what a checkout
does; ``k3 plan --calibration FILE`` takes another (e.g. a machine's own measurements). :func:`extract` builds one
from a results directory (``benchmarks/plan_calibration.py`` writes the shipped file with it).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

# results file -> the row fields the report reads (every other field is left out)
FILES = {
    "decode-targets.json": ("model", "batch", "context", "ms_per_step"),
    "model-train-precision.json": ("case", "ms"),
    "model-train-peer-floor.json": ("case", "ms"),
    "multi_gpu.json": ("case", "ep_rows_per_rank_mean", "a2a_s_median"),
    "slice.json": ("phase", "batch", "context", "ms"),
}
META = ("device", "time", "torch", "copy_bandwidth_TBps")


def extract(results_dir: str | Path) -> dict:
    """{file name: {"meta": ..., "rows": [...]}} for each of FILES found in ``results_dir``, pruned to what the
    report reads; files that are absent are left out (the report then has no row for them)."""
    out = {}
    for name, keys in FILES.items():
        path = Path(results_dir) / name
        if not path.is_file():
            continue
        raw = json.loads(path.read_text())
        meta = raw.get("meta") or {}
        out[name] = {
            "meta": {k: meta[k] for k in META if k in meta},
            "rows": [{k: r[k] for k in keys if k in r} for r in raw.get("rows", []) if isinstance(r, dict)],
        }
    return out


def load(path: str | Path | None = None) -> dict:
    """The calibration at ``path`` (default: the one shipped in the package); one ValueError naming the file if it
    is not one."""
    where = str(path) if path is not None else "the packaged calibration.json"
    try:
        text = (
            Path(path).read_text()
            if path is not None
            else resources.files("k3.plan").joinpath("calibration.json").read_text()
        )
        data = json.loads(text)
    except FileNotFoundError:
        raise
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: not a readable calibration file ({type(e).__name__}: {e})") from None
    ok = isinstance(data, dict) and all(
        isinstance(v, dict) and isinstance(v.get("meta", {}), dict) and isinstance(v.get("rows"), list)
        for v in data.values()
    )
    if not ok:
        raise ValueError(f"{where}: not a calibration file (want {{results file: {{meta, rows}}}})")
    return data
