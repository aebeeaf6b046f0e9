"""``k3 train --lora``: only the adapters train, they are saved apart from the base, a run resumes exactly,
``k3 convert --merge-lora`` folds them in, and expert balancing under LoRA and full fine-tuning."""

import json

import torch

import k3
from k3.cli.main import main
from k3.checkpoint.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from k3.model.lora import adapters
from k3.train.trainer import Trainer
from tests.train.finetune_sources import finetune_cfg, logits, tiny_model, tokenizer, write_checkpoint

IDS = torch.tensor([[5, 17, 80, 3, 44, 200, 9, 61, 120, 7, 33, 250]])


def _source(tmp_path):
    return write_checkpoint(tmp_path / "src", tiny_model(tokenizer()), tokenizer())


def _lora(out, src, **kw):
    return finetune_cfg(out, src, task="sft", data=None, seq_len=128, lora=4, **kw)


def _base_state(model) -> dict:
    """The model's tensors that are not adapters, by their unadapted names."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith(("lora_A", "lora_B")):
            continue
        out[k.replace(".parametrizations.weight.original", ".weight")] = v
    return out


def _biases(state: dict) -> dict:
    return {k: v for k, v in state.items() if k.endswith("e_score_correction_bias")}


def test_lora_trains_only_the_adapters_and_saves_them_apart(tmp_path):
    """Rank-4 LoRA for 4 steps: every base weight (the routed experts and the router's weights included) is bit
    for bit the source's, the adapters moved, QB moved the router biases, and the checkpoints hold the adapters,
    the biases and the base's config, not the weights."""
    from safetensors.torch import load_file

    src = _source(tmp_path)
    trainer = Trainer(_lora(tmp_path / "run", src), progress=False)
    result = trainer.run()
    base = k3.from_pretrained(src, dtype=torch.float32).state_dict()
    now = _base_state(trainer.model)
    assert now.keys() == base.keys()
    assert all(torch.equal(now[k], base[k]) for k in base if k not in _biases(base))
    assert all(not torch.equal(v, base[k]) for k, v in _biases(now).items())
    assert all(lora.lora_B.abs().max() > 0 for lora in adapters(trainer.model).values())
    ckpt = tmp_path / "run" / "checkpoints" / "step-000004"
    assert result["checkpoint"] == str(ckpt)
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "config.json", "tokenizer.json"} <= {p.name for p in ckpt.iterdir()}
    assert not list(ckpt.glob("model*.safetensors"))
    saved = load_file(ckpt / ADAPTER_WEIGHTS)
    assert all(torch.equal(saved[k], v) for k, v in _biases(now).items())
    meta = json.loads((ckpt / ADAPTER_CONFIG).read_text())
    assert meta["rank"] == 4 and meta["alpha"] == 4.0 and meta["base"] == str(src.resolve())
    assert all(".self_attn." in t for t in meta["targets"])


def test_lora_resumed_mid_run_is_bitwise_identical(tmp_path):
    src = _source(tmp_path)
    full = Trainer(_lora(tmp_path / "full", src), progress=False)
    done = full.run()
    split = Trainer(_lora(tmp_path / "split", src), progress=False)
    split.run(stop_at=2)
    resumed = Trainer(_lora(tmp_path / "split", src), resume=True, progress=False)
    again = resumed.run()
    assert [h["loss"] for h in again["history"]] == [h["loss"] for h in done["history"]]
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_merged_checkpoint_gives_the_adapted_models_logits(tmp_path, capsys):
    """k3 convert --merge-lora: the merged model's logits equal base + adapters' to fp32 tolerance; another base
    is refused in one line, and an adapter directory is not loaded as a model."""
    src = _source(tmp_path)
    trainer = Trainer(_lora(tmp_path / "run", src, steps=2, save_every=0), progress=False)
    trainer.run()
    adapted = logits(trainer.model, IDS)
    assert (
        main(["convert", "--from", str(src), "--merge-lora", str(tmp_path / "run"), "--to", str(tmp_path / "m")]) == 0
    )
    merged = logits(k3.from_pretrained(tmp_path / "m"), IDS)
    assert torch.allclose(merged, adapted, rtol=0, atol=1e-5 * adapted.abs().max())
    assert not torch.allclose(merged, logits(k3.from_pretrained(src), IDS), rtol=0, atol=1e-4)
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    other = write_checkpoint(tmp_path / "other", tiny_model(tokenizer(), seed=1), tokenizer())
    capsys.readouterr()
    assert (
        main(["convert", "--from", str(other), "--merge-lora", str(tmp_path / "run"), "--to", str(tmp_path / "x")]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not that checkpoint" in err[0] and not (tmp_path / "x").exists()
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    assert main(["generate", "--ckpt", str(tmp_path / "run"), "--prompt", "a", "--max-tokens", "1"]) == 2
    assert f"{ckpt} holds LoRA adapters, not a model" in capsys.readouterr().err


def test_expert_balancing_under_lora_and_full_sft(tmp_path):
    """QB keeps updating the router biases under LoRA (test above: they move and are saved with the adapters) and
    under full SFT, as in pretraining; --balance none under LoRA leaves every base tensor as it was."""
    src = _source(tmp_path)
    base = k3.from_pretrained(src).state_dict()
    full = Trainer(finetune_cfg(tmp_path / "full", src, task="sft", data=None, seq_len=128, steps=2), progress=False)
    full.run()
    assert full.balancer.method == "qb"
    assert all(not torch.equal(v, base[k]) for k, v in _biases(full.model.state_dict()).items())
    assert all(h["maxvio"] is not None for h in full.history)
    frozen = Trainer(_lora(tmp_path / "none", src, steps=2, balance="none"), progress=False)
    frozen.run()
    now = _base_state(frozen.model)
    assert all(torch.equal(now[k], base[k]) for k in base)
