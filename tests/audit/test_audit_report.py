"""`k3 audit` report: current GPU results over older ones, missing files said, generated sentences that follow their
tables, the activated share, and AttnRes measured at K3's depth."""

import json
import re

import pytest

from k3.audit import attnres, longctx
from k3.audit.accounting import report
from k3.audit.longctx import measured_decode
from k3.audit.measure import attn_res_depth
from k3.audit.report import _attn_res_depth, _measured_decode, activated_share, padding_sentence, run_audit
from k3.audit.paths import by_path
from k3.audit.report_serving import _measured_slice, _serving_load
from k3.audit.router import router_frontier
from k3.config import get_preset


def _results(path, rows, **meta):
    path.write_text(json.dumps({"meta": {"device": "GPU-X", "time": "2026-01-01 00:00:00", **meta}, "rows": rows}))
    return path


def _row(model, batch, context, ms):
    return {"model": model, "batch": batch, "context": context, "ms_per_step": ms, "tokens_per_s": batch / ms * 1e3}


@pytest.fixture
def decode_files(tmp_path):
    current = _results(
        tmp_path / "decode-targets.json",
        [
            _row("hybrid 3:1 compiled + CUDA graph", 64, 32768, 2.914),
            {**_row("full-MLA twin compiled + CUDA graph", 16, 131072, 7.6), "hybrid_speedup": 2.86},
            _row("hybrid 3:1 compiled + CUDA graph", 16, 131072, 2.657),
        ],
        config="bench-model-x",
    )
    old = _results(
        tmp_path / "decode.json",
        [
            _row("hybrid 3:1", 64, 32768, 7.969),
            {**_row("full-MLA twin", 64, 32768, 14.44), "hybrid_speedup": 1.81},
            _row("hybrid 3:1", 1, 4096, 4.085),
            {**_row("transformers KimiLinear generate", 16, 4096, 1.0), "ms_per_step": -5.0},
        ],
    )
    return current, old


def test_decode_rows_come_from_the_current_file_first(decode_files):
    g = measured_decode(decode_files)
    by_case = {(r["model"].split()[0], r["batch"], r["context"]): r for r in g["rows"] if r["valid"]}
    assert by_case[("hybrid", 64, 32768)]["ms_per_step"] == 2.914
    assert by_case[("hybrid", 64, 32768)]["source"] == "decode-targets.json"
    assert by_case[("hybrid", 1, 4096)]["source"] == "decode.json"  # absent from the current file: fallback
    assert not any(r["ms_per_step"] == 7.969 for r in g["rows"])
    # the old twin row stays, but its ratio was against the superseded hybrid row: not shown
    twin = by_case[("full-MLA", 64, 32768)]
    assert "hybrid_speedup" not in twin and twin["hybrid_speedup_hidden"] == 1.81
    assert [s["hybrid_speedup"] for s in g["speedups"]] == [2.86]
    text = "\n".join(_measured_decode(g))
    assert "| 2.914 |" in text and "7.969" not in text and "2.86x at B=16 / 128K" in text
    assert "`decode-targets.json`" in text and "`decode.json`" in text
    assert "`bench-model-x`" in text and "1.3B" not in text  # the label is the file's, not a fixed string
    assert "transformers KimiLinear generate B=16 (`decode.json`)" in text  # the broken row is listed


def test_the_repository_results_give_the_current_targets():
    if not longctx.DECODE_FILES[0].is_file():
        pytest.skip("no decode-targets.json in this checkout")
    g = measured_decode()
    row = next(r for r in g["rows"] if r["valid"] and r["model"].startswith("hybrid") and r["batch"] == 64)
    assert row["context"] == 32768 and row["source"] == "decode-targets.json"


def test_missing_results_files_are_said_not_fatal(tmp_path, monkeypatch, decode_files):
    g = measured_decode((tmp_path / "absent.json", decode_files[1]))
    assert g["files"][0] == {
        "name": "absent.json",
        "path": str(tmp_path / "absent.json"),
        "read": False,
        "why": "not found",
    }
    assert "`benchmarks/results/absent.json`: not found" in "\n".join(_measured_decode(g))
    (tmp_path / "broken.json").write_text("{not json")
    monkeypatch.setattr(longctx, "DECODE_FILES", (tmp_path / "absent.json", tmp_path / "broken.json"))
    monkeypatch.setattr(attnres, "GPU_FILES", (tmp_path / "absent-attn_res.json",))
    monkeypatch.setattr(longctx, "SERVE_LOAD_FILE", tmp_path / "absent-serve-load.json")
    monkeypatch.setattr(longctx, "SLICE_FILE", tmp_path / "absent-slice.json")
    a = run_audit(get_preset("tiny"), tmp_path / "out", source="test", contexts=(256,))
    text = (tmp_path / "out" / "report.md").read_text()
    assert "No GPU decode measurements found" in text
    assert "absent.json` (not found)" in text and "broken.json` (unreadable (JSONDecodeError))" in text
    assert "No GPU AttnRes measurements found (`benchmarks/results/absent-attn_res.json` (not found))" in text
    assert a["long_context"]["measured_gpu"]["rows"] == []
    assert "No serving-under-load results (`benchmarks/results/serve-load.json`: not found)" in text
    assert "No measurement at K3's widths (`benchmarks/results/slice.json`: not found" in text


