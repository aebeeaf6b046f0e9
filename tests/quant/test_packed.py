"""Packed MXFP4 checkpoints (compressed-tensors mxfp4-pack-quantized): export -> import equals the QAT forward,
packed-in-memory inference, the CLI, and the refusal of anything else."""

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
from k3.model.moe import MoE
from k3.quant import PackedExperts, enable_qat, fake_quantize, pack_expert_tensors, unpack_expert_tensors
from k3.ops.mx import pack_fp4, quantize
from k3.quant.packed import FORMAT, quantization_config
from k3.checkpoint.format import save_pretrained

EXPERT = "model.layers.1.block_sparse_moe.experts.3.w2"


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = K3ForCausalLM(get_preset("tiny"))
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("_res_proj.weight", "e_score_correction_bias")):
                t.normal_(0, 0.1)
    return model


def ids():
    return torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))


def moe_layers(model):
    return [m for m in model.modules() if isinstance(m, MoE)]


def test_pack_unpack_expert_tensors():
    model = tiny_model()
    files = ckpt.to_files(model.state_dict(), model.config)
    packed = pack_expert_tensors(files)
    experts = [k for k in files if ".experts." in k]
    assert len(experts) == 4 * 8 * 3
    assert all(k not in packed for k in experts)
    w = files[EXPERT + ".weight"]  # [D, I] = [32, 32]
    p, s = packed[EXPERT + ".weight_packed"], packed[EXPERT + ".weight_scale"]
    assert p.dtype == s.dtype == torch.uint8 and p.shape == (32, 16) and s.shape == (32, 1)
    codes, scales = quantize(w, "e2m1")
    assert torch.equal(p, pack_fp4(codes)) and torch.equal(s, scales)
    others = {k: v for k, v in packed.items() if not k.endswith(("weight_packed", "weight_scale"))}
    assert others.keys() == files.keys() - {k for k in experts}
    assert all(v is files[k] for k, v in others.items())
    back = unpack_expert_tensors(packed)
    assert back.keys() == files.keys()
    for k in experts:
        assert torch.equal(back[k], fake_quantize(files[k], "e2m1")), k
    assert list(pack_expert_tensors(files, mode="rceil")[EXPERT + ".weight_scale"].shape) == [32, 1]


def test_quantization_config():
    qc = quantization_config()
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == FORMAT
    (group,) = qc["config_groups"].values()
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["symmetric"], w["scale_dtype"]) == (
        4,
        "float",
        "group",
        32,
        True,
        "uint8",
    )
    assert group["input_activations"] is None
    assert {"lm_head", r"re:.*shared_experts\..*", r"re:.*self_attn\..*"} <= set(qc["ignore"])
    assert json.loads(json.dumps(qc)) == qc


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_export_import_forward_equals_qat_forward(tmp_path, mode):
    model = tiny_model()
    reference = model(ids()).logits
    enable_qat(model, mode=mode)
    qat_logits = model(ids()).logits
    save_pretrained(model, tmp_path / "ck", quantize="mxfp4")  # scale mode taken from the model's QAT
    d = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert d["quantization_config"]["format"] == FORMAT
    files = ckpt.read_tensors(tmp_path / "ck")
    uint8 = sorted(k for k, v in files.items() if v.dtype == torch.uint8)
    assert len(uint8) == 2 * 4 * 8 * 3 and all(".block_sparse_moe.experts." in k for k in uint8)
    assert not any(k.endswith(".experts.0.w1.weight") for k in files)

    loaded = k3.from_pretrained(tmp_path / "ck", packed="dequantize")  # dequantised masters
    assert all(isinstance(m.experts.w1, torch.nn.Parameter) for m in moe_layers(loaded))
    assert not torch.equal(loaded(ids()).logits, reference)
    enable_qat(model, activations=None, mode=mode)  # weight-only QAT == the plain loaded model
    assert torch.equal(loaded(ids()).logits, model(ids()).logits)
    enable_qat(loaded, weights=None, mode=mode)  # + MXFP8 activations (a runtime choice) == full QAT
    assert torch.equal(loaded(ids()).logits, qat_logits)
    if mode == "floor":  # re-quantising on-grid weights is the identity under the OCP rule
        enable_qat(loaded, mode=mode)
        assert torch.equal(loaded(ids()).logits, qat_logits)


