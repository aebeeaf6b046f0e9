"""k3 plan: placement invariants, the balancer against a brute-force optimum, byte and time terms against hand
computation and an independent count, the balance terms against simulated routing, and the CLI on K3."""

import json
import math

import numpy as np
import pytest
import torch

from k3.cli.main import main
from k3.config import get_preset
from k3.plan import cost
from k3.plan.cluster import cluster
from k3.plan.loads import read_loads, simulate_routing, zipf_shares
from k3.plan.placement import brute_force, contiguous, min_slots, place, replica_counts
from k3.plan.plan import Serving, decode_step, serving_memory


def _random_shares(rng, e, alpha=1.0):
    f = rng.pareto(alpha, e) + 0.05
    return f / f.sum()


@pytest.mark.parametrize(
    "e,g,per_node,extra", [(896, 64, 8, 1), (896, 64, 8, 0), (64, 8, 4, 2), (30, 4, 4, 1), (7, 3, 3, 0)]
)
def test_placement_invariants(e, g, per_node, extra):
    """Every expert at least once, no GPU over its slots or holding an expert twice, replicas as counted, loads
    adding up; placed is never worse than contiguous blocks, replication never worse than none (to 1%)."""
    rng = np.random.default_rng(e + g)
    shares = _random_shares(rng, e)
    slots = min_slots(e, g) + extra
    p = place(shares, g, per_node, slots, replicate=extra > 0)
    held = [j for xs in p.gpu_experts for j in xs]
    assert set(held) == set(range(e))
    assert all(len(xs) <= slots and len(set(xs)) == len(xs) for xs in p.gpu_experts)
    assert [held.count(j) for j in range(e)] == p.replicas
    per_replica = shares / np.array(p.replicas)
    assert np.allclose(p.gpu_load, [per_replica[xs].sum() for xs in p.gpu_experts])
    assert math.isclose(sum(p.gpu_load), 1.0, rel_tol=1e-9)
    assert max(p.gpu_load) <= max(contiguous(shares, g).gpu_load) + 1e-12
    if extra:
        plain = place(shares, g, per_node, min_slots(e, g), replicate=False)
        assert max(p.gpu_load) <= max(plain.gpu_load) * 1.01


def test_replica_counts_minimise_the_largest_replica_share():
    shares = np.array([0.5, 0.3, 0.15, 0.05])
    r = replica_counts(shares, 8, 3)
    assert sum(r) == 8 and max(r) <= 3
    best = min(max(shares / (np.array(c) + 1)) for c in np.ndindex(3, 3, 3, 3) if sum(c) + 4 == 8)
    assert max(shares / np.array(r)) == pytest.approx(best)


def test_balancer_against_brute_force():
    """Small cases, every replica count and assignment enumerated. Without replicas the balancer is within 5% of
    the optimum (it found it in 148 of 150 random cases, worst 1.9% above); with replicas, where the replica
    counts are chosen too, within 25% (worst seen 10%, mean 0.5%)."""
    rng = np.random.default_rng(1)
    for replicate, bound, mean_bound in ((False, 1.05, 1.005), (True, 1.25, 1.03)):
        ratios = []
        for _ in range(40):
            e, g = int(rng.integers(3, 6)), int(rng.integers(2, 4))
            s = min_slots(e, g) + int(rng.integers(0, 2))
            if replicate and g * s - e > 3:
                s = min_slots(e, g)
            shares = _random_shares(rng, e)
            ratios.append(max(place(shares, g, g, s, replicate).gpu_load) / brute_force(shares, g, s, replicate))
        assert min(ratios) >= 1 - 1e-9  # nothing beats the optimum: the brute force is exhaustive
        assert max(ratios) <= bound and np.mean(ratios) <= mean_bound, (replicate, max(ratios), np.mean(ratios))


