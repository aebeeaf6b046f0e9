"""`k3 info`: the K3 accounting lands on the report's 2.78T / 104.2B; every preset answers in seconds."""

import json
import subprocess
import sys
import time

import pytest

from k3.cli.main import main
from k3.config import PRESETS


def info_json(capsys, preset, *extra):
    assert main(["info", "--preset", preset, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_k3_totals_match_the_report(capsys):
    r = info_json(capsys, "k3")
    assert abs(r["params_total"] / 2.78e12 - 1) <= 0.005, r["params_total"]
    assert abs(r["params_activated"] / 104.2e9 - 1) <= 0.005, r["params_activated"]
    by = r["params_by_path"]
    # docs/architecture.md#accounting per-path figures (routed 2.7227T, KDA 30.6B, MLA 5.6B, shared 12.2B, latent 4.7B)
    assert abs(by["routed_experts"] / 2.7227e12 - 1) < 0.001
    assert abs(by["kda"] / 30.6e9 - 1) < 0.01 and abs(by["mla"] / 5.6e9 - 1) < 0.01
    assert abs(by["shared_experts"] / 12.2e9 - 1) < 0.01 and abs(by["latent_proj"] / 4.7e9 - 1) < 0.01
    layers = r["layers"]
    assert sum(la["mixer"] == "kda" for la in layers) == 69 and sum(la["mixer"] == "mla" for la in layers) == 24
    assert [la["ffn"] for la in layers].count("dense") == 1 and layers[-1]["mixer"] == "mla"
    assert max(la["attn_res_block"] for la in layers) == 7  # 7 full blocks of 12 + a block of 9
    assert abs(r["params_vision_encoder"] / 401e6 - 1) <= 0.02, r["params_vision_encoder"]  # architecture.md#vision
    assert r["params_vision"] == r["params_vision_encoder"] + r["params_vision_projector"]
    assert r["params_activated_with_embedding"] - r["params_activated"] == 163840 * 7168


def test_k3_cache_bytes(capsys):
    r = info_json(capsys, "k3", "--context", "1048576")
    c = r["cache_per_sequence"]
    assert c["kda_state_bytes"] == 69 * 96 * 128 * 128 * 4  # 6 MiB per layer, fp32
    assert c["mla_cache_bytes"] == 24 * 576 * 2 * 1048576  # 27 KiB per token, ~27 GiB at 1M


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_in_seconds(capsys, preset):
    t0 = time.perf_counter()
    r = info_json(capsys, preset)
    assert time.perf_counter() - t0 < 20
    assert {"params_total", "params_activated", "layers"} <= set(r)
    assert all(
        set(la) >= {"mixer", "ffn"} and la["mixer"] in ("kda", "mla") and la["ffn"] in ("dense", "moe")
        for la in r["layers"]
    )
    assert 0 < r["params_activated"] < r["params_total"]


def test_text_output_and_errors(capsys):
    assert main(["info", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "activated per token" in out and "mla" in out
    assert main(["info", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "k3", "info", "--preset", "small", "--json"], capture_output=True, text=True, check=True
    ).stdout
    r = json.loads(out)
    assert 20e6 <= r["params_total"] <= 50e6


def test_kernels_prints_the_whole_plan(capsys):
    from k3.ops.kernel_plan import plan, plan_table

    assert main(["info", "--kernels", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == plan_table("cpu") + "\n"
    assert main(["info", "--kernels", "--device", "cpu", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["device"] == "cpu" and [(x["name"], x["runs"], x["why"]) for x in r["rows"]] == plan("cpu")
    assert main(["info", "--kernels", "--device", "tpu"]) == 2
    assert "--device='tpu' must be auto, cpu or cuda[:N]" in capsys.readouterr().err
