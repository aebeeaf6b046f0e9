"""Host syncs of a training step, counted on the CPU: on a GPU every read of a device tensor's values (``tolist``,
``item``, a blocking copy) stalls the host, so the model must read its offsets only from host copies and the
trainer must read everything it logs in one transfer."""

import sys

import torch

import k3.train.step as step_module
from k3.config import get_preset
from k3.model.mla import MultiheadLatentAttention
from k3.ops.segments import host_offsets
from k3.ops.segments import attach_host, host_list, offsets_to
from k3.train.qk_clip import mla_max_logits, qk_clip_
from k3.train.trainer import Trainer, to_host
from tests.train.test_trainer import tiny_cfg

# the CPU's expert loop counts its experts' tokens on the host; the GPU path (k3.ops.moe.grouped) reads nothing
MOE_REFERENCE = "k3/ops/moe/reference.py"


def test_train_step_reads_device_values_once(tmp_path, monkeypatch):
    """Inside the model's forward nothing is read back (every op finds cu_seqlens' host copy, the QK-Clip hook of
    the MLA layers too); the trainer reads the step's numbers with one ``to_host``. Before: the model read the
    offsets once per forward and the QK-Clip hook once per MLA layer."""
    trainer = Trainer(tiny_cfg(tmp_path / "run", qk_clip=100.0, grad_accum=2), progress=False)
    inside, reads, fetches = [], [], []
    trainer.model.register_forward_pre_hook(lambda *a: inside.append(True))
    trainer.model.register_forward_hook(lambda *a: inside.clear())
    tolist = torch.Tensor.tolist

    def spy_tolist(t):
        caller = sys._getframe(1).f_code.co_filename
        if inside and not caller.endswith(MOE_REFERENCE):
            reads.append((caller, tuple(t.shape)))
        return tolist(t)

    def spy_to_host(tensors, device):
        fetches.append(sorted(map(str, tensors)))
        return to_host(tensors, device)

    monkeypatch.setattr(torch.Tensor, "tolist", spy_tolist)
    monkeypatch.setattr(step_module, "to_host", spy_to_host)
    record = trainer.train_step()
    assert reads == [], f"values read back inside the model's forward: {reads}"
    assert len(fetches) == 1, fetches
    assert {
        "loss",
        "grad_norm",
        "aux_loss",
        "maxvio",
        "maxvio_micro",
        "maxvio_seq",
        "dead_experts",
        "mla_max_logit",
    } <= set(record)
    assert set(trainer.recent_loads) == {1, 2, 3, 4}


def test_to_host_is_exact():
    parts = {
        "f32": torch.tensor([1 / 3, -2.5e-30, float("inf")]),
        "f64": torch.tensor(1 / 7, dtype=torch.float64),
        "loads": torch.tensor([[0, 2**40], [7, 3]]),
    }
    host = to_host(parts, torch.device("cpu"))
    assert list(host) == list(parts)
    for k, t in parts.items():
        assert host[k].dtype == t.dtype and host[k].shape == t.shape and torch.equal(host[k], t), k


def test_offsets_to_carries_the_host_copy():
    cu = torch.tensor([0, 3, 8])
    moved = offsets_to(cu, "cpu")
    assert moved._k3_host == [0, 3, 8] and host_list(moved) is moved._k3_host
    assert offsets_to(moved, "cpu")._k3_host == [0, 3, 8]


def test_fla_host_tensor_is_reused_per_host_copy():
    """fla keys its derived chunk indices on the identity of cu_seqlens_cpu: one object per offsets (new offsets,
    a new object)."""
    cu = attach_host(torch.tensor([0, 5, 9]))
    first = host_offsets(cu)
    assert host_offsets(cu) is first and first.tolist() == [0, 5, 9]
    attach_host(cu, [0, 4, 9])  # a new host copy: a new CPU tensor
    assert host_offsets(cu) is not first and host_offsets(cu).tolist() == [0, 4, 9]


def test_qk_clip_below_tau_leaves_weights_bit_identical():
    """QK-Clip scales every head (by exactly 1 when under tau) instead of asking the host whether any is over."""
    torch.manual_seed(0)
    m = MultiheadLatentAttention(get_preset("tiny"))
    x, cu = torch.randn(12, 64), torch.tensor([0, 5, 12])
    before = {k: v.clone() for k, v in m.state_dict().items()}
    gamma = qk_clip_(m, mla_max_logits(m, x, cu), tau=1e9)
    assert torch.equal(gamma, torch.ones_like(gamma))
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
