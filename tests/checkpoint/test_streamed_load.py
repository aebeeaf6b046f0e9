"""Streamed checkpoint loading (k3.checkpoint.load.from_pretrained) and the multimodal release layout.

The streamed loader must give the same tensors as reading the files whole (safetensors' own reader), keep host
memory near the model's size, place tensors in their final dtype / device, and refuse a bad shard with one
message. The release layout (``kimi_k3`` wrapper, ``language_model.`` prefix, release vision names) must load
as K3ForConditionalGeneration and round-trip byte for byte.
"""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import k3.checkpoint.format as ckpt
from k3.config import get_preset
from k3.config.presets import with_vision
from k3.checkpoint.format import save_pretrained
from k3.checkpoint.load import from_pretrained, load_eager
from k3.checkpoint.names import a_log_file_size
from k3.model.decoder import K3ForCausalLM
from k3.model.multimodal import K3ForConditionalGeneration
from k3.quant.packed import PackedExperts

REPO = Path(__file__).resolve().parents[2]


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def random_multimodal(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    model = K3ForConditionalGeneration(with_vision(get_preset("tiny"))).cast(dtype)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("_res_proj.weight") or "norm" in name:
                t.normal_(0, 0.1)
    return model


def test_bf16_stays_bf16_and_dtype_casts_on_request(tmp_path):
    model = random_multimodal()
    save_pretrained(model, tmp_path / "ck", max_shard_bytes=2**16)
    loaded = from_pretrained(tmp_path / "ck")
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert loaded.model.layers[1].block_sparse_moe.gate.weight.dtype == torch.float32
    assert_same(model, loaded)
    assert_same(load_eager(tmp_path / "ck", dtype=torch.float32), from_pretrained(tmp_path / "ck", torch.float32))


def test_device_map_and_missing_prefix(tmp_path):
    save_pretrained(random_multimodal(), tmp_path / "ck")
    model = from_pretrained(tmp_path / "ck", device={"vision_tower": "cpu", "": "cpu"})
    assert all(p.device.type == "cpu" for p in model.parameters())
    with pytest.raises(ValueError, match="places no module prefix"):
        from_pretrained(tmp_path / "ck", device={"model": "cpu"})


def test_packed_experts_stay_packed_unless_asked(tmp_path):
    cfg = get_preset("tiny").replace(**{"moe.moe_intermediate_size": 64, "moe.latent_size": 64})
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    save_pretrained(model, tmp_path / "q", quantize="mxfp4", max_shard_bytes=3000)  # pairs split across shards
    kept = from_pretrained(tmp_path / "q", packed="keep")
    experts = kept.model.layers[1].block_sparse_moe.experts
    assert isinstance(experts, PackedExperts) and experts.w1_packed.dtype == torch.uint8
    assert experts.dtype_ref.dtype == torch.float32
    assert_same(load_eager(tmp_path / "q"), from_pretrained(tmp_path / "q", packed="dequantize"))


def test_auto_keeps_what_the_checkpoint_holds(tmp_path):
    """``packed="auto"`` (the default): a packed checkpoint loads packed, as ``"keep"`` does (inference); a
    high-precision one loads as ``"dequantize"`` does, where ``"keep"`` is refused."""
    cfg = get_preset("tiny").replace(**{"moe.moe_intermediate_size": 64, "moe.latent_size": 64})
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    save_pretrained(model, tmp_path / "q", quantize="mxfp4")
    save_pretrained(model, tmp_path / "hp")
    auto = from_pretrained(tmp_path / "q")
    assert isinstance(auto.model.layers[1].block_sparse_moe.experts, PackedExperts)
    assert_same(from_pretrained(tmp_path / "q", packed="keep"), auto)
    assert_same(from_pretrained(tmp_path / "q", packed="auto"), auto)
    plain = from_pretrained(tmp_path / "hp")
    assert not any(isinstance(m, PackedExperts) for m in plain.modules())
    assert_same(from_pretrained(tmp_path / "hp", packed="dequantize"), plain)
    assert_same(model, plain)
    with pytest.raises(ValueError, match="no packed experts"):
        from_pretrained(tmp_path / "hp", packed="keep")
    with pytest.raises(ValueError, match="'auto', 'keep', 'dequantize'"):
        from_pretrained(tmp_path / "hp", packed="packed")


def test_release_layout_round_trip_is_bit_exact(tmp_path):
    model = random_multimodal()
    save_pretrained(model, tmp_path / "r", fmt="k3-release", max_shard_bytes=2**16)
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["model_type"] == "kimi_linear"
    names = json.loads((tmp_path / "r" / ckpt.INDEX).read_text())["weight_map"]
    assert "language_model.lm_head.weight" in names and "mm_projector.proj.0.weight" in names
    assert names.keys() >= {"vision_tower.patch_embed.proj.weight", "vision_tower.encoder.blocks.1.wqkv.weight"}
    loaded = from_pretrained(tmp_path / "r")
    assert type(loaded) is K3ForConditionalGeneration and loaded.config == model.config
    assert_same(model, loaded)
    save_pretrained(loaded, tmp_path / "r2", fmt="k3-release", max_shard_bytes=2**16)
    for f in (tmp_path / "r").iterdir():
        assert f.read_bytes() == (tmp_path / "r2" / f.name).read_bytes(), f.name
    with pytest.raises(ValueError, match="needs a vision tower"):
        save_pretrained(K3ForCausalLM(get_preset("tiny")), tmp_path / "t", fmt="k3-release")


def test_hand_written_release_dir_loads(tmp_path):
    """A release-style directory written tensor by tensor from the release's names, not by our writer."""
    model = random_multimodal(seed=1)
    cfg = model.config
    v = cfg.vision
    state = model.state_dict()
    files = {}
    for name, t in state.items():
        if name.startswith("vision_tower."):
            continue
        if ".experts.w" in name:
            base, w = name.rsplit(".", 1)
            for j in range(t.shape[0]):
                files[f"language_model.{base}.{j}.{w}.weight"] = t[j].clone()
        elif name.endswith(".A_log"):
            padded = torch.zeros(a_log_file_size(t.numel()), dtype=t.dtype)
            padded[: t.numel()] = t
            files["language_model." + name] = padded
        else:
            files["language_model." + name] = t.clone()
    enc, proj = "vision_tower.encoder", "vision_tower.projector"
    p = v.patch_size
    files["vision_tower.patch_embed.proj.weight"] = state[f"{enc}.patch_embed.weight"].reshape(-1, 3, p, p).clone()
    files["vision_tower.patch_embed.pos_emb.weight"] = state[f"{enc}.pos_embed"].clone()
    for i in range(v.num_layers):
        b, ours = f"vision_tower.encoder.blocks.{i}", f"{enc}.blocks.{i}"
        for release, mine in (
            ("norm0", "norm1"),
            ("wqkv", "attn.qkv"),
            ("wo", "attn.proj"),
            ("norm1", "norm2"),
            ("mlp.fc0", "mlp.fc1"),
            ("mlp.fc1", "mlp.fc2"),
        ):
            files[f"{b}.{release}.weight"] = state[f"{ours}.{mine}.weight"].clone()
    files["vision_tower.encoder.final_layernorm.weight"] = state[f"{enc}.norm.weight"].clone()
    files["mm_projector.proj.0.weight"] = state[f"{proj}.fc1.weight"].clone()
    files["mm_projector.proj.2.weight"] = state[f"{proj}.fc2.weight"].clone()
    files["mm_projector.post_norm.weight"] = state[f"{proj}.norm.weight"].clone()
    text = ckpt.to_hf_config(cfg, "k3")
    del text["k3"]["vision"]
    config = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": {
            "vt_num_hidden_layers": v.num_layers,
            "vt_hidden_size": v.hidden_size,
            "vt_num_attention_heads": v.num_heads,
            "qkv_hidden_size": v.num_heads * v.head_dim,
            "vt_intermediate_size": v.intermediate_size,
            "patch_size": p,
            "merge_kernel_size": [2, 2],
            "init_pos_emb_height": v.pos_grid,
            "init_pos_emb_width": v.pos_grid,
        },
        "media_placeholder_token_id": v.media_placeholder_token_id,
        "media_begin_token_id": None,
        "media_end_token_id": None,
    }
    d = tmp_path / "hand"
    d.mkdir()
    names = sorted(files)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: files[k] for k in keys}, d / fname)
    (d / ckpt.INDEX).write_text(json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    (d / "config.json").write_text(json.dumps(config))
    loaded = from_pretrained(d)
    assert type(loaded) is K3ForConditionalGeneration and loaded.config == cfg
    assert_same(model, loaded)


def test_corrupted_shard_fails_with_one_message(tmp_path):
    save_pretrained(random_multimodal(), tmp_path / "r", fmt="k3-release", max_shard_bytes=2**16)
    shard = sorted((tmp_path / "r").glob("model-*.safetensors"))[2]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # a weight byte: the header still parses
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        from_pretrained(tmp_path / "r")
    assert str(err.value) == f"{shard} is corrupted: its SHA-256 differs from {ckpt.CHECKSUMS}"
    shard.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(ValueError, match=f"{shard.name} is not a valid safetensors file"):
        from_pretrained(tmp_path / "r")


CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import torch
    from safetensors.torch import load_file
    from k3.checkpoint.format import read_config
    from k3.checkpoint.load import from_pretrained
    from k3.checkpoint.names import map_tensor
    device = sys.argv[2]
    if device == "cuda":
        torch.zeros(1, device=device)  # the CUDA context's host memory comes before the load
    before = int(open("/proc/self/statm").read().split()[1]) * __import__("os").sysconf("SC_PAGE_SIZE")
    t0 = time.perf_counter()
    model = from_pretrained(sys.argv[1], device=device)
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dest, cfg = model.state_dict(), read_config(sys.argv[1])
    for shard in sorted(p for p in __import__("pathlib").Path(sys.argv[1]).glob("*.safetensors")):
        for raw, t in load_file(shard).items():
            for name, j, piece in map_tensor(raw, t, cfg):
                got = dest[name] if j is None else dest[name][j]
                assert got.dtype == piece.dtype and torch.equal(got.cpu(), piece), raw
    print(json.dumps({"rss": rss, "before": before, "seconds": seconds,
                      "model_bytes": sum(t.numel() * t.element_size() for t in dest.values())}))
""")


def big_checkpoint(directory: Path) -> int:
    """>= 1 GB of bf16 weights in <= 200 MB shards; the largest shard's size."""
    cfg = get_preset("tiny").replace(
        **{
            "hidden_size": 1024,
            "vocab_size": 65536,
            "intermediate_size": 8192,
            "moe.num_experts": 64,
            "moe.moe_intermediate_size": 1024,
            "moe.latent_size": 512,
        }
    )
    with torch.device("meta"):
        model = K3ForCausalLM(cfg).to(torch.bfloat16)
    model.to_empty(device="cpu").cast(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.uniform_(-1, 1, generator=gen)
    n = sum(p.numel() for p in model.parameters())
    assert n >= 5 * 10**8
    save_pretrained(model, directory, max_shard_bytes=200 * 10**6)
    del model
    shards = sorted(directory.glob("*.safetensors"))
    largest = max(s.stat().st_size for s in shards)
    assert len(shards) > 1 and largest <= 200 * 10**6
    return largest


def load_in_child(directory: Path, device: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory), device], capture_output=True, text=True, cwd=REPO, check=True
    )
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"streamed {stats['model_bytes'] / 1e9:.2f} GB onto {device} in {stats['seconds']:.1f}s; child peak RSS "
        f"{stats['rss'] / 2**20:.0f} MiB ({stats['before'] / 2**20:.0f} before loading); child total "
        f"{time.perf_counter() - t0:.1f}s"
    )
    assert stats["model_bytes"] >= 10**9
    return stats


@pytest.mark.slow
def test_large_bf16_checkpoint_streams_in_bounded_memory(tmp_path):
    """A >= 1 GB checkpoint, its shards read in parallel, loads in a fresh process with peak RSS <= model +
    largest shard + 600 MB, to exactly the bytes safetensors reads."""
    largest = big_checkpoint(tmp_path / "big")
    stats = load_in_child(tmp_path / "big", "cpu")
    assert stats["rss"] <= stats["model_bytes"] + largest + 600 * 2**20


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_large_checkpoint_onto_a_gpu_holds_at_most_a_shard_and_the_staging_on_the_host(tmp_path):
    """Onto a GPU the host holds the pinned staging buffers (<= 1 GiB) and at most a shard's worth of tensors in
    flight: peak RSS grows by <= largest shard + 1 GiB (+ 256 MiB for the process itself) during the load."""
    largest = big_checkpoint(tmp_path / "big")
    stats = load_in_child(tmp_path / "big", "cuda")
    assert stats["rss"] - stats["before"] <= largest + 2**30 + 256 * 2**20
