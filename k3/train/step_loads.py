"""Per micro-batch router counts, as the trainer keeps them beside ``expert_loads.json``: summed counts hide what
sets a straggler (each micro-batch routes its own tokens, and its slowest rank waits for that micro-batch's hottest
experts), so runs also keep the most recent micro-batches' counts (read by k3.plan.stragglers)."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3.fs import atomic_file

STEP_LOADS = "expert_loads_steps.npz"
# micro-batches the trainer keeps per-step counts of (the most recent ones): 100 x K3's 92 MoE layers x 896
# experts is 16 MiB of uint16 counts before compression
STEP_WINDOW = 100


@dataclass
class StepLoads:
    """Per micro-batch router counts: ``counts`` [N, L, E] (token-slots of expert e in MoE layer ``layers[l]`` in
    micro-batch n, this process's tokens), ``steps`` / ``micro`` [N] the optimizer step and micro-batch index of
    each record, ``top_k`` the experts per token (so micro-batch n routed ``counts[n, l].sum() / top_k`` tokens)."""

    counts: np.ndarray
    steps: np.ndarray
    micro: np.ndarray
    layers: np.ndarray
    top_k: int

    def __post_init__(self) -> None:
        c = self.counts
        if c.ndim != 3 or c.shape[0] != len(self.steps) or c.shape[0] != len(self.micro):
            raise ValueError(f"per-step loads: counts {c.shape} do not match {len(self.steps)} step records")
        if c.shape[1] != len(self.layers) or not self.top_k >= 1:
            raise ValueError(f"per-step loads: counts {c.shape} do not match {len(self.layers)} layers, top-k >= 1")
        if c.shape[0] == 0 or (c < 0).any() or (c.sum(axis=2) <= 0).any():
            raise ValueError("per-step loads: need at least one record, non-negative counts, tokens in every layer")

    @property
    def tokens(self) -> np.ndarray:
        """Tokens each record routed, [N] (the mean over its layers: every layer routes the same tokens)."""
        return self.counts.sum(axis=2).mean(axis=1) / self.top_k


def write_step_loads(path: str | Path, loads: StepLoads) -> None:
    """``loads`` as a compressed .npz, atomically; counts as uint16 when they fit (a micro-batch under 65,536
    tokens: an expert takes each token at most once), else uint32."""
    c = loads.counts
    dtype = np.uint16 if int(c.max(initial=0)) < 2**16 else np.uint32
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(
            f,
            counts=c.astype(dtype),
            steps=np.asarray(loads.steps, dtype=np.int64),
            micro=np.asarray(loads.micro, dtype=np.int64),
            layers=np.asarray(loads.layers, dtype=np.int64),
            top_k=np.int64(loads.top_k),
        )


def read_step_loads(path: str | Path) -> StepLoads | None:
    """The per-step loads of a run directory (its ``expert_loads_steps.npz``) or of a .npz file; None when the run
    has none (it predates them: only summed ``expert_loads.json``). ValueError naming the file if it is not one."""
    p = Path(path)
    if p.is_dir():
        p = p / STEP_LOADS
    if not p.is_file():
        return None
    try:
        with np.load(p) as z:
            out = StepLoads(z["counts"].astype(np.int64), z["steps"], z["micro"], z["layers"], int(z["top_k"]))
    except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"per-step loads: {p} is not a per-step loads file ({e})") from None
    return out
