"""Which rank holds which routed experts of every MoE layer when serving with expert parallelism.

``ExpertPlacement.layers[i][r]``: the global ids of the experts rank ``r`` holds in the i-th MoE layer (in model
order), in the order of its bank. A rank may hold any number of experts, and an expert may be held by several
ranks (replicas, as ``k3 plan`` puts hot experts on more than one GPU): of a step's tokens routed to expert j, held
by ranks r_0 < r_1 < ... < r_(n-1), token t is computed by r_(t mod n), so each (token, expert) pair is computed
exactly once and the replicas share the tokens evenly. Every expert is held at least once in every layer. Without a
file, rank r holds the contiguous block [r ceil(E/N), (r + 1) ceil(E/N)) (:func:`contiguous`).

The file (``k3 plan --placement FILE`` writes it, ``k3 serve --placement FILE`` reads it) is JSON::

    {"format": "k3-expert-placement", "version": 1, "model": "k3", "num_experts": 896, "ranks": 64,
     "layers": [[[experts of rank 0], [experts of rank 1], ...], ...]}      one entry per MoE layer
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

FORMAT = "k3-expert-placement"
VERSION = 1


@dataclass(frozen=True)
class ExpertPlacement:
    """``layers[i][r]``: the experts rank r holds in MoE layer i (see the module docstring); checked when made."""

    num_experts: int
    layers: tuple[tuple[tuple[int, ...], ...], ...]
    model: str | None = None

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model={self.model!r} must be a name")
        e = self.num_experts
        if isinstance(e, bool) or not isinstance(e, int) or e < 1:
            raise ValueError(f"num_experts={e!r} must be a positive integer")
        layers = tuple(tuple(tuple(_ids(rank)) for rank in _list(layer, "a layer")) for layer in _list(self.layers))
        object.__setattr__(self, "layers", layers)
        if not layers or not layers[0]:
            raise ValueError("a placement needs at least one MoE layer and one rank")
        for i, layer in enumerate(layers):
            if len(layer) != len(layers[0]):
                raise ValueError(f"MoE layer {i} places experts on {len(layer)} ranks, layer 0 on {len(layers[0])}")
            held = set()
            for r, ids in enumerate(layer):
                bad = sorted({j for j in ids if not 0 <= j < e})
                if bad:
                    raise ValueError(f"MoE layer {i}, rank {r}: experts {bad[:8]} are outside 0..{e - 1}")
                if len(set(ids)) != len(ids):
                    raise ValueError(f"MoE layer {i}, rank {r} holds an expert twice: {list(ids)}")
                held.update(ids)
            missing = sorted(set(range(e)) - held)
            if missing:
                raise ValueError(f"MoE layer {i}: experts {missing[:8]} are held by no rank")

    @property
    def ranks(self) -> int:
        return len(self.layers[0])

    def check(self, moe_layers: int, num_experts: int, ranks: int) -> None:
        """One ValueError unless this placement is for ``moe_layers`` MoE layers of ``num_experts`` experts on
        ``ranks`` ranks."""
        what = f"the placement{f' (for {self.model})' if self.model else ''}"
        if self.ranks != ranks:
            raise ValueError(f"{what} is for {self.ranks} ranks, but --ep={ranks}")
        if (len(self.layers), self.num_experts) != (moe_layers, num_experts):
            raise ValueError(
                f"{what} has {len(self.layers)} MoE layers of {self.num_experts} experts; the model has "
                f"{moe_layers} of {num_experts}"
            )

    def tables(self, layer: int, rank: int, device=None):
        """For MoE layer ``layer`` on rank ``rank``, three int64 tensors [E]: each expert's slot in this rank's
        bank (-1: not here), which of its replicas this rank is (-1: none), and how many ranks hold it."""
        import torch

        e = self.num_experts
        slot, replica, replicas = [-1] * e, [-1] * e, [0] * e
        for r, ids in enumerate(self.layers[layer]):
            for s, j in enumerate(ids):
                if r == rank:
                    slot[j], replica[j] = s, replicas[j]
                replicas[j] += 1
        return tuple(torch.tensor(v, dtype=torch.long, device=device) for v in (slot, replica, replicas))

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "num_experts": self.num_experts,
            "ranks": self.ranks,
            "layers": [[list(ids) for ids in layer] for layer in self.layers],
        }


def _list(value, what: str = "layers"):
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} must be a list, not {type(value).__name__}")
    return value


def _ids(value) -> list[int]:
    ids = _list(value, "a rank's experts")
    if any(isinstance(j, bool) or not isinstance(j, int) for j in ids):
        raise ValueError(f"a rank's experts must be integers: {list(ids)[:8]}")
    return list(ids)


def contiguous(moe_layers: int, num_experts: int, ranks: int, model: str | None = None) -> ExpertPlacement:
    """Plain expert parallelism: rank r holds experts [r ceil(E/N), (r + 1) ceil(E/N)) of every layer (the last
    ranks fewer, or none, where N does not divide E)."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be >= 1")
    per = -(-num_experts // ranks)
    layer = [list(range(min(r * per, num_experts), min((r + 1) * per, num_experts))) for r in range(ranks)]
    return ExpertPlacement(num_experts, [layer] * moe_layers, model)


def read_placement(path: str | os.PathLike) -> ExpertPlacement:
    """The placement in ``path``; one ValueError naming the file for anything that is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"placement file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an expert placement (no format {FORMAT!r}; k3 plan --placement writes one)")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: placement version {data.get('version')!r}; this k3 reads version {VERSION}")
    try:
        placement = ExpertPlacement(data.get("num_experts"), data.get("layers"), data.get("model"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if data.get("ranks") != placement.ranks:
        raise ValueError(f"{path}: ranks is {data.get('ranks')!r}, but its layers place experts on {placement.ranks}")
    return placement


def write_placement(path: str | os.PathLike, placement: ExpertPlacement) -> Path:
    """Write ``placement`` to ``path`` atomically (a reader sees the old file or the new one, whole)."""
    from k3.fs import atomic_write_text

    atomic_write_text(path, json.dumps(placement.to_json()) + "\n")
    return Path(path)