def test_keep_packed_inference(tmp_path):
    model = tiny_model()
    save_pretrained(model, tmp_path / "ck", quantize="mxfp4")
    deq = k3.from_pretrained(tmp_path / "ck", packed="dequantize")
    kept = k3.from_pretrained(tmp_path / "ck", packed="keep")
    experts = [m.experts for m in moe_layers(kept)]
    assert all(isinstance(e, PackedExperts) for e in experts)
    assert all(t.dtype == torch.uint8 for e in experts for t in e.state_dict().values())
    assert not any(".experts." in n for n, _ in kept.named_parameters())
    assert torch.equal(kept(ids()).logits, deq(ids()).logits)
    with pytest.raises(ValueError, match="packed"):
        enable_qat(kept)
    kept16 = k3.from_pretrained(tmp_path / "ck", dtype=torch.bfloat16, packed="keep")
    deq16 = k3.from_pretrained(tmp_path / "ck", dtype=torch.bfloat16, packed="dequantize")
    assert kept16.model.layers[1].block_sparse_moe.experts.w1.dtype == torch.bfloat16
    assert torch.equal(kept16(ids()).logits, deq16(ids()).logits)
    save_pretrained(kept, tmp_path / "again")  # still packed: same tensors, same config
    a, b = ckpt.read_tensors(tmp_path / "ck"), ckpt.read_tensors(tmp_path / "again")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "quantization_config" in json.loads((tmp_path / "again" / "config.json").read_text())


def test_release_style_prefix_and_cli(tmp_path):
    model = tiny_model()
    save_pretrained(model, tmp_path / "hp")
    assert main(["convert", "--from", str(tmp_path / "hp"), "--to", str(tmp_path / "q"), "--quantize", "mxfp4"]) == 0
    files = ckpt.read_tensors(tmp_path / "q")
    os.remove(tmp_path / "q" / ckpt.CHECKSUMS)
    save_file({"language_model." + k: v for k, v in files.items()}, tmp_path / "q" / "model.safetensors")
    loaded = k3.from_pretrained(tmp_path / "q", packed="dequantize")
    enable_qat(model, activations=None)
    assert torch.equal(loaded(ids()).logits, model(ids()).logits)
    assert torch.equal(k3.from_pretrained(tmp_path / "q", packed="keep")(ids()).logits, loaded(ids()).logits)
    # convert without --quantize writes the dequantised weights (no quantization_config)
    assert main(["convert", "--from", str(tmp_path / "q"), "--to", str(tmp_path / "hp2")]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "hp2" / "config.json").read_text())
    assert torch.equal(k3.from_pretrained(tmp_path / "hp2")(ids()).logits, loaded(ids()).logits)


def test_refusals(tmp_path):
    model = tiny_model()
    with pytest.raises(ValueError, match="quantize="):
        save_pretrained(model, tmp_path / "x", quantize="nvfp4")
    save_pretrained(model, tmp_path / "hp")
    with pytest.raises(ValueError, match="no packed experts"):
        k3.from_pretrained(tmp_path / "hp", packed="keep")
    with pytest.raises(ValueError, match="packed="):
        k3.from_pretrained(tmp_path / "hp", packed="lazy")
    save_pretrained(model, tmp_path / "q", quantize="mxfp4")
    cfg_path = tmp_path / "q" / "config.json"
    good = json.loads(cfg_path.read_text())
    for change, message in (
        (("quant_method", "gptq"), "quant_method"),
        (("format", "nvfp4-pack-quantized"), "format"),
        (("format", "pack-quantized"), "not supported"),
    ):
        bad = json.loads(json.dumps(good))
        bad["quantization_config"][change[0]] = change[1]
        cfg_path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            k3.from_pretrained(tmp_path / "q", packed="dequantize")
    bad = json.loads(json.dumps(good))
    bad["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    cfg_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="group_size"):
        k3.from_pretrained(tmp_path / "q", packed="dequantize")
    cfg_path.write_text(json.dumps(good))
    files = ckpt.read_tensors(tmp_path / "q")
    os.remove(tmp_path / "q" / ckpt.CHECKSUMS)
    half = {k: v for k, v in files.items() if k != EXPERT + ".weight_scale"}
    save_file(half, tmp_path / "q" / "model.safetensors")
    with pytest.raises(ValueError, match="without its weight_scale"):
        k3.from_pretrained(tmp_path / "q", packed="dequantize")
    wrong = dict(files)
    wrong[EXPERT + ".weight_scale"] = torch.zeros(32, 2, dtype=torch.uint8)
    save_file(wrong, tmp_path / "q" / "model.safetensors")
    with pytest.raises(ValueError, match="do not match"):
        k3.from_pretrained(tmp_path / "q", packed="dequantize")
    with pytest.raises(ValueError, match=r"w2_scale: experts have different shapes"):
        k3.from_pretrained(tmp_path / "q", packed="keep")
