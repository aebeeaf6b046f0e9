"""Loading part of the routed experts (k3.checkpoint.load.from_pretrained ``experts=``, ``checksum_part=``), what an
expert-parallel rank does: the kept experts, in the order given, equal the same rows of a whole load (plain,
packed kept or dequantised, read or staged, per-expert tensors or transformers' fused stacks), the rest of the
model equals the whole load, the other experts' bytes are never placed, and a shard outside this process's
checksum part that holds none of its tensors is not read at all."""

import re

import pytest
import torch
from safetensors.torch import save_file

import k3.checkpoint.format as ckpt
import k3.checkpoint.stream as stream
from k3.config import get_preset
from k3.checkpoint.format import save_pretrained
from k3.checkpoint.load import from_pretrained
from k3.model.decoder import K3ForCausalLM
from k3.model.moe import keep_experts, moe_layers
from tests.checkpoint.test_streamed_load import assert_same

EXPERTS = {1: [5, 0, 3], 2: [7], 3: [1, 2, 3, 4, 5, 6, 7, 0]}  # layer 4 keeps all 8 (not named)
BANK = ("w1", "w2", "w3", "w1_packed", "w2_packed", "w3_packed", "w1_scale", "w2_scale", "w3_scale")


def random_model(cfg):
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    with torch.no_grad():
        for name, t in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    d = tmp_path_factory.mktemp("plain") / "ck"
    save_pretrained(random_model(get_preset("tiny")), d, max_shard_bytes=2**15)
    return d


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    cfg = get_preset("tiny").replace(**{"moe.moe_intermediate_size": 64, "moe.latent_size": 64})
    d = tmp_path_factory.mktemp("packed") / "ck"
    save_pretrained(random_model(cfg), d, quantize="mxfp4", max_shard_bytes=3000)  # pairs split across shards
    return d


def assert_part_of(part, whole, experts):
    """``part`` holds the rows ``experts`` of ``whole``'s expert stacks, everything else the same."""
    sp, sw = part.state_dict(), whole.state_dict()
    assert sp.keys() == sw.keys()
    for moe in moe_layers(part):
        ids = experts.get(moe.layer_idx)
        assert getattr(moe.experts, "expert_ids", None) == (None if ids is None else tuple(ids))
    for name, t in sw.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.rsplit(".", 1)[-1] in BANK and layer in experts:
            t = t[experts[layer]]
        assert sp[name].dtype == t.dtype and torch.equal(sp[name], t), name


@pytest.mark.parametrize("path", ["read", "staged"])
def test_kept_experts_equal_the_whole_loads_rows(plain, monkeypatch, path):
    whole = from_pretrained(plain)
    if path == "staged":  # as onto a GPU (unpinned buffers here), in small chunks
        monkeypatch.setattr(stream, "_staged", lambda place: True)
        monkeypatch.setattr(stream, "_CHUNK", 4096)
    for verify, part in [(True, (0, 1)), (True, (1, 3)), (False, (0, 1))]:
        for workers in (1, 3):
            got = from_pretrained(plain, experts=EXPERTS, workers=workers, verify=verify, checksum_part=part)
            assert_part_of(got, whole, EXPERTS)
    assert moe_layers(got)[0].experts.w1.shape[0] == 3 and moe_layers(got)[3].experts.w1.shape[0] == 8


@pytest.mark.parametrize("mode", ["keep", "dequantize"])
@pytest.mark.parametrize("path", ["read", "staged"])
def test_packed_experts_load_straight_into_the_part(packed, monkeypatch, mode, path):
    whole = from_pretrained(packed, packed=mode)
    if path == "staged":
        monkeypatch.setattr(stream, "_staged", lambda place: True)
        monkeypatch.setattr(stream, "_CHUNK", 1000)
    got = from_pretrained(packed, packed=mode, experts=EXPERTS, workers=4)
    assert_part_of(got, whole, EXPERTS)
    assert getattr(moe_layers(got)[0].experts, "packed", False) == (mode == "keep")


def test_fused_expert_stacks_are_cut_to_the_part(plain, tmp_path):
    """transformers' runtime names hold a layer's experts in one tensor ([E, 2I, D] gate_up_proj, down_proj)."""
    whole = from_pretrained(plain)
    tensors = {}
    for name, t in whole.state_dict().items():
        if ".block_sparse_moe.experts.w" in name:
            base = name.replace(".block_sparse_moe.experts.", ".mlp.experts.").rsplit(".", 1)[0]
            w = name.rsplit(".", 1)[1]
            if w == "w1":
                tensors[base + ".gate_up_proj"] = torch.cat([t, whole.state_dict()[name[:-2] + "w3"]], 1)
            elif w == "w2":
                tensors[base + ".down_proj"] = t.clone()
        else:
            tensors[name] = t.contiguous()
    d = tmp_path / "fused"
    d.mkdir()
    (d / "config.json").write_bytes((plain / "config.json").read_bytes())
    save_file(tensors, d / "model.safetensors")
    assert_part_of(from_pretrained(d, experts=EXPERTS), whole, EXPERTS)