def test_serving_under_load_comes_from_its_results_file(tmp_path, monkeypatch):
    path = tmp_path / "serve-load.json"
    rows = [
        {
            "phase": "load",
            "case": "concurrency 4",
            "requests": 8,
            "ttft_p50_ms": 12.5,
            "ttft_p90_ms": 20.0,
            "tpot_p50_ms": 3.25,
            "tokens_per_s": 900.0,
            "detail": "256-token prompts",
        },
        {
            "phase": "prefix cache",
            "case": "512-token shared prefix",
            "requests": 4,
            "ttft_p50_ms": 5.0,
            "detail": "hit rate 94.1%",
        },
    ]
    path.write_text(json.dumps({"meta": {"device": "NVIDIA H200", "time": "t", "checkpoint": "c"}, "rows": rows}))
    monkeypatch.setattr(longctx, "SERVE_LOAD_FILE", path)
    s = longctx.measured_serving(longctx.SERVE_LOAD_FILE)
    text = "\n".join(_serving_load(s))
    assert "NVIDIA H200" in text and "| concurrency 4 | 8 | 12.5 | 20.0 | 3.25 | 900.00 | 256-token prompts |" in text
    assert "hit rate 94.1%" in text


def test_k3_widths_come_from_the_slice_results(tmp_path):
    """The slice's decode rows (only the decode phase, valid times) and its extrapolation, labelled as one."""
    decode = {"phase": "decode", "case": "k3-slice packed MXFP4, CUDA graph", "batch": 64, "context": 32768}
    decode |= {"ms": 17.9, "tokens_per_s": 3575.5, "step_GB": 54.66, "limit_ms": 12.8, "fraction_of_limit": 0.7153}
    rows = [
        decode,
        {"phase": "decode parts", "case": "routed experts skipped", "batch": 64, "context": 32768, "ms": 6.3},
        {"phase": "decode", "case": "k3-slice", "batch": 64, "context": 131072, "error": "skipped: cache"},
    ]
    extra = {"batch_per_gpu": 64, "context": 32768, "gpus": 64, "step_ms": 169.4, "tokens_per_s_per_gpu": 378.0}
    extra["tokens_per_s_cluster"] = 24176.0
    meta = {"config": "k3-slice", "copy_bandwidth_TBps": 4.25, "routed_expert_GB": 62.9, "extrapolation": [extra]}
    path = _results(tmp_path / "slice.json", rows, routed_expert_bytes_per_weight=0.53125, **meta)
    s = longctx.measured_slice(path)
    assert [r["context"] for r in s["rows"]] == [32768]
    text = "\n".join(_measured_slice(s))
    assert "GPU-X" in text and "model `k3-slice`" in text and "0.5312 bytes a weight" in text
    assert "| 64 | 32K | 17.90 | 3,576 | 54.7 | 12.80 | 71.5% |" in text
    assert "Extrapolated, not measured" in text and "| 64 | 32K | 169.4 | 378 | 24,176 |" in text


def _pct(x):
    return f"{100 * x:.1f}%"


@pytest.mark.parametrize("multiple", [8, 128])
def test_padding_sentence_follows_the_table(multiple):
    rows = router_frontier(get_preset("k3"))["uniform_exact"]
    text = padding_sentence(rows, multiple, "rows")
    key = f"padding_{multiple}"
    under = next(r for r in rows if r[key] <= 0.5)
    before = [r for r in rows if r["tokens"] < under["tokens"]][-1]
    assert before[key] > 0.5
    for r in (before, under, rows[-1]):
        assert f"{_pct(r[key])}" in text and f"{r['mean_load']:.1f}" in text and f"T = {r['tokens']})" in text
    assert f"more than half of the rows up to a mean load of {before['mean_load']:.1f}" in text
    assert f"at most half from {under['mean_load']:.1f} on" in text
    if multiple == 128:  # the table's 42.9% at 73 tokens per expert is stated as such, not as "most rows"
        assert "42.9% at 73.1 (T = 4096)" in text


def test_padding_sentence_when_the_table_never_crosses_half():
    rows = [{"tokens": t, "mean_load": t / 10, "padding_8": p} for t, p in ((64, 0.9), (256, 0.7))]
    assert "more than half of the rows at every step in the table" in padding_sentence(rows, 8, "rows")
    rows = [{"tokens": t, "mean_load": t / 10, "padding_8": p} for t, p in ((64, 0.3), (256, 0.1))]
    assert "at most half of the rows at every step in the table" in padding_sentence(rows, 8, "rows")


