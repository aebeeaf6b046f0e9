"""`k3 bench`: its arguments are checked before it asks for a GPU (one clear error each, exit code 2), and the decode
benchmark's targets-only run picks the target cases' compiled rows; the KDA layer comparison times the layers in
turn; the profiles' device time counts kernels, not the annotation ranges that span them."""

import pytest
import torch

from k3.bench import decode, kernels
from k3.cli.main import main


@pytest.mark.parametrize(
    "argv,message",
    [
        (["bench", "decode", "--cases", "train"], "k3 bench decode --cases takes targets, not 'train'"),
        (["bench", "kernels", "--cases", "targets"], "--cases applies to k3 bench model and decode only"),
    ],
)
def test_bad_cases_are_one_clear_error(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_without_a_gpu_it_says_so(capsys):
    assert main(["bench", "decode", "--cases", "targets"]) == 2
    assert "k3 bench needs a CUDA GPU" in capsys.readouterr().err


def test_it_prints_its_kernel_plan_before_it_runs(monkeypatch, capsys):
    """The plan under the fast backend, on the GPU, first (answered here without one: the benchmark is not run)."""
    from k3.ops import backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(backend, "_choice", backend.get_backend())
    for entry in backend.registered().values():
        monkeypatch.setattr(entry, "fast_ok", {})
    ran = []
    monkeypatch.setattr(kernels, "run", lambda **kw: ran.append(kw))
    assert main(["bench", "kernels", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kernel plan on cuda (K3_BACKEND=fast") and "kernel moe_small_groups" in out
    assert ran == [{"out_dir": None, "quick": True}]


def test_targets_run_the_compiled_rows_and_the_twin_at_128k_only():
    assert [decode.modes(b, t, False, targets=True) for b, t in decode.TARGET_CASES] == [("compiled",)] * 3
    assert [decode.modes(b, t, True, targets=True) for b, t in decode.TARGET_CASES] == [(), (), ("compiled",)]
    assert decode.modes(64, 32768, False) == ("graph", "eager", "compiled")  # the full run: unchanged


def test_layers_are_timed_in_turn_and_compared_by_their_medians():
    calls, clock = [], iter(range(100))
    fns = {"ours": lambda: None, "fla": lambda: None}

    def timer(fn, warmup, iters):  # a host whose speed drifts: each timing slower than the last
        calls.append((next(n for n, f in fns.items() if f is fn), warmup))
        return float(next(clock))

    med = kernels.interleaved_times(fns, rounds=5, timer=timer)
    assert calls == [("ours", 3), ("fla", 3)] + [("ours", 1), ("fla", 1)] * 4  # alternating, warm-up once each
    assert med == {"ours": 4.0, "fla": 5.0}  # medians of 0, 2, .., 8 and 1, 3, .., 9: the drift shared


def test_device_activity_counts_kernels_not_the_annotations_that_span_them():
    from types import SimpleNamespace

    from k3.bench.common import device_activity

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation)

    events = [
        event("phase: optimizer", cpu, True),
        event("phase: optimizer", cuda, True),  # a range, both sides
        event("Optimizer.step#K3Muon.step", cuda, True),
        event("aten::mm", cpu),
        event("nvjet_sm90_tst_256x128", cuda),
        event("Memcpy DtoD (Device -> Device)", cuda),
        event("Memset (Device)", cuda),
    ]
    assert [e.name for e in device_activity(events)] == [
        "nvjet_sm90_tst_256x128",
        "Memcpy DtoD (Device -> Device)",
        "Memset (Device)",
    ]
    assert [e.name for e in device_activity(events, memcpy=False)] == ["nvjet_sm90_tst_256x128", "Memset (Device)"]


def test_busy_seconds_is_the_union_of_the_intervals_that_start_in_the_window():
    from types import SimpleNamespace

    from k3.bench.common import busy_seconds

    def ev(start, end):
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end))

    events = [ev(30, 40), ev(0, 10), ev(5, 12), ev(6, 8), ev(20, 25)]  # (us) unsorted; overlaps count once
    assert busy_seconds(events) == 27e-6  # 0..12, 20..25, 30..40
    assert busy_seconds(events, 5, 30) == 12e-6  # those starting in [5, 30): 5..12 and 20..25
    assert busy_seconds(events, 31, 100) == 0.0 and busy_seconds([]) == 0.0


def test_profile_train_steps_device_timeline_splits_busy_and_idle_time_by_phase():
    """benchmarks/profile_train_step.py's timeline on fake events (us): a phase's span, the kernels inside it and
    the idle rest, per step; a phase range without device time is left out; the rest of the window is one row."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(__file__).parents[2] / "benchmarks" / "profile_train_step.py"
    spec = importlib.util.spec_from_file_location("profile_train_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cuda = torch.autograd.DeviceType.CUDA

    def ev(name, start, end, annotation=False):
        return SimpleNamespace(
            name=name, device_type=cuda, is_user_annotation=annotation, time_range=SimpleNamespace(start=start, end=end)
        )

    ms = 1000  # the profiler's clock is in us
    kernels = [ev("k", 0, 10 * ms), ev("k", 20 * ms, 30 * ms), ev("k", 40 * ms, 45 * ms), ev("k", 60 * ms, 100 * ms)]
    phases = [ev("phase: forward + loss", 0, 30 * ms, True), ev("phase: backward", 0, 0, True)]
    lines = module.device_timeline(phases + kernels, kernels, steps=2)
    rows = {line[:46].strip(): [float(v) for v in line[46:].split()] for line in lines[1:]}
    assert rows == {
        "phase: forward + loss": [15.0, 10.0, 5.0],  # ms per step: span, busy, idle
        "outside those ranges": [35.0, 22.5, 12.5],
        "window (first kernel to last)": [50.0, 32.5, 17.5],
    }


def test_floor_parts_time_each_part_once_and_scale_it_by_its_layers(monkeypatch):
    """k3.bench.floor on the tiny preset on the CPU (reference ops) with a timer that runs each part once and reports
    one second: every part runs forward and backward, a layer's time counts once per layer of its kind, Newton-Schulz
    covers every Muon matrix (a head of a per-head group, an expert, a whole matrix) in K3Muon's batches, the matrix
    products are 6N FLOPs per token at the given rate."""
    from k3.bench import floor
    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM
    from k3.ops import backend
    from k3.train.param_groups import param_groups_for

    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny"))
    cfg = model.config
    runs = []

    def timer(fn, warmup, iters):
        fn()
        runs.append(fn)
        return 1.0

    backend.set_backend("reference")
    try:
        parts = floor.floor_parts(model, batch=2, seq=16, matmul_rate=1e6, timer=timer, activated_params=1000.0)
    finally:
        backend.set_backend("auto")
    n_kda, n_mla = cfg.num_hidden_layers - len(cfg.mla_layers), len(cfg.mla_layers)
    groups = [g for g in param_groups_for(model, 1e-4) if g["kind"] != "adamw"]
    blocks = {
        "muon_head": lambda p, g: p.shape[0] // g["head_dim"],
        "muon_expert": lambda p, g: p.shape[0],
        "muon": lambda p, g: 1,
    }
    matrices = sum(blocks[g["kind"]](p, g) for g in groups for p in g["params"])
    shapes = {
        (i, (g["head_dim"], p.shape[1]) if g["kind"] == "muon_head" else tuple(p.shape[-2:]))
        for i, g in enumerate(groups)
        for p in g["params"]
    }  # a call per group and block shape
    calls = floor.muon_batches(model)
    assert sum(c[0] for c in calls) == matrices and len(calls) == len(shapes)  # tiny: each fits one call
    monkeypatch.setattr(floor, "NS_BATCH_BYTES", 2)  # below one block: each parameter its own call, never split
    assert [c[0] for c in floor.muon_batches(model)] == [blocks[g["kind"]](p, g) for g in groups for p in g["params"]]
    assert parts == {
        f"fla chunked KDA (fwd+bwd) x{n_kda}": n_kda,
        f"fla short convs (fwd+bwd) x{n_kda}": n_kda,
        f"MLA attention (fwd+bwd) x{n_mla}": n_mla,
        f"Newton-Schulz of {matrices} Muon matrices in {len(calls)} calls": 1.0,
        "matrix products at 100% of the bf16 rate": 6 * 1000.0 * 32 / 1e6,
    }
    assert len(runs) == 4
    kda = next(m for m in model.modules() if isinstance(m, floor.KimiDeltaAttention))
    assert kda.A_log.grad is not None and kda.q_conv1d.weight.grad is not None  # the backward ran


def test_kimi_linear_48b_smoke_checkpoint_phase(tmp_path):
    """benchmarks/kimi_linear_48b.py --smoke, checkpoint phase: written sharded, stream-loaded back in a fresh
    process to the same tensors, with the loader's host memory measured there."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "kimi_linear_48b.py"
    spec = importlib.util.spec_from_file_location("kimi_linear_48b", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = ["--smoke", "--device", "cpu", "--skip", "decode", "peer", "--workdir", str(tmp_path / "w")]
    assert module.main([*args, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "kimi-linear-48b-smoke.json").read_text())["rows"]
    assert not [r for r in rows if "error" in r], rows
    by_case = {r["case"]: r for r in rows}
    assert by_case["stream-load 4 layers"]["detail"].endswith("same tensors")
    assert 0 <= by_case["host memory while loading"]["value"] < 1.0  # GiB: a few MB of shards
    assert by_case["peak host RSS of the loading process"]["value"] > 0


def test_serve_load_benchmark_smoke(tmp_path):
    """benchmarks/serve_load.py against a live k3 serve (tiny random checkpoint): TTFT / TPOT per concurrency, and
    a shared prefix read from the prefix cache by the requests after the first."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--concurrency", "1,2", "--prompt", "32", "--output", "4", "--requests", "1", "--prefix", "64"]
    assert module.main([*argv, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "serve-load.json").read_text())["rows"]
    assert not [r for r in rows if "error" in r], rows
    load = [r for r in rows if r["phase"] == "load"]
    assert [r["requests"] for r in load] == [1, 2]
    assert all(0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"] and r["tpot_p50_ms"] > 0 for r in load)
    prefix = next(r for r in rows if r["phase"] == "prefix cache")
    assert "hit rate 66.7%" in prefix["detail"]  # 64 of the 96 prompt tokens: one block of 64


def test_precision_convergence_curves_and_arms(tmp_path):
    """benchmarks/precision_convergence.py: the curves are the mean / range over runs at the steps all logged
    (training loss as an EMA), and the arms must start with bf16."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "precision_convergence.py"
    spec = importlib.util.spec_from_file_location("precision_convergence", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dirs = []
    for i, losses in enumerate(((4.0, 3.0, 2.0), (6.0, 5.0, 4.0))):
        d = tmp_path / f"run{i}"
        d.mkdir()
        recs = [{"step": s, "loss": x, "val_loss": x + 1} for s, x in enumerate(losses)]
        if i == 0:
            recs.append({"step": 3, "loss": 1.0})  # only one run logged step 3
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        dirs.append(str(d))
    steps, mean, lo, hi = module.curves(dirs, "val_loss")
    assert steps.tolist() == [0, 1, 2] and mean.tolist() == [6.0, 5.0, 4.0] and lo.tolist() == [5.0, 4.0, 3.0]
    steps, mean, _, hi = module.curves(dirs, "loss")
    assert steps.tolist() == [0, 1, 2] and mean[1] == pytest.approx(0.9 * 5.0 + 0.1 * 4.0)
    with pytest.raises(SystemExit, match="bf16 first"):
        module.main(["--arms", "fp8,bf16"])


def test_bench_serve_on_cpu_writes_rows_per_concurrency(tmp_path):
    """``k3 bench serve`` on the CPU (tiny random checkpoint served by a k3 serve child): one row per concurrency
    with TTFT and TPOT percentiles in order, the engine's counters in the detail, and throughput over one client."""
    import json

    from k3.bench.serve import run

    rows = run(
        out_dir=str(tmp_path),
        quick=True,
        presets=("tiny",),
        device="cpu",
        concurrency=(1, 2),
        cases=((16, 4),),
        client_procs=1,
    )
    assert [r["concurrency"] for r in rows] == [1, 2] and all(r["requests"] == r["concurrency"] for r in rows)
    for r in rows:
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"] and 0 < r["tpot_p50_ms"] <= r["tpot_p90_ms"], r
        assert "prefill passes" in r["detail"] and "first token after" in r["detail"]
    assert "vs_c1" not in rows[0] and rows[1]["vs_c1"] == pytest.approx(
        rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    )
    assert json.loads((tmp_path / "serve.json").read_text())["rows"][1]["concurrency"] == 2