def _experts_only_shard(directory):
    """A shard holding routed-expert tensors only, and for each layer in it the experts it holds none of."""
    for f in sorted(directory.glob("model-*.safetensors")):
        entries = stream.read_header(f)[0]
        held = [re.match(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.", e.name) for e in entries]
        if not all(held):
            continue
        kept = {}
        for layer in {int(m[1]) for m in held}:
            kept[layer] = sorted(set(range(8)) - {int(m[2]) for m in held if int(m[1]) == layer})
        if all(kept.values()):
            return f, entries, kept
    raise AssertionError("no shard of experts only")


def test_a_shard_neither_checked_nor_needed_is_not_opened(plain, tmp_path, monkeypatch):
    shard, entries, kept = _experts_only_shard(plain)
    files = sorted(f.name for f in plain.glob("model-*.safetensors"))
    i = files.index(shard.name)
    opened, read_shard = [], stream._load_shard  # past its header (read by every load), a shard is read here

    def spy(path, *args):
        opened.append(path.name)
        return read_shard(path, *args)

    monkeypatch.setattr(stream, "_load_shard", spy)
    got = from_pretrained(plain, experts=kept, checksum_part=((i + 1) % 2, 2))
    assert shard.name not in opened and len(opened) == len(files) - 1
    opened.clear()
    assert_same(from_pretrained(plain, experts=kept, checksum_part=(i % 2, 2)), got)
    assert shard.name in opened  # its part's to check: read (and hashed) whole, though nothing in it is kept
    d = tmp_path / "ck"  # a flipped bit in it: found by the process that checks it
    save_pretrained(from_pretrained(plain), d, max_shard_bytes=2**15)
    data = bytearray((d / shard.name).read_bytes())
    data[entries[0].start + 1] ^= 0x01
    (d / shard.name).write_bytes(bytes(data))
    assert_same(from_pretrained(d, experts=kept, checksum_part=((i + 1) % 2, 2)), got)
    with pytest.raises(ValueError, match=f"{shard.name} is corrupted: its SHA-256 differs from {ckpt.CHECKSUMS}"):
        from_pretrained(d, experts=kept, checksum_part=(i % 2, 2))


def test_bad_parts_are_one_error(plain):
    with pytest.raises(ValueError, match=r"layers \[0\], which are not MoE layers \(those: \[1, 2, 3, 4\]\)"):
        from_pretrained(plain, experts={0: [1]})
    with pytest.raises(ValueError, match=r"experts \[1, 1\] must be distinct, in 0..7"):
        from_pretrained(plain, experts={1: [1, 1]})
    with pytest.raises(ValueError, match=r"experts \[8\] must be distinct, in 0..7"):
        from_pretrained(plain, experts={1: [8]})
    for part in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError, match=r"checksum_part=.* must be \(i, n\) with 0 <= i < n"):
            from_pretrained(plain, checksum_part=part)


def test_keep_experts_cuts_a_built_bank_once():
    model = random_model(get_preset("tiny"))
    moe = moe_layers(model)[0]
    w2 = moe.experts.w2.detach().clone()
    keep_experts(moe, [6, 2])
    assert torch.equal(moe.experts.w2, w2[[6, 2]]) and isinstance(moe.experts.w2, torch.nn.Parameter)
    assert moe.gate.weight.shape[0] == 8  # the router still scores every expert
    with pytest.raises(ValueError, match="keeps part of its experts already"):
        keep_experts(moe, [0])


def test_a_distributed_training_checkpoint_is_cut_after_gathering(tmp_path):
    import json

    from k3.config.hf import to_hf_config
    from k3.checkpoint.dcp import save
    from k3.train.muon import K3Muon
    from k3.train.param_groups import param_groups_for

    cfg = get_preset("tiny")
    model = random_model(cfg)
    path = save(tmp_path / "step", model, K3Muon(param_groups_for(model, lr=1e-3)))
    (path / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    assert_part_of(from_pretrained(path, experts=EXPERTS), from_pretrained(path), EXPERTS)