def test_zipf_shares_cap_at_one_over_k_and_uniform_at_zero():
    f = zipf_shares(3, 8, 4, 3.0)
    assert torch.allclose(f.sum(1), torch.ones(3, dtype=torch.float64))
    assert float(f.max()) <= 0.25 + 1e-12 and int((f > 0.25 - 1e-12).sum(1)[0]) == 3  # three experts capped
    assert torch.allclose(zipf_shares(2, 10, 2, 0.0), torch.full((2, 10), 0.1, dtype=torch.float64))


def test_memory_and_fabric_terms_by_hand():
    """Memory of a tiny config and one all-to-all's time, computed by hand from the definitions."""
    cfg = get_preset("tiny")
    shape = cost.model_shape(cfg)
    c = cluster(gpus=16, gpus_per_node=8, hbm_gib=80)
    work = Serving(concurrency=64, contexts=((1000, 0.5), (3000, 0.5)))
    mem = serving_memory(shape, c, "mxfp4", work, 2, 3)
    seqs = math.ceil(64 / 8)  # 16 GPUs / tp 2 = 8 groups
    assert mem["dense_weights"] == shape.dense_params * 2 / 2
    assert mem["experts"] == shape.moe_layers * 3 * shape.expert_params * 4.25 / 8
    assert mem["kda_states"] == seqs * shape.kda_state_bytes / 2
    assert mem["mla_latents"] == seqs * shape.mla_bytes_per_token * 2000
    assert shape.expert_params == 3 * cfg.moe.moe_intermediate_size * cfg.moe.latent_size
    intra = 1e9 * 7 / 16 / 450e9
    inter = 1e9 * 8 / 16 / 50e9
    assert cost.all_to_all_time(1e9, c) == pytest.approx(max(intra, inter) + 25e-6)
    one_node = cluster(gpus=8, gpus_per_node=8)
    assert cost.all_to_all_time(1e9, one_node) == pytest.approx(1e9 * 7 / 8 / 450e9 + 10e-6)
    assert cost.all_reduce_time(1e6, 4, c) == pytest.approx(2 * 3 / 4 * 1e6 / 450e9 + 10e-6)


@pytest.mark.parametrize("batch,context", [(1, 4096), (64, 32768), (16, 131072)])
def test_single_gpu_decode_bytes_match_the_decode_benchmark(batch, context):
    """The planner's single-GPU decode bytes against k3.bench.decode.step_bytes, counted independently from the
    model's parameters (the router's fp32 weight aside: <0.1%)."""
    from k3.model.accounting import build_meta
    from k3.bench.decode import step_bytes
    from k3.config.presets import kimi_linear_1p3b

    cfg = kimi_linear_1p3b()
    shape = cost.model_shape(cfg)
    c = cluster(gpus=1, hbm_bytes_per_s=1.0, hbm_gib=1e6)
    work = Serving(concurrency=batch, contexts=((context, 1.0),))
    uniform = np.full((shape.moe_layers, shape.experts), 1 / shape.experts)
    mem = serving_memory(shape, c, "bf16", work, 1, shape.experts)
    step = decode_step(shape, c, "bf16", work, 1, [contiguous(f, 1) for f in uniform], uniform, mem)
    ours = step["dense_weights_s"] + step["caches_s"] + step["experts_s"]  # seconds at 1 byte/s = bytes
    ref = step_bytes(build_meta(cfg).to(torch.bfloat16), batch, context)
    assert abs(ours / ref - 1) < 1e-3, (ours, ref)


def test_expected_max_over_mean_against_simulated_routing():
    """K3's router shape (896 experts, top-16), 64 GPUs, 4096 tokens per step, popularity rank^-0.5: shares from
    simulated router logs, a placement from them, then fresh simulated steps on it. The planner's per-step
    max / mean is within 10% of the simulated one, for contiguous blocks, a balanced placement and replicas."""
    from k3.plan.report import simulate_balance

    sim = simulate_balance(get_preset("k3"), 64, 0.5, 4096, steps=4)
    for name in ("contiguous", "placed", "replicated"):
        assert abs(sim[name]["predicted"] / sim[name]["simulated"] - 1) < 0.1, (name, sim[name])
    assert sim["replicated"]["simulated"] < sim["placed"]["simulated"] < sim["contiguous"]["simulated"]


