"""Activation checkpointing (k3.train.activation_checkpoint): the same loss and gradients with fewer saved bytes;
no effect without autograd or with a cache; the trainer's flag."""

import copy

import pytest
import torch
import torch.nn.functional as F

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.train.activation_checkpoint import apply_activation_checkpointing
from k3.train.trainer import TrainConfig, Trainer


def loss_grads_saved(model, ids, cu):
    """Summed cross-entropy, every parameter's gradient and the bytes autograd kept for the backward pass."""
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids, cu_seqlens=cu).logits
    loss = F.cross_entropy(logits.flatten(0, 1)[:-1], ids.flatten()[1:], reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, sum(saved)


@pytest.mark.parametrize("mode", ["snapshot", "block_sum", "none"])
def test_same_loss_and_gradients_with_fewer_saved_bytes(mode, perturb):
    """fp64: recomputing a sub-layer repeats the same operations, so loss and gradients agree to rounding
    (1e-12); autograd keeps at most half the bytes (counted by storage, so views of kept tensors count fully)."""
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(**{"attn_res.mode": mode})
    plain = perturb(K3ForCausalLM(cfg).double())
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt) == 10  # 5 mixers + 5 FFNs
    assert apply_activation_checkpointing(ckpt) == 0  # idempotent
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    cu = torch.tensor([0, 13, 40, 80])
    ref_loss, ref_grads, ref_bytes = loss_grads_saved(plain, ids, cu)
    loss, grads, nbytes = loss_grads_saved(ckpt, ids, cu)
    assert ((loss - ref_loss).abs() / ref_loss.abs()).item() <= 1e-12
    assert grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        scale = g.norm() if g.norm() > 0 else 1
        assert ((grads[n] - g).norm() / scale).item() <= 1e-12, n
    assert nbytes <= 0.5 * ref_bytes, (nbytes, ref_bytes)
    copied = copy.deepcopy(ckpt)  # a copy's sub-layers recompute (and put gradients on) its own parameters
    loss, grads, _ = loss_grads_saved(copied, ids, cu)
    assert grads.keys() == ref_grads.keys() and ((loss - ref_loss).abs() / ref_loss.abs()).item() <= 1e-12


def test_no_grad_and_cached_passes_keep_the_plain_forward(monkeypatch):
    """Evaluation passes never go through torch.utils.checkpoint; with a cache (and autograd on) the mixers,
    which write it, run plainly and only the FFNs are checkpointed; logits equal the unwrapped model's."""
    import k3.train.activation_checkpoint as ac

    torch.manual_seed(1)
    cfg = get_preset("tiny")
    plain = K3ForCausalLM(cfg).eval()
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt)
    calls = []

    def spy(fn, *args, **kwargs):
        calls.append(type(fn.__self__).__name__)
        return torch.utils.checkpoint.checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(ac, "checkpoint", spy)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(ckpt(ids).logits, plain(ids).logits)
    assert not calls
    caches = [m.new_cache(2) for m in (plain, ckpt)]
    outs = [m(ids, cache=c).logits for m, c in zip((plain, ckpt), caches)]
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-6)
    assert sorted(set(calls)) == ["GatedFFN", "MoE"] and len(calls) == 5
    steps = [m.decode(ids[:, -1], c, [0, 1]) for m, c in zip((plain, ckpt), caches)]
    assert torch.allclose(steps[0], steps[1], rtol=0, atol=1e-6)
    calls.clear()
    ckpt(ids)  # a training pass checkpoints all 5 mixers and 5 FFNs
    assert len(calls) == 10 and {"KimiDeltaAttention", "MultiheadLatentAttention"} <= set(calls)


def test_trainer_flag_gives_the_same_run(tmp_path):
    """Two steps of the tiny preset with --activation-checkpointing: the same losses as without (fp32 on CPU;
    the recomputation repeats the forward's operations, so only reduction order inside a kernel could differ)."""
    base = dict(
        preset="tiny",
        steps=2,
        batch_size=2,
        seq_len=48,
        vocab_size=400,
        tokenizer_train_bytes=200_000,
        max_tokens=30_000,
        eval_every=2,
        eval_rows=4,
        samples=0,
        seed=0,
    )
    runs = [
        Trainer(
            TrainConfig(**base, out=str(tmp_path / str(flag)), activation_checkpointing=flag), progress=False
        ).run()["history"]
        for flag in (False, True)
    ]
    a, b = ([h["loss"] for h in r] for r in runs)
    assert len(a) == 2 and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b)), (a, b)
