"""FSDP2 + expert parallelism + distributed K3Muon: one training step on N gloo processes equals the step on one
process over the whole batch (loss, reduced gradients, gradient norm, updated weights).

Tolerance (relative, ||a - b|| / ||b|| per parameter, fp32 throughout, Newton-Schulz in fp32 on CPU). The runs
differ only in summation order: FSDP's reduce-scatter adds per-rank partial gradients where one process sums all
rows in one matmul, the all-to-all changes the row sets each expert matmul sees, and CPU BLAS may block a product
differently for another row count. Each is a few ulps of the summands, so the loss and the gradients agree to
~1e-7..3e-6 (the largest on small parameters such as A_log, whose gradient sums many cancelling terms).
  * Muon updates: Newton-Schulz is smooth in its (norm-divided) input, amplification <= ~a^5 (3.4445^5 ~ 500)
    only along tiny singular directions; measured relative errors of the UPDATES W1 - W0 are <= ~1.2e-5, checked
    at 1e-4.
  * AdamW's first step is lr * g / (|g| + eps) per element: an element whose gradient is ~eps (1e-8; a handful of
    lm_head / embedding entries, sums of cancelling terms) turns its absolute rounding noise into weight noise of
    up to lr * |dg| / eps. At the trainer's lr (3e-3) that keeps the updated weights <= ~5e-6 (worst:
    lm_head, dp=4 ep=2); at lr 2e-2 lm_head reaches ~3e-5. That is the reason for the test lr, not a reduction
    error: the gradients themselves match to ~1e-6.
  * Updated weights and gradients: 1e-5. A real error - a wrong shard, a missed or doubled reduction (factor 2,
    or the mean instead of the sum), a mis-ordered head block - is >= 1e-3.
Muon and Adam are (nearly) scale invariant, so the weights alone would not see a sum-vs-mean mistake: the reduced
GRADIENTS, the gradient norm and the loss are compared too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.train.muon import K3Muon
from k3.train.param_groups import classify_parameters, param_groups_for
from tests.conftest import _perturb, pack_model_experts
from tests.distributed.spawn import run
from tests.helpers import rel

ROWS, SEQ, LR = 4, 24, 3e-3  # the trainer's default lr
IGNORE = -100
RTOL = 1e-5
UPDATE_RTOL = 1e-4  # Muon updates W1 - W0 (see the module docstring)


def build_model(seed: int = 0) -> K3ForCausalLM:
    """The tiny preset in fp32 with non-zero AttnRes queries and random router biases (as tests/conftest.py)."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(get_preset("tiny"))
    return _perturb(model, bias_std=0.05)


def global_batch():
    """ids, labels [ROWS, SEQ] with ~25% ignored labels, unevenly spread over rows (global normalisation matters)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (ROWS, SEQ), generator=g)
    labels = torch.randint(0, 512, (ROWS, SEQ), generator=g)
    drop = torch.rand(ROWS, SEQ, generator=g) < torch.linspace(0.05, 0.5, ROWS)[:, None]
    labels[drop] = IGNORE
    return ids, labels


def loss_sum(model, ids, labels):
    logits = model(ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def make_optimizer(model):
    return K3Muon(param_groups_for(model, LR), lr=LR)


def full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def single_step(qat: bool = False, model=None, opt=None) -> dict:
    """The reference: one step on one process over the whole batch (from ``model`` / ``opt`` if given)."""
    if model is None:
        model = build_model()
        if qat:
            from k3.quant.qat import enable_qat

            enable_qat(model)
        opt = make_optimizer(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, labels = global_batch()
    loss = loss_sum(model, ids, labels) / int((labels != IGNORE).sum())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    opt.step()
    return {
        "loss": loss.item(),
        "grads": grads,
        "norm": float(norm),
        "initial": initial,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def prepare(dp: int, ep: int, seed: int = 0, qat: bool = False):
    """(meshes, model, optimizer) on this rank: the tiny model, expert parallel, FSDP2, K3Muon - in that order."""
    from k3.distributed.expert_parallel import apply_expert_parallel
    from k3.distributed.fsdp import apply_fsdp
    from k3.distributed.mesh import ParallelDims, build_mesh

    meshes = build_mesh(ParallelDims(dp=dp, ep=ep))
    model = build_model(seed)
    apply_expert_parallel(model, meshes)
    if qat:
        from k3.quant.qat import enable_qat

        enable_qat(model)
    apply_fsdp(model, meshes)
    return meshes, model, make_optimizer(model)


def train_step(meshes, model, opt) -> dict:
    """One step on this rank's rows of the global batch; loss normalised by the GLOBAL label count."""
    import torch.distributed as dist

    from k3.distributed.fsdp import clip_grad_norm_, reduce_expert_grads

    ids, labels = global_batch()
    valid = int((labels != IGNORE).sum())
    r, n = meshes.dp.get_local_rank(), ROWS // meshes.dims.dp
    loss = loss_sum(model, ids[r * n : (r + 1) * n], labels[r * n : (r + 1) * n]) / valid
    loss.backward()
    reduce_expert_grads(model, meshes)
    grads = {name: full(p.grad) for name, p in model.named_parameters()}
    norm = clip_grad_norm_(model, 1e9, meshes)
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {
        "loss": total.item(),
        "grads": grads,
        "norm": float(norm),
        "weights": {name: full(p) for name, p in model.named_parameters()},
    }


