"""FSDP2 data parallelism for the dense parameters, and the gradient reductions that go with it.

Gradient semantics (exact, not averaged): the trainer's loss on each rank is
    loss_r = (sum of rank r's token losses) / (number of valid labels in the GLOBAL batch),
so the gradient of the global loss sum_r loss_r is the SUM over ranks of the local gradients. Hence:
  * dense parameters: ``fully_shard`` over ``meshes.dp_cp`` with gradient divide factor 1 (reduce-scatter = sum);
  * routed experts (EP DTensors, ignored by FSDP): the all-to-all backward already sums every token of the EP
    group into the owning rank's expert gradient; :func:`reduce_expert_grads` then sums over the ranks holding
    replicas of the same expert shard (``dp_rep`` x ``cp``).
Both sums give the gradient of one big batch on one device (up to fp summation order).

Order on a built model: ``apply_expert_parallel`` -> ``apply_fsdp`` -> optimiser (K3Muon over the DTensor
parameters) -> per step: forward/backward -> ``reduce_expert_grads`` -> ``clip_grad_norm_`` -> ``optimizer.step``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from k3.distributed.expert_parallel import expert_parameters
from k3.model.decoder import DecoderLayer


def apply_fsdp(
    model: nn.Module, meshes, *, mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True
) -> nn.Module:
    """``fully_shard`` every decoder layer's mixer and FFN (:func:`fsdp_units`), then the root, over
    ``meshes.dp_cp`` (parameters Shard(0) over all ranks), leaving out every parameter that already is a DTensor
    (the EP expert stacks); gradients are summed over the ranks (divide factor 1, SUM reductions; see the module
    docstring). In place; returns the model.

    Call after :func:`k3.distributed.expert_parallel.apply_expert_parallel` (with ep == 1 the experts stay plain
    and FSDP shards them along the expert dim, which keeps whole expert matrices on each rank) and before the
    optimiser is built. ``mp_policy``: FSDP2 mixed precision (default: none; the trainer autocasts instead).
    """
    mesh = meshes.dp_cp
    ignored = {p for p in model.parameters() if isinstance(p, DTensor)}
    kwargs = dict(mesh=mesh, ignored_params=ignored or None)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for unit in fsdp_units(model):
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **kwargs)
    # the root's parameters (embeddings, final norm, lm_head, the layers' norms and AttnRes queries) are needed
    # again in backward before any hook could gather them: they stay unsharded between forward and backward
    fully_shard(model, reshard_after_forward=False, **kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # reduce-scatter with SUM and no scaling: a divide factor of 1 would otherwise become a PREMUL_SUM
            # op (NCCL-only; gloo rejects it), and ReduceOp.SUM is also NCCL's zero-copy path
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as their own FSDP units: each decoder layer's mixer (``self_attn``) and FFN
    (``mlp`` / ``block_sparse_moe``) - the layer's parameters but for its small norms and AttnRes queries.

    Not the DecoderLayer itself: it hands its outputs to the residual-stream object instead of returning them,
    so FSDP2 could not hook their gradients to gather the parameters again before the layer's backward; the
    mixer and FFN take and return tensors. (A MoE's router scores also feed the router statistics, but every
    backward use of its parameters depends on the gradient of its output, so the pre-backward gather runs first.)
    """
    units = []
    for layer in model.modules():
        if isinstance(layer, DecoderLayer):
            units += [getattr(layer, name) for name in ("self_attn", "mlp", "block_sparse_moe") if hasattr(layer, name)]
    return units


_REPLICA_MESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}


def expert_replica_mesh(meshes) -> DeviceMesh:
    """The 1-D mesh of the ranks holding the same expert shard as this one (``dp_rep`` x ``cp``)."""
    key = id(meshes.root)
    if key not in _REPLICA_MESHES:
        _REPLICA_MESHES[key] = (meshes.root, meshes.root["dp_rep", "cp"]._flatten("dp_rep_cp"))
    return _REPLICA_MESHES[key][1]


def reduce_expert_grads(model: nn.Module, meshes) -> None:
    """Sum the gradients of the expert-parallel stacks over the ranks that hold replicas of the same expert shard
    (one flat all-reduce); a missing gradient (no token reached this rank's experts) counts as zeros and is
    materialised, as on one device. Call on every rank after backward, before clipping and the optimiser step.
    No-op for plain (FSDP-managed or single-device) expert parameters."""
    params = [p for p in expert_parameters(model, expert_parallel_only=True) if p.requires_grad]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    mesh = expert_replica_mesh(meshes)
    if mesh.size() == 1:
        return
    grads = [p.grad.to_local() for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=mesh.get_group())
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _replicas(t: Tensor, world: int) -> int:
    """How many ranks of the world hold each element of t (DTensor: world / product of its sharded mesh dims)."""
    if not isinstance(t, DTensor):
        return world
    shards = math.prod(t.device_mesh.size(i) for i, pl in enumerate(t.placements) if isinstance(pl, Shard))
    return world // shards


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, meshes) -> Tensor:
    """Clip the global 2-norm of all gradients (FSDP shards, EP expert shards, replicated plain tensors) to
    ``max_norm``; returns the norm before clipping (fp32, the same on every rank). Every rank must call it.

    Each rank sums the squares of its local gradient shards, each element weighted by 1 / (number of ranks
    holding it), and one all-reduce over ``dp_cp`` gives the exact global sum. Call after
    :func:`reduce_expert_grads`."""
    world = meshes.dp_cp.size()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    device = grads[0].device if grads else torch.device(meshes.device_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        total += local.float().pow(2).sum() / _replicas(g, world)
    if world > 1:
        dist.all_reduce(total, group=meshes.dp_cp.get_group())
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.dtype))
    return norm
