"""Write the calibration ``k3 plan --report`` compares its predictions with, from a results directory.

    python benchmarks/plan_calibration.py [--results benchmarks/results] [--out k3/plan/calibration.json]

The default output is the file the package ships (k3.plan.calibration); re-run it after re-measuring any of
k3.plan.calibration.FILES.
"""

from __future__ import annotations

import argparse
import json

from k3.fs import atomic_write_text
from k3.plan.calibration import extract


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--out", default="k3/plan/calibration.json")
    a = p.parse_args()
    data = extract(a.results)
    atomic_write_text(a.out, json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"{a.out}: {', '.join(data) or 'no results files found'}")


if __name__ == "__main__":
    main()