def test_activated_share_of_k3():
    cfg = get_preset("k3")
    rep = report(cfg)
    a = {
        "paths": by_path(cfg, rep, 4096),
        "params_total": rep["params_total"],
        "params_activated": rep["params_activated"],
    }
    s = activated_share(a, cfg)
    assert f"{100 * s['activated_share']:.2f}%" == "3.75%" and f"{100 * s['slot_share']:.2f}%" == "1.79%"
    assert s["routed_activated"] + s["always_on"] == pytest.approx(rep["params_activated"])
    assert "shared_experts" in s["always_on_by_path"] and "embedding" not in s["always_on_by_path"]


def test_attn_res_at_k3_depth():
    d = attn_res_depth(get_preset("k3"), tokens=16, repeats=1, hidden=64, modes=("none", "snapshot", "full"))
    assert (
        d["layers"] == 93 and d["block_size"] == 12 and [r["mode"] for r in d["rows"]] == ["none", "snapshot", "full"]
    )
    saved = {r["mode"]: r["saved_bytes"] for r in d["rows"]}
    # snapshot keeps 8 block snapshots and full every sub-layer output alive for the backward pass on top of what
    # the plain stream saves; full's sources include every snapshot's
    assert saved["none"] < saved["snapshot"] <= saved["full"]
    flops = {r["mode"]: r["mix_flops_per_token"] for r in d["rows"]}
    assert flops["none"] == 0 < flops["snapshot"] < flops["full"]
    assert all(r["ms"] > 0 for r in d["rows"])
    text = "\n".join(_attn_res_depth(d))
    assert "93 layers" in text and re.search(r"\| full \| [\d.]+ [KM]iB \| [\d.]+ \|", text)


def test_attn_res_depth_from_a_gpu_results_file(tmp_path):
    """benchmarks/attn_res_depth.py's file is read for its own preset only and rendered with the GPU's name and
    the peak-memory columns; another preset's file is named as not measured."""
    import json

    from k3.audit.attnres import measured_depth_gpu

    d = attn_res_depth(get_preset("tiny"), tokens=8, repeats=1, hidden=64, modes=("none", "full"))
    for r in d["rows"]:  # what a CUDA run adds
        r["peak_bytes"] = 2**20 if r["mode"] == "none" else 3 * 2**19
    d["rows"][1]["peak_vs_none"] = 1.5
    meta = {k: v for k, v in d.items() if k != "rows"} | {"device": "NVIDIA H200", "dtype": "bf16 autocast"}
    path = tmp_path / "attn_res_depth.json"
    path.write_text(json.dumps({"meta": meta | {"preset": "tiny", "time": "t0"}, "rows": d["rows"], "notes": ""}))
    g = measured_depth_gpu(path, "tiny")
    text = "\n".join(_attn_res_depth(g))
    assert "GPU)" in text and "NVIDIA H200 under bf16 autocast" in text and "attn_res_depth.json` (t0)" in text
    assert re.search(r"\| full \|.*\| 1\.50 MiB \| 1\.500 \| [\d.]+ \|$", text, re.M)
    assert "not measured" not in text
    assert "preset 'tiny', not 'k3'" in measured_depth_gpu(path, "k3")["why"]
    assert "not found" in measured_depth_gpu(tmp_path / "none.json", "k3")["why"]


def test_gpu_prefill_rows_from_the_model_benchmark(tmp_path):
    """k3 bench model's prefill rows become one row per length (hybrid vs twin, the twin's time over the hybrid's);
    an OOM row is shown as its error; a file without prefill rows is named as such."""
    import json

    from k3.audit.longctx import measured_prefill
    from k3.audit.report_serving import _prefill

    rows = [
        {"case": "train small-1b B8 T4096", "ms": 300.0},
        {"case": "prefill hybrid 131072", "ms": 1700.0, "peak_GiB": 19.0, "model": "small-1b"},
        {"case": "prefill hybrid 1048576", "ms": 24000.0, "peak_GiB": 132.0, "model": "small-1b"},
        {"case": "prefill full-MLA 131072", "ms": 1530.0, "peak_GiB": 19.0, "model": "small-1b full-MLA twin"},
        {"case": "prefill full-MLA 1048576", "error": "OOM: out of memory"},
    ]
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"meta": {"device": "NVIDIA H200", "time": "t0"}, "rows": rows}))
    p = measured_prefill(path)
    assert [r["tokens"] for r in p["rows"]] == [131072, 1048576] and p["device"] == "NVIDIA H200"
    assert p["rows"][0]["twin_over_hybrid"] == pytest.approx(0.9) and "twin_over_hybrid" not in p["rows"][1]
    text = "\n".join(_prefill(p))
    assert "| 128K | small-1b | 1.70 s (77.1K tokens/s, 19 GiB) |" in text and "OOM: out of memory" in text
    path.write_text(json.dumps({"meta": {}, "rows": rows[:1]}))
    assert "no prefill rows" in "\n".join(_prefill(measured_prefill(path)))
