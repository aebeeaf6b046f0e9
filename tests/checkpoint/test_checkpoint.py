"""Checkpoint save/load: round trips, formats, integrity errors, atomicity."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import k3
import k3.checkpoint.format as ckpt
from k3.cli.main import main
from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.checkpoint.format import save_pretrained
from tests.helpers import KIMI_LINEAR_STYLE

KIMI_LINEAR_R16 = {**KIMI_LINEAR_STYLE, "kda.forget_gate_rank": 16, "kda.output_gate_rank": 16}  # low-rank gates


def random_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = K3ForCausalLM(cfg)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("_res_proj.weight", "e_score_correction_bias")):
                t.normal_(0, 0.1)
    return model


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_round_trip_is_bit_exact(tmp_path, preset):
    model = random_model(get_preset(preset))
    save_pretrained(model, tmp_path / "ck", max_shard_bytes=2**20)
    assert (tmp_path / "ck" / ckpt.INDEX).is_file()  # sharded
    loaded = k3.from_pretrained(tmp_path / "ck")
    assert loaded.config == model.config
    assert_same(model, loaded)


def test_bf16_round_trip_keeps_fp32_router(tmp_path):
    model = random_model(get_preset("tiny")).cast(torch.bfloat16)
    save_pretrained(model, tmp_path / "ck")
    loaded = k3.from_pretrained(tmp_path / "ck", dtype=torch.bfloat16)
    assert_same(model, loaded)
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_k3_config_json_uses_the_released_keys(tmp_path):
    save_pretrained(random_model(get_preset("tiny")), tmp_path / "ck")
    d = json.loads((tmp_path / "ck" / "config.json").read_text())
    lac = d["linear_attn_config"]
    assert lac["full_attn_layers"] == [4, 5] and lac["kda_layers"] == [1, 2, 3]  # 1-indexed
    assert lac["gate_lower_bound"] == -5.0 and lac["use_full_rank_gate"] is True
    assert d["attn_res_block_size"] == 2 and d["routed_expert_hidden_size"] == 32 and d["latent_moe_use_norm"]
    assert d["hidden_act"] == "situ" and d["activation_situ_beta"] == 4.0 and d["activation_situ_linear_beta"] == 25.0
    assert d["mla_use_nope"] is True and d["mla_use_output_gate"] is True
    assert d["model_type"] == "kimi_k3" and d["architectures"] == ["KimiK3ForCausalLM"]  # K3's features: K3's name


def test_checkpoint_written_before_still_loads(tmp_path):
    """A checkpoint as earlier versions wrote it (K3's keys named kimi_linear, no auto_map, no code files) loads."""
    from pathlib import Path

    model = random_model(get_preset("tiny"))
    save_pretrained(model, tmp_path / "ck")
    old = Path(__file__).parents[1] / "config" / "data" / "tiny_config_kimi_linear_named.json"
    (tmp_path / "ck" / "config.json").write_text(old.read_text())
    for name in ("configuration_k3.py", "modeling_k3.py"):
        os.remove(tmp_path / "ck" / name)
    sums = ckpt.read_checksums(tmp_path / "ck")
    (tmp_path / "ck" / ckpt.CHECKSUMS).write_text(json.dumps({"sha256": {ckpt.SINGLE: sums[ckpt.SINGLE]}}))
    ckpt.verify_files(tmp_path / "ck")
    assert_same(model, k3.from_pretrained(tmp_path / "ck"))


def test_convert_k3_kimi_linear_k3_is_exact(tmp_path):
    model = random_model(get_preset("tiny").replace(**KIMI_LINEAR_R16))
    save_pretrained(model, tmp_path / "a")
    assert main(["convert", "--from", str(tmp_path / "a"), "--to", str(tmp_path / "b"), "--format", "kimi_linear"]) == 0
    assert main(["convert", "--from", str(tmp_path / "b"), "--to", str(tmp_path / "c"), "--format", "k3"]) == 0
    back = k3.from_pretrained(tmp_path / "c")
    assert_same(model, back)
    mid = json.loads((tmp_path / "b" / "config.json").read_text())
    assert "k3" not in mid and "attn_res_block_size" not in mid


def test_kimi_linear_export_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = random_model(get_preset("tiny").replace(**KIMI_LINEAR_R16)).eval()
    save_pretrained(model, tmp_path / "kl", fmt="kimi_linear")
    ref = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path / "kl").eval()
    ids = torch.randint(0, 512, (2, 70))
    with torch.no_grad():
        err = (ref(input_ids=ids).logits - model(ids).logits).abs().max().item()
    assert err <= 1e-4