def distributed_step(rank: int, world: int, dp: int, ep: int, qat: bool = False) -> dict:
    from k3.model.moe import moe_layers

    meshes, model, opt = prepare(dp, ep, qat=qat)
    out = train_step(meshes, model, opt)
    out["sent"] = [m.expert_dispatch.last_send_counts for m in moe_layers(model) if m.expert_dispatch is not None]
    out["ep_rank"] = meshes.ep.get_local_rank()
    return portable(out)


def portable(tree):
    """Tensors -> numpy arrays (results cross the process boundary after the worker has exited, so no torch
    shared-memory handles)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy()
    if isinstance(tree, dict):
        return {k: portable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(portable(v) for v in tree)
    return tree


def compare(results: list[dict], ref: dict, rtol: float = RTOL, label: str = "") -> dict:
    """Every rank's loss, gradient norm, gradients and updated weights against the single-process step; the
    Muon-updated parameters' updates too."""
    worst = {"loss": 0.0, "norm": 0.0, "grads": 0.0, "weights": 0.0, "muon updates": 0.0}
    initial = ref["initial"]
    muon = [n for n, _, kind, _, _ in classify_parameters(build_model()) if kind != "adamw"]
    for res in results:
        for name in muon:
            e = rel(torch.as_tensor(res["weights"][name]) - initial[name], ref["weights"][name] - initial[name])
            assert e <= UPDATE_RTOL, f"{label} Muon update of {name}: relative error {e:.2e} > {UPDATE_RTOL:.0e}"
            worst["muon updates"] = max(worst["muon updates"], e)
        worst["loss"] = max(worst["loss"], abs(res["loss"] - ref["loss"]) / abs(ref["loss"]))
        worst["norm"] = max(worst["norm"], abs(res["norm"] - ref["norm"]) / ref["norm"])
        for what in ("grads", "weights"):
            assert res[what].keys() == ref[what].keys()
            for name, b in ref[what].items():
                a = res[what][name]
                assert a.shape == b.shape, (what, name, a.shape, b.shape)
                e = rel(a, b)
                assert e <= rtol, f"{label} {what} {name}: relative error {e:.2e} > {rtol:.0e}"
                worst[what] = max(worst[what], e)
    assert worst["loss"] <= rtol and worst["norm"] <= rtol, (label, worst)
    print(f"\n{label}: max relative errors " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    return worst


def one_thread(fn, *args):
    """fn on one intra-op thread, like the spawned workers (the same BLAS blocking)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    return one_thread(single_step)


def _check_cross_rank_traffic(results: list[dict], ep: int) -> None:
    """Every MoE layer of every rank sent rows to every other rank of its EP group."""
    for res in results:
        assert res["sent"], "no expert dispatch installed"
        for counts in res["sent"]:
            assert len(counts) == ep
            assert all(c > 0 for i, c in enumerate(counts) if i != res["ep_rank"]), counts


def test_fsdp_dp2_equals_single_process(reference):
    results = run(2, distributed_step, 2, 1)
    assert all(not r["sent"] for r in results)  # ep=1: FSDP shards the experts too, no dispatch
    compare(results, reference, label="dp=2")


def test_ep2_equals_single_process(reference):
    results = run(2, distributed_step, 2, 2)
    _check_cross_rank_traffic(results, 2)
    compare(results, reference, label="dp=2 ep=2")


def test_dp4_ep2_equals_single_process(reference):
    results = run(4, distributed_step, 4, 2)
    _check_cross_rank_traffic(results, 2)
    compare(results, reference, label="dp=4 ep=2")


def test_ep2_with_qat_equals_single_process():
    """QAT works with EP as is: weights are fake-quantised per expert row, inputs per token row."""
    ref = one_thread(single_step, True)
    results = run(2, distributed_step, 2, 2, True)
    _check_cross_rank_traffic(results, 2)
    compare(results, ref, label="dp=2 ep=2 qat")


def test_apply_expert_parallel_layout():
    """Local experts [ep_rank*E/ep, (ep_rank+1)*E/ep) as Shard(0) DTensors with the global shape."""

    def fn(rank, world):
        from torch.distributed.tensor import DTensor, Shard

        from k3.distributed.expert_parallel import apply_expert_parallel, expert_parameters
        from k3.distributed.mesh import ParallelDims, build_mesh

        meshes = build_mesh(ParallelDims(dp=2, ep=2))
        model = build_model()
        before = [p.detach().clone() for p in expert_parameters(model)]
        apply_expert_parallel(model, meshes)
        for b, p in zip(before, expert_parameters(model)):
            assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.shape == b.shape
            e = b.shape[0] // 2
            assert torch.equal(p.to_local(), b[rank * e : (rank + 1) * e])
            assert torch.equal(p.full_tensor(), b)
        with pytest.raises(ValueError, match="already"):
            apply_expert_parallel(model, meshes)
        return True

    assert run(2, fn) == [True, True]


def _packed_model():
    """The tiny model with its routed experts packed in MXFP4, the same on every rank."""
    return pack_model_experts(build_model()).eval()


def test_ep2_with_packed_experts_equals_single_process():
    """Inference with packed MXFP4 experts under EP 2: each rank keeps half of every bank's codes and scales and its
    logits for its rows equal one process's over the whole batch (fp32; the all-to-all only regroups the rows each
    dequantised expert multiplies, so the sums' order may differ: 1e-5)."""
    ids, _ = global_batch()
    with torch.no_grad():
        want = one_thread(lambda: _packed_model()(ids).logits)

    def fn(rank, world):
        from k3.distributed.expert_parallel import apply_expert_parallel, expert_parameters
        from k3.distributed.mesh import ParallelDims, build_mesh
        from k3.model.moe import moe_layers

        model = _packed_model()
        full = {n: b.clone() for n, b in model.named_buffers() if n.endswith(("_packed", "_scale"))}
        apply_expert_parallel(model, build_mesh(ParallelDims(dp=2, ep=2)))
        assert expert_parameters(model) == []  # packed banks hold no parameters
        for n, b in model.named_buffers():
            if n in full:
                e = full[n].shape[0] // world
                assert torch.equal(b, full[n][rank * e : (rank + 1) * e]), n
        rows = ROWS // world
        with torch.no_grad():
            logits = model(ids[rank * rows : (rank + 1) * rows]).logits
        sent = [m.expert_dispatch.last_send_counts for m in moe_layers(model)]
        return logits, sent

    results = run(2, fn)
    got = torch.cat([r[0] for r in results])
    assert (got - want).norm() / want.norm() <= RTOL
    assert all(sum(c[1 - rank] for c in sent) > 0 for rank, (_, sent) in enumerate(results))  # rows crossed ranks
