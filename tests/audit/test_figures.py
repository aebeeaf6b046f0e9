"""Audit figures say what they draw: the k3 audit's figures redrawn from a committed audit.json, the scaling
multiplier's interval as a band along its curve, and the ablation Δ bars labelled with their method."""

import json
import shutil
from pathlib import Path

import matplotlib.figure
import numpy as np
import pytest
from matplotlib.container import ErrorbarContainer

from k3.audit import plots
from k3.audit.ablate_report import plot_val_loss
from k3.audit.report import redraw_figures
from k3.audit.scaling import analyse, plot_scaling
from k3.cli.main import main

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "audit" / "k3"


@pytest.fixture
def drawn(monkeypatch):
    """Every figure saved, by file name, still open for inspection."""
    figs = {}

    def keep(fig, path, *args, **kwargs):
        figs[Path(path).name] = fig

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    monkeypatch.setattr(plots.plt, "close", lambda fig=None: None)
    return figs


def _texts(fig) -> str:
    parts = [fig._suptitle.get_text() if fig._suptitle else ""]
    for ax in fig.axes:
        parts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        if ax.get_legend():
            parts += [t.get_text() for t in ax.get_legend().get_texts()]
    return "\n".join(parts)


def test_k3_figures_redraw_from_the_committed_audit_json(tmp_path, drawn):
    out = tmp_path / "k3"
    shutil.copytree(COMMITTED, out)
    figures = redraw_figures(out)
    assert figures == json.loads((COMMITTED / "audit.json").read_text())["figures"]
    lc = drawn["long_context.png"]
    assert lc._suptitle.get_text() == "k3: long-context serving"
    titles = [ax.get_title() for ax in lc.axes]
    assert titles[0] == "cache bytes per sequence of k3 (analytic)"
    assert titles[1].startswith("decode measured on NVIDIA H200: kimi-linear-1.3b, not k3")
    assert titles[2].startswith("decode measured on CPU: small, not k3")
    ar = _texts(drawn["attn_res.png"])
    # the GPU measurements are drawn: the depth run's device and the small-1b overheads
    assert "NVIDIA H100 80GB HBM3, bf16, 4096 tokens" in ar and "CPU, fp32, 64 tokens" in ar
    assert "overhead on NVIDIA H200: small-1b, not this config" in ar
    assert "decode step, compiled + CUDA graph" in ar
    # the stage-boundary bars are K3's deepest pipeline even with audit.json's string keys
    assert "worst stage boundary, PP=16" in ar


def test_figures_only_without_an_audit_is_one_clear_error(tmp_path, capsys):
    assert main(["audit", "--figures-only", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"k3 audit: error: {tmp_path}: no audit.json to redraw the figures from"


def _runs(sizes: int, seeds: int) -> list[dict]:
    rng = np.random.default_rng(0)
    c = np.geomspace(1e15, 1e19, sizes).repeat(seeds)
    runs = []
    for label, k, s in (("k3", 3.0, 1), ("baseline", 1.0, 2)):
        loss = 40.0 * (k * c) ** -0.08 * np.exp(np.random.default_rng(s).normal(0.0, 0.003, c.size))
        runs += [
            {"label": label, "compute": ci, "loss": li, "run_dir": f"{label}{i}"}
            for i, (ci, li) in enumerate(zip(c, loss))
        ]
    rng.shuffle(runs)
    return runs


@pytest.mark.parametrize("sizes, how", [(4, "delta method"), (7, "percentile bootstrap")])
def test_multiplier_interval_is_a_band_along_the_curve(tmp_path, drawn, sizes, how):
    r = analyse(_runs(sizes, 3), n_boot=200, seed=0)
    m = r["multipliers"]["k3"]
    band, curve = m["band"], m["curve"]
    assert band["loss"] == curve["loss"] and len(band["lo"]) == len(curve["loss"]) == 9
    for lo, mid, hi in zip(band["lo"], curve["multiplier"], band["hi"]):
        assert lo < mid < hi
    if how == "delta method":  # the reference loss is the grid's midpoint: the band there is the interval
        assert band["lo"][4] == pytest.approx(m["interval"][0]) and band["hi"][4] == pytest.approx(m["interval"][1])
    plot_scaling(r, tmp_path / "scaling.png")
    legend = _texts(drawn["scaling.png"])
    assert f"k3: 90% pointwise interval ({how}" in legend
    assert f"(90%, {how}" in legend


def _rows():
    rows = []
    for v, mean, std in (("full", 0.0, 0.0), ("no_kda", 0.49, 0.008), ("no_mla", -0.003, 0.001)):
        rows.append(
            {
                "variant": v,
                "model_overrides": {} if v == "full" else {"x": 1},
                "val_loss_mean": 3.4 + mean,
                "val_loss_std": 0.01,
                "delta_vs_full_mean": mean,
                "delta_vs_full_std": std,
            }
        )
    return rows


def _widths(ax) -> list[float]:
    """Widths of the horizontal error bars drawn on ``ax``, row by row."""
    bars = next(c for c in ax.containers if isinstance(c, ErrorbarContainer))
    return [round(float(s[1][0] - s[0][0]), 4) for s in bars.lines[2][0].get_segments()]


def test_delta_bars_without_intervals_are_labelled_as_std(tmp_path, drawn):
    plot_val_loss(_rows(), tmp_path / "val_loss.png", None)
    ax = drawn["val_loss.png"].axes[1]
    assert "mean ± std of the paired differences" in ax.get_xlabel() and "no interval" in ax.get_xlabel()
    assert _widths(ax) == [0.0, 0.016, 0.002]


def test_delta_bars_with_intervals_name_the_t_interval(tmp_path, drawn):
    diffs = {
        "no_kda": {"lo": 0.4, "hi": 0.58, "df": 1, "level": "95%"},
        "no_mla": {"lo": -0.01, "hi": 0.004, "df": 1, "level": "95%"},
    }
    plot_val_loss(_rows(), tmp_path / "val_loss.png", diffs)
    ax = drawn["val_loss.png"].axes[1]
    assert "paired t 95% CI, 1 df" in ax.get_xlabel() and "std" not in ax.get_xlabel()
    assert _widths(ax) == [0.0, 0.18, 0.014]
