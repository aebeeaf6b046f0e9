"""k3.audit.frontier: padding, rank imbalance and all-to-all bytes from expert loads, on loads with known answers."""

import json

import numpy as np
import pytest

from k3.audit.frontier import layer_costs, padding_share, rank_shares, read_shares, trained_frontier


def test_padding_share():
    even = np.full(4, 0.25)
    assert padding_share(even, tokens=8, k=2, align=8) == pytest.approx(4 / 8)  # 4 rows each, padded to 8
    assert padding_share(even, tokens=16, k=2, align=8) == 0.0
    skew = np.array([0.5, 0.5, 0.0, 0.0])
    assert padding_share(skew, tokens=8, k=1, align=8) == pytest.approx(8 / 16)  # 4 + 4 rows, two groups of 8


def test_rank_imbalance_and_all_to_all():
    uniform = np.full(64, 1 / 64)
    c = layer_costs(uniform, tokens=4096, k=4, latent=128)
    assert c["imbalance_ep8"] == pytest.approx(1.0) and c["imbalance_ep64"] == pytest.approx(1.0)
    hit = 8 * (1 - (1 - 1 / 8) ** 4)  # ranks a token reaches: independent draws
    assert c["a2a_bytes_ep8"] == pytest.approx(2 * hit * 7 / 8 * 128 * 2)
    hot = np.r_[np.full(8, 0.5 / 8), np.full(56, 0.5 / 56)]  # rank 0's eight experts take half the slots
    assert rank_shares(hot, 8)[0] == pytest.approx(0.5)
    assert layer_costs(hot, 4096, 4, 128)["imbalance_ep8"] == pytest.approx(4.0)
    assert "imbalance_ep64" not in layer_costs(np.full(32, 1 / 32), 64, 2, 16)  # fewer experts than ranks


def test_trained_frontier_reads_run_directories(tmp_path):
    run = tmp_path / "full-s0"
    run.mkdir()
    (run / "expert_loads.json").write_text(
        json.dumps({"layers": {"1": [1, 1, 1, 1, 1, 1, 1, 1], "2": [8, 0, 0, 0, 0, 0, 0, 0]}})
    )
    assert [list(f) for f in read_shares(run)][1] == [1.0] + [0.0] * 7
    rows = trained_frontier(
        [
            {"variant": "full", "seed": 0, "val_loss": 3.0, "maxvio": 0.1, "run_dir": str(run)},
            {"variant": "none", "seed": 0, "run_dir": str(tmp_path / "absent")},
        ],
        tokens=64,
        k=2,
        latent=16,
    )
    assert len(rows) == 1 and rows[0]["layers"] == 2 and rows[0]["val_loss"] == 3.0
    assert rows[0]["imbalance_ep8"] == pytest.approx((1 + 8) / 2)  # layer means: even 1, one hot expert 8


def test_trained_frontier_per_step_columns(tmp_path):
    """A run with per micro-batch counts gets the per-step statistics under the same contiguous placement (its
    hot expert per step, even when summed: per step 4x on EP 8, summed 1x); a run with summed counts only gets
    None, and the report's table says so instead of a number."""
    from k3.audit.ablate_report import _trained_frontier_lines
    from k3.train.step_loads import STEP_LOADS, StepLoads, write_step_loads

    for name in ("new-s0", "old-s0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "expert_loads.json").write_text(json.dumps({"layers": {"1": [8] * 8}}))
    counts = np.ones((8, 1, 8), dtype=np.int64)
    counts[np.arange(8), 0, np.arange(8)] = 8  # one expert per step takes 8 of 15 slots, each expert once
    write_step_loads(tmp_path / "new-s0" / STEP_LOADS, StepLoads(counts, np.arange(8), np.zeros(8), np.array([1]), 1))
    summaries = [{"variant": n[:-3], "seed": 0, "run_dir": str(tmp_path / n)} for n in ("new-s0", "old-s0")]
    new, old = trained_frontier(summaries, tokens=15, k=1, latent=16)
    assert new["imbalance_ep8"] == pytest.approx(1.0) and old["step_ep8"] is None
    assert new["step_ep8"]["measured"]["rank_max_over_mean"]["p50"] == pytest.approx(8 / (15 / 8))
    text = "\n".join(_trained_frontier_lines([new, old]))
    assert "EP 8 per step" in text and "summed loads only: no per-step counts" in text
