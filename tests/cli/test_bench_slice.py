"""`k3 bench slice`: the smoke run (tiny layout, CPU) writes slice.{json,md} with finite numbers in every phase; the
byte accounting of the real k3-slice (meta device, nothing allocated) counts 4.25 bits a routed-expert weight; a
model built on the meta device and materialised gets the values its constructor would give."""

from __future__ import annotations

import json
import math

import torch

from k3.bench import slice as bench_slice
from k3.bench import slice_model
from k3.bench.decode import step_bytes
from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.quant.packed import PackedExperts


def test_smoke_run_writes_results(tmp_path):
    bench_slice.run(out_dir=str(tmp_path), smoke=True)
    data = json.loads((tmp_path / "slice.json").read_text())
    md = (tmp_path / "slice.md").read_text()
    assert "| " + " | ".join(bench_slice.COLUMNS) + " |" in md
    rows = data["rows"]
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    phases = {r["phase"] for r in rows}
    assert {"build", "decode", "decode parts", "experts op", "prefill", "bf16 vs packed"} <= phases
    for r in rows:
        for c in bench_slice.COLUMNS:
            v = r.get(c)
            if isinstance(v, float):
                assert math.isfinite(v), (c, r)
    decode = [r for r in rows if r["phase"] == "decode"]
    assert len(decode) == 4
    for r in decode:
        assert r["ms"] > 0 and r["step_GB"] > 0 and r["fraction_of_limit"] > 0
        assert 1 <= r["experts_hit"] <= min(8, 2 * r["batch"])
    assert data["meta"]["routed_expert_bytes_per_weight"] == 4.25 / 8
    assert len(data["meta"]["extrapolation"]) == 4
    assert "extrapolation (not measured)" in data["notes"]


def test_layer_times_and_extrapolation():
    """Per-layer parts from the step times with parts skipped, and K3's per-GPU step from them (68 KDA-MoE and 24
    MLA-MoE layers, 92 expert-parallel shares)."""
    cfg = get_preset("k3-slice")  # 3 KDA-MoE + 1 MLA-MoE layers
    parts = {"full": 10.0, "no_experts": 6.0, "mla_only": 3.0, "rest": 1.0}
    assert bench_slice.layer_times(cfg, parts) == {"kda": 1.0, "mla": 2.0, "experts": 1.0, "rest": 1.0}
    assert bench_slice.layer_times(cfg, {"full": 1.0}) is None
    rows, lines = bench_slice.extrapolate(cfg, {(8, 4096): parts}, {(8, "ep"): 0.5})
    assert rows[0]["step_ms"] == (1 + 68 * 1 + 24 * 2 + 92 * 0.5) * 1e3
    assert "128 rows over 14 experts" in lines[0] and "not measured" in lines[0]
    assert bench_slice.extrapolate(cfg, {(8, 4096): parts}, {}) == ([], [])


def test_k3_slice_byte_accounting_on_meta():
    cfg = get_preset("k3-slice")
    model = slice_model.build_meta_packed(cfg)
    assert all(t.is_meta for n, t in model.named_buffers() if n.endswith("_packed"))
    acc = slice_model.expert_accounting(model)
    per_layer = 896 * 3 * 3072 * 3584 * 4.25 / 8
    assert [r["layer"] for r in acc["layers"]] == [1, 2, 3, 4]
    for r in acc["layers"]:
        assert r["packed"] and r["weights"] == 896 * 3 * 3072 * 3584
        assert r["bytes"] == per_layer
    assert acc["bytes_per_weight"] == 4.25 / 8
    assert 62e9 < acc["bytes"] < 64e9
    held = slice_model.model_bytes(model)
    assert held["routed_experts"] == acc["bytes"]
    assert sum(held.values()) - held["routed_experts"] < 15e9  # the rest of the slice in bf16
    b, c = 64, 32768
    hit = 896 * (1 - (1 - 16 / 896) ** b)
    assert slice_model.expected_hit(cfg, b) == hit
    assert slice_model.slice_step_bytes(model, b, c) == step_bytes(model, b, c) + 4 * per_layer * hit / 896
    assert slice_model.slice_step_bytes(model, b, c, hits=[10] * 4) == step_bytes(model, b, c) + 40 * per_layer / 896


def test_materialise_matches_the_constructor():
    cfg = slice_model.smoke_config()
    torch.manual_seed(0)
    ref = K3ForCausalLM(cfg).cast(torch.bfloat16)
    built = slice_model.build_packed(cfg, "cpu")
    ref_state, state = ref.state_dict(), built.state_dict()
    for name, t in state.items():
        assert torch.isfinite(t.float()).all(), name
        r = ref_state.get(name)
        if r is None:  # packed banks: codes and scales in range
            assert name.endswith(("_packed", "_scale")), name
            if name.endswith("_scale"):
                assert slice_model.SCALES[0] <= int(t.min()) and int(t.max()) < slice_model.SCALES[1]
            continue
        assert r.dtype == t.dtype and r.shape == t.shape, name
        if r.numel() > 1 and bool((r == r.flatten()[0]).all()) and not name.endswith("e_score_correction_bias"):
            assert torch.equal(r, t), name  # constant at construction (norms, AttnRes queries): the same here
    assert sum(isinstance(m, PackedExperts) for m in built.modules()) == 4
    assert built.model.layers[1].block_sparse_moe.experts.dtype == torch.bfloat16
