"""Host syncs of a training step, counted on the CPU: on a GPU every read of a device tensor's values (``tolist``,
``item``, a blocking copy) stalls the host, so the model must read its offsets only from host copies and the
trainer must read everything it logs in one transfer."""

import sys

import pytest
import torch

import k3.model.kda as kda_module
import k3.train.step as step_module
from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.mla import MultiheadLatentAttention
from k3.ops.segments import Segments, as_segments
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


def test_segments_move_without_reading_and_keep_their_host_values():
    """A Segments goes where it is asked without reading its offsets again (it is itself where they already are);
    a CPU tensor converts from its own values."""
    cu = as_segments(torch.tensor([0, 3, 8]), "cpu")
    assert cu.host == (0, 3, 8) and cu.lengths == (3, 5) and cu.count == 2 and cu.max_length == 5
    assert as_segments(cu, "cpu") is cu and cu.to("cpu") is cu and as_segments(cu) is cu
    with pytest.raises(ValueError, match="1-D integer tensor"):
        as_segments(torch.tensor([[0, 3]]))


def read_counter(monkeypatch):
    """Patch ``Tensor.tolist`` to count its calls (every read of a device tensor's values is one) outside the
    CPU's expert loop; returns the list of callers."""
    reads, tolist = [], torch.Tensor.tolist

    def spy(t):
        caller = sys._getframe(1).f_code.co_filename
        if not caller.endswith(MOE_REFERENCE):
            reads.append(caller)
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    return reads


def test_forward_reads_bare_offsets_once_and_segments_never(monkeypatch):
    """The model reads a bare offsets tensor once per forward, however many layers use it (a device tensor: one
    sync), and reads nothing of a Segments."""
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny")).eval()
    ids, cu = torch.randint(0, 512, (1, 20)), torch.tensor([0, 7, 20])
    reads = read_counter(monkeypatch)
    with torch.no_grad():
        bare = model(ids, cu_seqlens=cu).logits
        assert len(reads) == 1, reads
        reads.clear()
        segments = Segments.from_host([0, 7, 20])
        assert torch.equal(model(ids, cu_seqlens=segments).logits, bare)
    assert reads == []


def test_fla_host_tensor_is_one_object_per_segments_shared_by_the_layers(monkeypatch):
    """fla keys its derived chunk indices on the identity of cu_seqlens and cu_seqlens_cpu: one CPU tensor per
    Segments, and every KDA layer of a forward is handed the same Segments (new offsets: a new object)."""
    cu = Segments.from_host([0, 5, 9])
    assert cu.cpu is cu.cpu and cu.cpu.tolist() == [0, 5, 9] and cu.cpu.dtype == torch.int64
    assert Segments.from_host([0, 4, 9]).cpu is not cu.cpu
    seen, real = [], kda_module.chunk_kda_raw

    def spy(*args, cu_seqlens, **kwargs):
        seen.append(cu_seqlens)
        return real(*args, cu_seqlens=cu_seqlens, **kwargs)

    monkeypatch.setattr(kda_module, "chunk_kda_raw", spy)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny"))
    layers = sum(isinstance(layer.self_attn, kda_module.KimiDeltaAttention) for layer in model.model.layers)
    with torch.no_grad():
        for _ in range(2):
            model(torch.randint(0, 512, (1, 20)), cu_seqlens=torch.tensor([0, 7, 20]))
    assert layers >= 2 and len(seen) == 2 * layers
    first, second = seen[:layers], seen[layers:]
    assert all(s is first[0] for s in first) and all(s is second[0] for s in second) and first[0] is not second[0]


def test_qk_clip_below_tau_leaves_weights_bit_identical():
    """QK-Clip scales every head (by exactly 1 when under tau) instead of asking the host whether any is over."""
    torch.manual_seed(0)
    m = MultiheadLatentAttention(get_preset("tiny"))
    x, cu = torch.randn(12, 64), torch.tensor([0, 5, 12])
    before = {k: v.clone() for k, v in m.state_dict().items()}
    gamma = qk_clip_(m, mla_max_logits(m, x, cu), tau=1e9)
    assert torch.equal(gamma, torch.ones_like(gamma))
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
