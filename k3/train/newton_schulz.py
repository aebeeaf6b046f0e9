"""Newton-Schulz orthogonalisation, the core of every Muon update, and the bookkeeping around it: the blocks a Muon
group orthogonalises one by one (:func:`block_shape`), how same-shape blocks share one batched call
(:func:`ns_batches`) and the lr scale of an orthogonalised block (:func:`muon_scale`).

Kept apart from the optimiser (k3.train.muon): the step-time floor (k3.bench.floor) and the precision checks use
it without an optimiser.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from k3.ops.dtypes import autocast_off

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _dtype_name(dtype: torch.dtype | str | None) -> str:
    if dtype is None:
        return "float32"
    if isinstance(dtype, torch.dtype):
        for name, d in _DTYPES.items():
            if d == dtype:
                return name
        raise ValueError(f"ns_dtype={dtype} is not supported; choose one of {list(_DTYPES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"ns_dtype={dtype!r} is not supported; choose one of {list(_DTYPES)}")
    return dtype


# --------------------------------------------------------------------------------------------------------------
# Newton-Schulz
# --------------------------------------------------------------------------------------------------------------


@autocast_off  # runs in its ``dtype`` also if called under autocast
def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coeffs: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype | str | None = None,
) -> Tensor:
    """Approximate orthogonalisation U S' V^T (S'_ii roughly in (0.5, 1.5)) of every matrix in G [..., A, B].

    Each matrix is divided by max(||X||_F, eps) (the placement ``torch.optim.Muon`` uses) and iterated ``steps``
    times with X <- a X + P X, P = b XX^T + c (XX^T)^2, on its wide form (X^T when A > B). The whole computation runs
    in ``dtype`` (None = fp32); the result has shape [..., A, B] and that dtype — the caller casts.
    A tall matrix is iterated in its own layout, as the transpose of that recurrence (Gram matrix X^T X,
    X <- a X + X P^T): the same products without copying transposed views, so faster, and bitwise equal to iterating
    X^T in our measurements (docs/decisions.md, "Newton-Schulz in a tall block's own layout").
    """
    if G.dim() < 2:
        raise ValueError(f"newton_schulz needs a [..., A, B] tensor, got shape {tuple(G.shape)}")
    a, b, c = coeffs
    X = G.to(_DTYPES[_dtype_name(dtype)])
    rows, cols = X.shape[-2:]
    lead = X.shape[:-2]
    X = X.reshape(-1, rows, cols)
    tall = rows > cols
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = X.mT @ X if tall else X @ X.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # P = b gram + c gram^2
        X = torch.baddbmm(X, X, poly.mT, beta=a) if tall else torch.baddbmm(X, poly, X, beta=a)  # a X + P X
    return X.reshape(*lead, rows, cols)


def block_shape(group: dict, shape) -> tuple[int, int]:
    """[rows, cols] of the blocks Newton-Schulz orthogonalises one by one in a parameter of ``shape`` of a Muon
    ``group``: a head [head_dim, in] (muon_head), else the last two dims (an expert matrix, or the whole matrix)."""
    return (group["head_dim"], shape[1]) if group["kind"] == "muon_head" else tuple(shape[-2:])


def ns_batches(items: Iterable[tuple], budget: int) -> dict:
    """[(key, elements, item)] -> {key: [[item, ...], ...]}: the items of each key (blocks of one shape, on one
    device) in order, batched for one Newton-Schulz call each: a new batch whenever an item would take a non-empty
    one past ``budget`` elements (an item larger than the budget gets a batch of its own)."""
    batches: dict = {}
    filled: dict = {}  # key -> elements in its last batch
    for key, size, item in items:
        queue = batches.setdefault(key, [[]])
        if queue[-1] and filled[key] + size > budget:
            queue.append([])
            filled[key] = 0
        queue[-1].append(item)
        filled[key] = filled.get(key, 0) + size
    return batches


def muon_scale(rows: int, cols: int, rule: str = "match_rms_adamw") -> float:
    """The lr multiplier for one orthogonalised [rows, cols] block: Moonlight 0.2*sqrt(max) or Keller's original."""
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"scale_rule={rule!r} must be 'match_rms_adamw' or 'original'")
