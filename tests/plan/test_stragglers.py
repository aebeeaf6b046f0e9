"""Per-step stragglers (k3.plan.stragglers) on traces whose answer is known, the per-step loads file, and the
trainer writing it."""

import json

import numpy as np
import pytest
import torch

from k3.plan.loads import simulate_routing
from k3.train.step_loads import STEP_LOADS, StepLoads, read_step_loads, write_step_loads
from k3.plan.stragglers import cell, step_stragglers


def _loads(counts, top_k=1):
    counts = np.asarray(counts, dtype=np.int64)
    n = counts.shape[0]
    return StepLoads(counts, np.arange(n), np.zeros(n, dtype=np.int64), np.arange(counts.shape[1]), top_k)


def test_one_hot_expert_on_rank_zero_is_exact():
    """8 experts on 4 ranks (2 each), top-1: expert 0 takes 10 slots, the others 2 each (24 slots). Rank 0 holds
    12, the mean rank 6: max / mean 2; hottest 10 over a mean of 3; capacity ceil(1.25 x 24 / 8) = 4, so one expert
    of 8 is over it and 6 of 24 slots are above it."""
    r = step_stragglers(_loads([[[10, 2, 2, 2, 2, 2, 2, 2]]]), ranks=4)
    m = r["measured"]
    for q in ("p50", "p90", "max"):
        assert m["rank_max_over_mean"][q] == pytest.approx(2.0, abs=1e-12)
        assert m["hottest_over_mean"][q] == pytest.approx(10 / 3, abs=1e-12)
        assert m["experts_over_capacity"][q] == pytest.approx(1 / 8, abs=1e-12)
        assert m["slots_over_capacity"][q] == pytest.approx(6 / 24, abs=1e-12)
    assert r["tokens_per_record"] == 24 and r["records"] == 1


def test_rotating_hot_expert_is_a_straggler_its_sum_hides():
    """Each step one expert (a different one each step, every expert once) takes 9 slots and the others 1: every
    step's straggler is the same, the 8 steps' sum is perfectly even. Summed counts read 1.0; per step reads 5.0
    (the hot rank holds 9 + 1 of a mean of 16 / 8 x 1 = 2)."""
    counts = np.ones((8, 1, 8), dtype=np.int64)
    counts[np.arange(8), 0, np.arange(8)] = 9
    r = step_stragglers(_loads(counts), ranks=4)
    assert r["summed_rank_max_over_mean"] == pytest.approx(1.0)
    assert r["measured"]["rank_max_over_mean"]["p50"] == pytest.approx(10 / 4)
    assert r["measured"]["hottest_over_mean"]["max"] == pytest.approx(9 / 2)


def test_uniform_trace_sits_on_the_simulated_floor():
    """A trace drawn from a uniform router (another seed) at K3's 896 experts / top-16, 64 ranks: its per-step
    max / mean matches the floor's to sampling noise and is well above 1 (the sampling floor is real)."""
    g = torch.Generator().manual_seed(123)
    zero = torch.zeros(896, dtype=torch.float64)
    counts = np.stack([[simulate_routing(zero, 1024, 16, g).numpy()] for _ in range(16)])
    r = step_stragglers(_loads(counts, top_k=16), ranks=64)
    m, u = r["measured"]["rank_max_over_mean"], r["uniform"]["rank_max_over_mean"]
    assert u["p50"] > 1.08
    assert m["p50"] == pytest.approx(u["p50"], rel=0.03)
    h = r["measured"]["hottest_over_mean"]["p50"], r["uniform"]["hottest_over_mean"]["p50"]
    assert h[0] == pytest.approx(h[1], rel=0.08)
    assert r["summed_rank_max_over_mean"] < m["p50"]  # 16 steps summed average the fluctuation away


def test_placed_beats_contiguous_on_a_static_skew():
    """A static skew (the same hot experts every step): placing by the summed counts lowers the per-step max /
    mean below the contiguous split's; an unknown placement is one clear error."""
    rng = np.random.default_rng(0)
    base = np.repeat(np.arange(1, 17)[::-1], 1)  # expert j gets 16 - j slots on average, hot ones adjacent
    counts = rng.poisson(base * 8, size=(12, 2, 16))
    loads = _loads(counts)
    placed = step_stragglers(loads, ranks=4, placement="placed")["measured"]["rank_max_over_mean"]["p50"]
    contig = step_stragglers(loads, ranks=4)["measured"]["rank_max_over_mean"]["p50"]
    assert placed < contig
    with pytest.raises(ValueError, match="placement"):
        step_stragglers(loads, ranks=4, placement="random")


def test_cell_says_when_only_summed_loads_exist():
    assert "summed loads only" in cell(None)
    r = step_stragglers(_loads([[[10, 2, 2, 2, 2, 2, 2, 2]]]), ranks=4)
    assert cell(r).startswith("2.000 / 2.000 / 2.000 (uniform ")


def test_step_loads_round_trip_and_bad_files(tmp_path):
    """uint16 on disk when the counts fit, uint32 when not; read back equal; a file that is not one is one
    ValueError naming it; a run without the file reads as None (summed loads only)."""
    for top in (7, 70_000):
        loads = _loads([[[top, 1, 0]], [[2, 2, 2]]], top_k=1)
        write_step_loads(tmp_path / STEP_LOADS, loads)
        with np.load(tmp_path / STEP_LOADS) as z:
            assert z["counts"].dtype == (np.uint16 if top < 2**16 else np.uint32)
        back = read_step_loads(tmp_path)
        assert np.array_equal(back.counts, loads.counts) and back.top_k == 1
        assert list(back.steps) == [0, 1] and list(back.layers) == [0]
    assert read_step_loads(tmp_path / "absent") is None
    bad = tmp_path / "bad.npz"
    bad.write_text("not an archive")
    with pytest.raises(ValueError, match="bad.npz"):
        read_step_loads(bad)


