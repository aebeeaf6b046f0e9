"""`k3 audit`: the k3 report lands on K3's published figures; the analytic pieces are right; --ckpt; bad args."""

import itertools
import json
import time

import pytest
import torch

from k3.audit.attnres import attn_res_costs
from k3.audit.longctx import crossovers, decode_step_bytes
from k3.audit.paths import distinct_experts
from k3.audit.report import FIGURES
from k3.audit.router import all_to_all, distinct_ranks, simulate_routes, uniform_overflow, uniform_padding
from k3.cli.main import main
from k3.config import get_preset
from k3.checkpoint.format import save_pretrained
from k3.model.router_stats import drop_fraction, expert_loads

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def k3_audit(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit_k3")
    t0 = time.perf_counter()
    assert main(["audit", "--preset", "k3", "--out", str(out)]) == 0
    return out, time.perf_counter() - t0


def test_k3_report_matches_the_spec(k3_audit):
    out, seconds = k3_audit
    assert seconds < 60
    a = json.loads((out / "audit.json").read_text())
    assert abs(a["params_total"] / 2.78e12 - 1) <= 0.005
    assert abs(a["params_activated"] / 104.2e9 - 1) <= 0.005
    assert a["spec_check"] and all(c["ok"] for c in a["spec_check"]), [c for c in a["spec_check"] if not c["ok"]]
    text = (out / "report.md").read_text()
    assert "**2.78T parameters in total, 104.19B activated per token**" in text
    for figure in ("2.7227T", "12.2B", "4.7B", "0.6B", "5.6B", "30.6B", "0.73B", "1.17B"):
        assert f"| {figure} |" in text, figure
    for name in FIGURES:
        data = (out / name).read_bytes()
        assert data[:8] == PNG and len(data) > 5000, name
        assert f"]({name})" in text
    rec = a["recipe"]
    assert rec["schedule"] == "23 x [KDA, KDA, KDA, MLA] + MLA" and len(rec["layers"]) == 93
    assert rec["attn_res_blocks"][-1] == [84, 92]
    hits = {r["batch"]: r["distinct_per_layer"] for r in a["expert_stream"]["rows"]}
    assert [round(hits[b]) for b in (1, 4, 16, 64)] == [16, 62, 224, 613]


def test_distinct_experts_per_decode_step():
    assert [round(distinct_experts(896, 16, b)) for b in (1, 4, 16, 64)] == [16, 62, 224, 613]
    assert distinct_experts(896, 16, 1024) == pytest.approx(896, abs=1e-3)


def test_decode_step_bytes_with_mxfp4_experts():
    """The bound's MXFP4 column: the routed experts hit at 4.25 bits a weight instead of bf16's 16, the rest as is."""
    from k3.audit.accounting import report

    cfg = get_preset("k3")
    rep = report(cfg)
    b = decode_step_bytes(cfg, rep, 64, 32768)
    per_expert = rep["params_routed_experts"] / 896
    assert b["experts"] == per_expert * distinct_experts(896, 16, 64) * 2
    assert b["experts_mxfp4"] == b["experts"] * 4.25 / 16
    assert b["total_mxfp4"] == pytest.approx(b["total"] - b["experts"] * (1 - 4.25 / 16))


def test_kda_vs_mla_crossover_is_about_5_5k_tokens():
    x = crossovers(get_preset("k3"))
    assert abs(x["layer_state_vs_latent"] / 5500 - 1) < 0.05
    assert x["kda_state_per_layer"] == 96 * 128 * 128 * 4 and x["mla_bytes_per_token"] == 576 * 2
    assert x["layer_state_vs_latent"] < x["hybrid_vs_full_mla"] < 2 * x["layer_state_vs_latent"]


def test_latent_dispatch_halves_all_to_all_bytes():
    cfg = get_preset("k3")
    for ranks in (8, 64):
        a = all_to_all(cfg, ranks)
        assert a["bytes_z"] == pytest.approx(a["bytes_x"] / 2)
        assert 1 <= a["distinct_ranks"] <= min(ranks, 16)


def test_distinct_ranks_is_exact():
    e, k, r = 12, 3, 4  # brute force over every k-subset, contiguous placement of 3 experts per rank
    subsets = list(itertools.combinations(range(e), k))
    brute = sum(len({x // (e // r) for x in s}) for s in subsets) / len(subsets)
    assert distinct_ranks(e, k, r) == pytest.approx(brute)


def test_capacity_1_25_drops_less_than_1_0_under_uniform_routing():
    for tokens in (256, 4096):
        assert uniform_overflow(tokens, 896, 16, 1.25) < uniform_overflow(tokens, 896, 16, 1.0)
    # the exact expectation agrees with a seeded simulation through balance.drop_fraction
    gen = torch.Generator().manual_seed(0)
    loads = expert_loads(simulate_routes(4096, 896, 16, 0.0, gen), 896)
    assert float(drop_fraction(loads, 16, 4096, 1.0)) == pytest.approx(uniform_overflow(4096, 896, 16, 1.0), rel=0.15)
    assert uniform_padding(64, 896, 16, 128) > 0.9 > uniform_padding(65536, 896, 16, 128)


def test_attn_res_source_counts():
    c = attn_res_costs(get_preset("k3"))
    assert c["none"]["live_vectors"] == 1 and c["none"]["flops_per_token"] == 0
    assert c["snapshot"]["max_sources"] == 9  # 8 block snapshots (the first is the embedding) + the stream
    assert c["full"]["max_sources"] == 2 * 93 + 1


def test_ckpt_audit_and_measure(tmp_path):
    from k3.audit.measure import serving
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(0)
    save_pretrained(K3ForCausalLM(get_preset("tiny")), tmp_path / "ckpt")
    out = tmp_path / "out"
    assert main(["audit", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--contexts", "256,1024"]) == 0
    text = (out / "report.md").read_text()
    assert "checkpoint" in text and "not checked here" in text  # tiny is not K3-shaped: no spec check
    a = json.loads((out / "audit.json").read_text())
    assert a["long_context"]["contexts"] == [256, 1024] and a["config"]["hidden_size"] == 64
    m = serving(get_preset("tiny"), prompt_len=128, batches=(1,), decode_steps=2, repeats=1)
    hit = [r for r in m["prefix_cache"] if r["request"].startswith("hit")][0]
    assert hit["cached_tokens"] == 64 and all(r["decode_tokens_per_s"] > 0 for r in m["rows"])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--preset", "tiny", "--contexts", "0,abc"], "--contexts"),
        (["--preset", "tiny", "--context", "-1"], "--context=-1"),
        (["--preset", "tiny", "--zipf", "x"], "--zipf"),
        (["--ckpt", "/nonexistent/dir"], "neither a checkpoint"),
    ],
)
def test_bad_arguments_give_one_clear_error(tmp_path, capsys, argv, needle):
    assert main(["audit", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3 audit: error:") and needle in err and "\n" not in err


@pytest.mark.parametrize("argv", [[], ["--preset", "tiny", "--ckpt", "x"]])
def test_source_is_required_and_exclusive(tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["audit", *argv, "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--preset" in capsys.readouterr().err