def test_kimi_linear_format_refuses_k3_features(tmp_path):
    with pytest.raises(ValueError, match="cannot write a kimi_linear config: attn_res.mode"):
        save_pretrained(random_model(get_preset("tiny")), tmp_path / "x", fmt="kimi_linear")
    assert not (tmp_path / "x").exists()


def test_transformers_runtime_names_load(tmp_path):
    """Fused conv1d, forget_gate.*, mlp.experts.gate_up_proj / down_proj, A_log [1,1,H,1]."""
    transformers = pytest.importorskip("transformers")
    model = random_model(get_preset("tiny").replace(**KIMI_LINEAR_R16)).eval()
    save_pretrained(model, tmp_path / "kl", fmt="kimi_linear")
    ref = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path / "kl")
    runtime = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("conv1d.weight") and ".q_conv1d" not in k for k in runtime)
    assert any(k.endswith("experts.gate_up_proj") for k in runtime)
    os.remove(tmp_path / "kl" / "model.safetensors")
    os.remove(tmp_path / "kl" / ckpt.CHECKSUMS)
    save_file(runtime, tmp_path / "kl" / "model.safetensors")
    assert_same(model, k3.from_pretrained(tmp_path / "kl"))


def test_release_variants_zero_padded_A_log_and_prefix(tmp_path):
    model = random_model(get_preset("tiny"))
    save_pretrained(model, tmp_path / "ck")
    tensors = ckpt.read_tensors(tmp_path / "ck")
    varied = {
        "language_model." + k: (torch.cat([v.reshape(-1), torch.zeros(6)]) if k.endswith("A_log") else v)
        for k, v in tensors.items()
    }
    os.remove(tmp_path / "ck" / ckpt.CHECKSUMS)
    save_file(varied, tmp_path / "ck" / "model.safetensors")
    assert_same(model, k3.from_pretrained(tmp_path / "ck"))


@pytest.fixture
def saved(tmp_path):
    model = random_model(get_preset("tiny"))
    save_pretrained(model, tmp_path / "ck")
    return model, tmp_path / "ck"


def test_truncated_file(saved):
    _, path = saved
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupted"):
        k3.from_pretrained(path)
    with pytest.raises(ValueError, match="truncated or corrupted"):
        k3.from_pretrained(path, verify=False)


def test_corrupted_data_and_header(saved):
    _, path = saved
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256"):
        k3.from_pretrained(path)
    data[10:20] = b"\x00garbage!!"
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        k3.from_pretrained(path, verify=False)


