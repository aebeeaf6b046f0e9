"""PNG plots of a training run: loss curves, MaxVio, per-layer expert load, AttnRes depth weights (matplotlib, Agg)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def ema(values, alpha: float = 0.9) -> list[float]:
    """Exponential moving average starting at the first value."""
    out, e = [], values[0]
    for v in values:
        e = alpha * e + (1 - alpha) * v
        out.append(e)
    return out


def loss_curves(history: list[dict], path: Path) -> None:
    """Training loss per step (raw and smoothed) and validation loss (with bits per byte) where evaluated.

    x = optimizer steps done: step s's training loss is plotted at s, a validation after step s at s + 1, the
    validation of the initial model at 0.
    """
    train = [(h["step"], h["loss"]) for h in history if isinstance(h.get("loss"), float) and math.isfinite(h["loss"])]
    val = [(h["step"] + 1, h["val_loss"], h["val_bpb"]) for h in history if "val_loss" in h]
    val = [(0, h["val_loss_init"], h["val_bpb_init"]) for h in history if "val_loss_init" in h] + val
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        steps, values = zip(*train)
        ax.plot(steps, values, lw=0.8, alpha=0.4, color="C0", label="train loss")
        ax.plot(steps, ema(values), lw=1.5, color="C0", label="train loss (EMA 0.9)")
    if val:
        s, v, b = zip(*val)
        ax.plot(s, v, "o-", label="validation loss")
        ax.annotate(f"{b[-1]:.2f} bits/byte", (s[-1], v[-1]), textcoords="offset points", xytext=(-60, 10))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


MAXVIO_SERIES = (
    ("maxvio", "global batch (all ranks)"),
    ("maxvio_micro", "micro-batch"),
    ("maxvio_seq", "per sequence (length-weighted)"),
)


def maxvio_curves(history: list[dict], path: Path) -> bool:
    """MaxVio per step in its three forms, each the mean over MoE layers: over the global batch, over one
    micro-batch (mean of the step's micro-batches) and per sequence (see k3.model.router_stats.seq_max_vio).

    One y unit (max load / mean load - 1; 0 = perfectly balanced), x = step. Records without a form (skipped
    steps, runs logged before it existed) are left out of its line. Writes nothing and returns False when no
    record has any (a model without MoE layers).
    """
    series = [
        (
            label,
            [(h["step"], h[key]) for h in history if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])],
        )
        for key, label in MAXVIO_SERIES
    ]
    if not any(points for _, points in series):
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, points) in enumerate(series):
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, lw=1.2, color=f"C{i}", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("MaxVio (max load / mean \u2212 1)")
    ax.set_title("expert-load imbalance, mean over MoE layers")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def expert_load_heatmap(loads: dict[int, torch.Tensor], path: Path) -> None:
    """Rows: MoE layers; columns: experts; colour: load / mean load (1 = perfectly balanced)."""
    layers = sorted(loads)
    grid = np.stack([loads[i].double().numpy() / max(float(loads[i].double().mean()), 1e-9) for i in layers])
    fig, ax = plt.subplots(figsize=(min(14, 2 + grid.shape[1] * 0.25), 1.5 + 0.4 * len(layers)))
    im = ax.imshow(grid, aspect="auto", cmap="coolwarm", vmin=0, vmax=2)
    ax.set_yticks(range(len(layers)), [f"layer {i}" for i in layers])
    ax.set_xlabel("expert")
    ax.set_title("expert load / mean (recent steps)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def attn_res_weights(records: list, path: Path) -> None:
    """Rows: sub-layers in order (and the output mix); columns: depth sources; colour: mean softmax weight."""
    width = max(len(w) for _, _, w in records)
    grid = np.full((len(records), width), np.nan)
    for r, (_, _, w) in enumerate(records):
        grid[r, : len(w)] = w.double().numpy()
    labels = [f"{layer}.{sub}" if layer >= 0 else "output" for layer, sub, _ in records]
    fig, ax = plt.subplots(figsize=(2 + width * 0.6, 1.5 + 0.22 * len(records)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel("source (embedding / blocks ... / current)")
    ax.set_title("AttnRes depth weights")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