def test_trainer_writes_per_micro_batch_loads(tmp_path):
    """A tiny CPU run with gradient accumulation: one record per micro-batch of every step, each layer's counts
    summing to the micro-batch's token-slots, and their sum over the run equal to expert_loads.json."""
    from k3.train.trainer import Trainer
    from tests.train.test_trainer import tiny_cfg

    cfg = tiny_cfg(tmp_path / "run", steps=3, grad_accum=2, save_every=0, eval_every=3, samples=0)
    trainer = Trainer(cfg, progress=False)
    trainer.figures = False
    trainer.run()
    loads = read_step_loads(tmp_path / "run")
    k = trainer.model_cfg.moe.num_experts_per_token
    assert list(loads.steps) == [0, 0, 1, 1, 2, 2] and list(loads.micro) == [0, 1] * 3
    assert loads.top_k == k and loads.counts.shape[2] == trainer.model_cfg.moe.num_experts
    assert (loads.counts.sum(axis=2) == cfg.batch_size * cfg.seq_len * k).all()
    summed = json.loads((tmp_path / "run" / "expert_loads.json").read_text())["layers"]
    assert [int(x) for x in summed] == list(loads.layers)
    assert np.array_equal(loads.counts.sum(axis=0), np.array(list(summed.values())))


def test_plan_runs_per_step_table(tmp_path):
    """A grid of two runs, one with per micro-batch counts (a rotating hot expert: even when summed) and one
    with summed counts only: the first's per-step max / mean and straggler share come from its micro-batches
    (share = expert time x (max / mean - 1) over the step without the all-to-all plus that), above the
    uniform router's; the second's row says it has summed loads only."""
    from k3.audit.grids import get_grid
    from k3.plan import cost
    from k3.plan.cluster import cluster
    from k3.plan.plan import Training, plan_training
    from k3.plan.runs import plan_runs, runs_markdown

    config, c = get_grid("balance896").base_config(), cluster(gpus=64)  # 896 experts, top-16, a small model
    shape = cost.model_shape(config)
    e, k = shape.experts, shape.top_k
    g = torch.Generator().manual_seed(0)
    counts = np.stack([[simulate_routing(torch.zeros(e, dtype=torch.float64), 2048, k, g).numpy()] for _ in range(8)])
    counts[np.arange(8), 0, np.arange(8)] += 2048 - counts[np.arange(8), 0, np.arange(8)]  # a hot expert per step
    for name in ("hot-s0", "old-s0"):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        (run / "expert_loads.json").write_text(json.dumps({"layers": {"1": counts.sum(axis=0)[0].tolist()}}))
    write_step_loads(tmp_path / "runs" / "hot-s0" / STEP_LOADS, _loads(counts, top_k=k))
    plan_one = lambda shares: plan_training(config, c, Training(), shares)  # noqa: E731
    per_step = lambda loads: step_stragglers(loads, c.gpus, "placed", c.per_node)  # noqa: E731
    hot, old = plan_runs(tmp_path, shape.moe_layers, e, plan_one, per_step)
    assert old["per_step"] is None and old["per_step_share"] is None
    st, sh = hot["per_step"], hot["per_step_share"]
    assert st["measured"]["rank_max_over_mean"]["p50"] > st["uniform"]["rank_max_over_mean"]["p90"]
    step = plan_training(config, c, Training(), read_step_loads_shares(tmp_path / "runs" / "hot-s0", shape))["step"]
    extra = step["expert_flops_s"] * (st["measured"]["rank_max_over_mean"]["p50"] - 1)
    balanced = step["step_s"] - step["all_to_all_s"] - step["straggler_s"]
    assert sh["measured"]["p50"] == pytest.approx(extra / (balanced + extra))
    assert sh["uniform"]["p50"] < sh["measured"]["p50"]
    md = runs_markdown([hot, old], "t", "k3 plan", "w")
    assert "## Per step" in md and "| runs/old-s0 | summed loads only: no per-step counts |" in md


def read_step_loads_shares(run, shape):
    from k3.plan.loads import read_loads

    return read_loads(run, shape.moe_layers, shape.experts).numpy()


def test_resume_continues_the_per_step_window(tmp_path):
    """Interrupted after step 3 (saved at step 2), then resumed: the window holds steps 0..3 once each, the
    records of the saved steps read back from the file and the re-run step 2 not doubled."""
    from k3.train.trainer import Trainer
    from tests.train.test_trainer import tiny_cfg

    cfg = tiny_cfg(tmp_path / "run", steps=4, save_every=2, eval_every=4, samples=0)
    first = Trainer(cfg, progress=False)
    first.figures = False
    first.run(stop_at=3)
    assert list(read_step_loads(tmp_path / "run").steps) == [0, 1]
    again = Trainer(cfg, resume=True, progress=False)
    again.figures = False
    again.run()
    assert list(read_step_loads(tmp_path / "run").steps) == [0, 1, 2, 3]