def test_wrong_shape_missing_and_unexpected(saved):
    _, path = saved
    tensors = ckpt.read_tensors(path)
    os.remove(path / ckpt.CHECKSUMS)
    bad = dict(tensors)
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.randn(7, 64)
    save_file(bad, path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"shape mismatch: model.layers.0.self_attn.q_proj.weight: checkpoint \(7, 64\)"
    ):
        k3.from_pretrained(path)
    bad = dict(tensors)
    del bad["model.norm.weight"]
    bad["model.extra.weight"] = torch.zeros(3)
    save_file(bad, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): \['model.norm.weight'\].*unexpected 1"):
        k3.from_pretrained(path)
    bad = dict(tensors)
    bad["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    save_file(bad, path / "model.safetensors")
    with pytest.raises(ValueError, match="non-floating"):
        k3.from_pretrained(path)


def test_bad_config_and_missing_files(saved, tmp_path):
    _, path = saved
    with pytest.raises(FileNotFoundError, match="does not exist"):
        k3.from_pretrained(tmp_path / "nope")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        k3.from_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        k3.from_pretrained(path)
    os.remove(path / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        k3.from_pretrained(path)


def test_interrupted_save_keeps_previous_checkpoint(saved, monkeypatch):
    old, path = saved
    new = random_model(get_preset("tiny"), seed=1)
    calls = {"n": 0}
    real = ckpt.save_file

    def failing_save(*args, **kwargs):
        calls["n"] += 1
        real(*args, **kwargs)
        if calls["n"] == 2:
            raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt, "save_file", failing_save)
    with pytest.raises(OSError, match="simulated"):
        save_pretrained(new, path, max_shard_bytes=2**16)
    assert_same(old, k3.from_pretrained(path))
    assert sorted(os.listdir(path.parent)) == ["ck"]  # no half-written directory left behind
    monkeypatch.setattr(ckpt, "save_file", real)
    save_pretrained(new, path)  # overwriting an existing checkpoint swaps it in whole
    assert_same(new, k3.from_pretrained(path))
    assert sorted(os.listdir(path.parent)) == ["ck"]


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path):
    from k3.fs import atomic_file, atomic_write_text

    target = tmp_path / "latest"
    atomic_write_text(target, "step-000001")
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_file(target) as tmp:
            tmp.write_text("step-0000")  # half written, then the writer dies
            raise RuntimeError("interrupted")
    assert target.read_text() == "step-000001"
    atomic_write_text(target, "step-000002")
    assert target.read_text() == "step-000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # no temp files left behind


def test_dcp_checkpoint_loads_exactly_into_uninitialised_storage(tmp_path):
    """A distributed-training (DCP) checkpoint saved in one process loads through from_pretrained bit-exactly
    (the model is built on meta and every tensor comes from the load); one whose config has more layers than its
    tensors raises one ValueError instead of leaving uninitialised weights."""
    from k3.config.hf import to_hf_config
    from k3.checkpoint.dcp import save
    from k3.train.muon import K3Muon
    from k3.train.param_groups import param_groups_for

    torch.manual_seed(0)
    cfg = get_preset("tiny")
    model = K3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    path = save(tmp_path / "step", model, K3Muon(param_groups_for(model, lr=1e-3)))
    (path / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    loaded = k3.from_pretrained(path)
    want = model.state_dict()
    assert loaded.state_dict().keys() == want.keys()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, want[name]), name
    deeper = cfg.replace(num_hidden_layers=cfg.num_hidden_layers + 4)
    (path / "config.json").write_text(json.dumps(to_hf_config(deeper)))
    with pytest.raises(ValueError, match="does not match the model .*Missing key"):
        k3.from_pretrained(path)


@pytest.mark.parametrize("style", ["k3", "kimi_linear"])
def test_A_log_file_layout_and_round_trip(tmp_path, style):
    """Bounded gate (K3): A_log written 1-D, zero-padded to a multiple of 128 (the release's 96 -> [128]);
    softplus gate (Kimi-Linear): [1, 1, H, 1]. Both read back bit-exact."""
    from k3.checkpoint.names import a_log_file_size, from_files, to_files

    assert [a_log_file_size(h) for h in (1, 2, 96, 128, 129)] == [128, 128, 128, 128, 256]
    cfg = get_preset("tiny") if style == "k3" else get_preset("tiny").replace(**KIMI_LINEAR_R16)
    h = cfg.kda.num_heads
    assert (cfg.kda.gate_lower_bound is not None) == (style == "k3")
    model = random_model(cfg)
    with torch.no_grad():  # non-zero values in every head (the bounded gate's init is 0)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.randn(h))
    state = model.state_dict()
    files = to_files(state, cfg)
    a_logs = {k: v for k, v in files.items() if k.endswith(".self_attn.A_log")}
    assert len(a_logs) == len(cfg.kda_layers)
    for k, t in a_logs.items():
        if style == "k3":
            assert t.shape == (128,) and torch.equal(t[:h], state[k]) and not t[h:].any()
        else:
            assert t.shape == (1, 1, h, 1) and torch.equal(t.reshape(-1), state[k])
    back = from_files(files, cfg)
    assert all(torch.equal(back[k], state[k]) for k in a_logs)
    save_pretrained(model, tmp_path / "ck")
    assert (
        ckpt.read_tensors(tmp_path / "ck")["model.layers.0.self_attn.A_log"].shape == next(iter(a_logs.values())).shape
    )
    assert_same(model, k3.from_pretrained(tmp_path / "ck"))