def test_simulated_routing_takes_k_distinct_experts():
    g = torch.Generator().manual_seed(0)
    counts = simulate_routing(torch.zeros(10), 1000, 3, g)
    assert int(counts.sum()) == 3000 and int(counts.max()) <= 1000


def test_loads_file_and_errors(tmp_path):
    (tmp_path / "expert_loads.json").write_text(json.dumps({"layers": {"1": [1, 3], "2": [2, 2]}}))
    f = read_loads(tmp_path, 3, 2)
    assert f.tolist() == [[0.25, 0.75], [0.5, 0.5], [0.25, 0.75]]
    with pytest.raises(ValueError, match="has 2 experts, the model has 4"):
        read_loads(tmp_path, 3, 4)
    with pytest.raises(ValueError, match="not found"):
        read_loads(tmp_path / "missing", 3, 2)


def test_cli_k3_on_64_and_8_gpus(capsys):
    """The acceptance: on 64 H200s (141 GiB) every one of the 896 experts of every MoE layer is placed, every GPU
    fits, and the placed load is no worse than contiguous blocks; on 8 the plan says why not, with the shortfall."""
    assert main(["plan", "--preset", "k3", "--gpus", "64", "--hbm-gib", "141", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["memory_gib"]["total"] <= 141
    assert len(plan["placement"]) == 92
    for layer in plan["placement"]:
        held = [j for xs in layer["gpu_experts"] for j in xs]
        assert set(held) == set(range(896)) and len(layer["gpu_experts"]) == 64
        assert all(len(xs) <= plan["layout"]["expert_slots_per_gpu"] for xs in layer["gpu_experts"])
    load = plan["load"]
    assert load["max_over_mean_after"]["worst"] <= load["max_over_mean_before"]["worst"]
    assert load["max_over_mean_after"]["mean"] <= load["max_over_mean_before"]["mean"]
    assert main(["plan", "--preset", "k3", "--gpus", "8", "--hbm-gib", "141"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "short by" in out


def test_cli_errors_are_one_line(capsys):
    assert main(["plan", "--preset", "tiny", "--gpus", "12", "--gpus-per-node", "8"]) == 2
    assert "must be a multiple of --gpus-per-node" in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--gpus", "8", "--context", "4k"]) == 2
    assert "--context='4k'" in capsys.readouterr().err


def test_validation_compares_the_slice_decode_with_its_prediction():
    """The report's validation table prices k3-slice's measured decode steps (slice.json, in the packaged
    calibration) with the cost model at the measured bandwidth and MXFP4 experts: a prediction of the same order,
    source named."""
    from k3.plan.report import validate

    rows = [r for r in validate() if r["source"] == "slice.json"]
    assert {r["run"].split(", 1 H200")[0].rsplit("B=", 1)[1] for r in rows} == {"1, context 4096", "64, context 32768"}
    for r in rows:
        assert 0.5 < r["ratio"] < 2, r
        assert float(r["measured"].split()[0]) > 0 and float(r["predicted"].split()[0]) > 0


def test_cli_loads_over_a_directory_of_runs(tmp_path, capsys):
    """--loads over a grid of runs: one row per run, each the training plan of that run's loads (its layers
    repeated over K3's MoE layers); a few hot experts cost more straggler time than even loads; the report files
    hold the same rows; a cluster the model does not fit and loads over another expert count are one-line errors."""
    from k3.plan.plan import Training, plan_training

    grid = tmp_path / "grid"
    hot = np.full(896, 10.0)
    hot[:4] = 4000.0  # four experts take ~2/3 of the slots: one copy each on 512 GPUs cannot spread them
    runs = (("even-s0", [np.full(896, 10.0)] * 2), ("hot-s1", [hot, np.full(896, 10.0)]), ("hot-s2", [hot]))
    for name, counts in runs:
        run = grid / "runs" / name
        run.mkdir(parents=True)
        layers = {str(i): c.tolist() for i, c in enumerate(counts)}
        (run / "expert_loads.json").write_text(json.dumps({"layers": layers}))
        if name != "hot-s2":  # a run without its summary: its variant from its name
            summary = {"variant": name[:-3], "seed": int(name[-1]), "val_loss": 3.0}
            (run / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "out"
    args = ["plan", "--preset", "k3", "--gpus", "512", "--workload", "train", "--loads", str(grid)]
    assert main([*args, "--report", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "straggler-train-512.json").read_text())
    rows = report["rows"]
    assert report["command"] == "k3 " + " ".join([*args, "--report", str(out)])
    assert [(r["variant"], r["seed"]) for r in rows] == [("even", 0), ("hot", 1), ("hot", None)]
    config = get_preset("k3")
    shape = cost.model_shape(config)
    for r in rows:
        shares = read_loads(grid / r["run"], shape.moe_layers, shape.experts).numpy()
        step = plan_training(config, cluster(gpus=512), Training(), shares)["step"]
        assert r["straggler_s"] == pytest.approx(step["straggler_s"])  # the training straggler has no all-to-all
        assert r["step_s"] == pytest.approx(step["step_s"] - step["all_to_all_s"])  # the uncalibrated term left out
        assert r["all_to_all_s"] == pytest.approx(step["all_to_all_s"]) and step["all_to_all_s"] > 0
    assert 0 <= rows[0]["straggler_share"] < 0.1 < rows[1]["straggler_share"] < 1
    assert "| `hot` | 2 |" in printed and (out / "straggler-train-512.md").read_text() == printed
    assert "all-to-all ms (uncalibrated)" in printed
    assert [r["per_step"] for r in rows] == [None] * 3  # no run kept per-step counts: the table says so
    assert printed.count("summed loads only: no per-step counts") == 3
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == rows
    (tmp_path / "empty").mkdir()
    assert main([*args[:-1], str(tmp_path / "empty")]) == 2
    assert "no run under" in capsys.readouterr().err
    assert main([*args[:4], "256", *args[5:]]) == 2
    assert "does not fit this cluster" in capsys.readouterr().err
    (grid / "runs" / "even-s0" / "expert_loads.json").write_text(json.dumps([[1.0] * 32]))
    assert main(args) == 2
    assert "even-s0: expert loads: layer 0 has 32 experts, the model has 896" in capsys.readouterr().err


def test_the_packaged_calibration_is_the_checked_in_results(tmp_path):
    """k3/plan/calibration.json is what benchmarks/plan_calibration.py makes of benchmarks/results (re-run it after
    re-measuring one of its files), and the package declares it as data so a wheel carries it."""
    from pathlib import Path

    from k3.plan import calibration

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    assert calibration.load() == calibration.extract(results)
    assert set(calibration.load()) == set(calibration.FILES)
    assert '"k3.plan" = ["calibration.json"]' in (results.parents[1] / "pyproject.toml").read_text()


def test_report_takes_a_calibration_file_and_refuses_a_bad_one(tmp_path, capsys):
    """--calibration FILE: the report's predicted-vs-measured table has the rows of that file only; a file that is
    not a calibration is one error line (exit 2), and nothing is written."""
    import json

    from k3.cli.main import main
    from k3.plan import calibration

    only = {"slice.json": calibration.load()["slice.json"]}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(only))
    out = tmp_path / "report"
    assert main(["plan", "--preset", "small-1b", "--gpus", "8", "--report", str(out), "--calibration", str(path)]) == 0
    text = (out / "report.md").read_text()
    sources = {line.rstrip(" |").rsplit("| ", 1)[-1] for line in text.splitlines() if line.endswith(".json |")}
    assert sources == {"slice.json"}, sources
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"slice.json": [1, 2]}))
    out2 = tmp_path / "report2"
    assert main(["plan", "--preset", "k3", "--gpus", "64", "--report", str(out2), "--calibration", str(bad)]) == 2
    assert "not a calibration file" in capsys.readouterr().err and not out2.exists()