def test_weight_files_get_the_umask_mode(saved, tmp_path):
    """Temp files are created 0600; the written checkpoint's files and directory get what the umask gives."""
    model, _ = saved
    old = os.umask(0o022)
    try:
        save_pretrained(model, tmp_path / "modes")
    finally:
        os.umask(old)
    for f in (tmp_path / "modes").iterdir():
        assert f.stat().st_mode & 0o777 == 0o644, f.name
    assert (tmp_path / "modes").stat().st_mode & 0o777 == 0o755


def test_nonfinite_tensor_without_checksums_is_refused(saved):
    _, path = saved
    tensors = ckpt.read_tensors(path)
    os.remove(path / ckpt.CHECKSUMS)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*non-finite"):
        k3.from_pretrained(path)


@pytest.mark.parametrize(
    "name", ["../outside.safetensors", "/tmp/abs.safetensors", "sub/../../x.safetensors", "link.safetensors"]
)
def test_shard_index_cannot_leave_the_directory(saved, tmp_path, name):
    _, path = saved
    outside = tmp_path / "outside.safetensors"
    os.replace(path / "model.safetensors", outside)
    os.symlink(outside, path / "link.safetensors")
    index = {"weight_map": {"model.norm.weight": name}}
    (path / ckpt.INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        k3.from_pretrained(path)


def test_dcp_extra_is_read_as_plain_data_only(tmp_path):
    """A distributed checkpoint's extra.pt with an object whose unpickling would run code is refused, and the code
    does not run; tensors and plain data load as saved."""
    import os

    from k3.checkpoint.dcp import EXTRA_FILE, read_extra

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save({"step": 3, "bad": Payload()}, tmp_path / EXTRA_FILE)
    with pytest.raises(ValueError, match="more than tensors and plain data"):
        read_extra(tmp_path)
    assert not marker.exists()
    torch.save({"step": 3, "data": {"pos": [1, 2]}, "t": torch.ones(2)}, tmp_path / EXTRA_FILE)
    extra = read_extra(tmp_path)
    assert extra["step"] == 3 and extra["data"] == {"pos": [1, 2]} and torch.equal(extra["t"], torch.ones(2))


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        "null",
        '"sha256"',
        "{not json",
        "{}",
        '{"sha256": []}',
        '{"sha256": {"model.safetensors": 5}}',
        '{"sha256": {"model.safetensors": "abc"}}',
        '{"sha256": {}}',
        '{"sha256": {"other.safetensors": "' + "0" * 64 + '"}}',
    ],
)
def test_malformed_checksums_are_one_error_never_skipped(saved, text, capsys, tmp_path):
    """A damaged k3_checksums.json (wrong JSON type, wrong value types, or one that leaves the weights out) is one
    error naming it, from every reader; it never turns verification off."""
    _, path = saved
    (path / ckpt.CHECKSUMS).write_text(text)
    for load in (k3.from_pretrained, ckpt.read_tensors, lambda p: ckpt.verify_checksum(p, "model.safetensors")):
        with pytest.raises(ValueError, match=ckpt.CHECKSUMS):
            load(path)
    if '"sha256": {}' not in text and "other" not in text:  # malformed, not merely leaving the weights out
        with pytest.raises(ValueError, match=ckpt.CHECKSUMS):
            ckpt.add_checksums(path, ["config.json"])
    assert main(["convert", "--from", str(path), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and ckpt.CHECKSUMS in err and "Traceback" not in err, err
