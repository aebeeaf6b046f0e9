"""Expert parallelism with a latent all-to-all, applied to a built model.

``apply_expert_parallel(model, meshes)`` splits the routed experts of every MoE layer over the ``ep`` ranks: rank
``r`` keeps experts [r * E/ep, (r + 1) * E/ep), stored as DTensors on ``meshes.ep`` with placement Shard(0) (the
expert dim), so torch.distributed.checkpoint sees the global [E, ...] stacks. The ranks of one EP group hold
different tokens (they are data-parallel for everything else) and the same router (replicated), so one MoE layer
runs as:

  router (local tokens)  -> top-k experts and weights of every local token
  z = routed_expert_down_proj(x)                             the LATENT rows [N, l] travel, not x [N, d]
  counts all-to-all      -> how many rows each rank sends to each expert of each other rank ([ep, E/ep] ints)
  rows all-to-all        -> each (token, chosen expert) row of z goes to the rank owning the expert, grouped by
                            (source rank, local expert); differentiable (:class:`_AllToAll`, whose backward is the
                            reverse all-to-all; torch.distributed.nn.functional's is deprecated in torch 2.13)
  local experts          -> k3.ops.moe.moe_experts on the received rows, one local expert per row, weight 1
                            (the dispatched op: the grouped-GEMM kernel on GPUs)
  rows all-to-all back   -> each row returns to its source rank
  combine                -> y_t = sum_j p_tj E_j(z_t) on the source rank, in fp32, so the routing weights (and
                            through them the router) get their gradients there, exactly as on one device

Packed MXFP4 experts (inference, k3.quant.packed) are split the same way: each rank keeps its E/ep experts' codes
and scales as plain buffers and runs k3.ops.moe.mxfp4.moe_experts_packed on the rows it receives.

Backward runs the two all-to-alls in reverse; an expert's gradient on its rank then sums over every token of the
EP group, and :func:`k3.distributed.fsdp.reduce_expert_grads` sums it over the ranks holding replicas of the same
expert shard (``dp_rep`` x ``cp``). With QAT (``MoE.qat``) the local experts run on fake-quantised weights and
inputs: MXFP4 weights are quantised per expert row and MXFP8 inputs per token row, so quantising the local shard /
the received rows is exactly what one device does.

The model code never imports torch.distributed: the hook is ``MoE.expert_dispatch`` (None = local experts).
Every rank of an EP group must run every MoE forward and backward (the all-to-alls are collectives), also with
no tokens.

:class:`CommStats` (one per model, ``comm_stats(model)``) times every EP all-to-all (counts, rows, and the two
reverse ones of the backward) with CUDA events (host clocks on CPU) and counts the rows each rank receives: the
time a rank spends in them includes waiting for the slowest rank of its group, which is what expert-load imbalance
costs in a step.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from k3.model.moe import MoE, moe_layers
from k3.ops.dtypes import upcast
from k3.ops.moe import moe_experts
from k3.ops.moe.mxfp4 import moe_experts_packed
from k3.train.shards import local_shard

EXPERT_WEIGHTS = ("w1", "w2", "w3")


class CommStats:
    """Seconds spent in EP all-to-alls and latent rows received / sent by this rank since the last :meth:`take`."""

    def __init__(self):
        self._events: list[tuple] = []
        self._seconds = 0.0
        self.rows_received = 0
        self.rows_sent = 0

    @contextlib.contextmanager
    def timed(self, device: torch.device):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - t0

    def take(self) -> dict:
        """{"a2a_s", "rows_received", "rows_sent"} so far (synchronises the GPU), and start again from zero."""
        if self._events:
            torch.cuda.synchronize()
        seconds = self._seconds + sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        out = {"a2a_s": seconds, "rows_received": self.rows_received, "rows_sent": self.rows_sent}
        self.__init__()
        return out


class _AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` of rows: x [sum(send), ...] -> [sum(recv), ...]; the backward sends the
    row gradients back along the reverse splits."""

    @staticmethod
    def forward(ctx, x: Tensor, recv_splits: list[int], send_splits: list[int], group, stats=None) -> Tensor:
        ctx.splits, ctx.group, ctx.stats = (recv_splits, send_splits), group, stats
        return _all_to_all(x, recv_splits, send_splits, group, stats)

    @staticmethod
    def backward(ctx, grad: Tensor):
        recv_splits, send_splits = ctx.splits
        return _all_to_all(grad, send_splits, recv_splits, ctx.group, ctx.stats), None, None, None, None


def _all_to_all(x: Tensor, recv_splits: list[int], send_splits: list[int], group, stats=None) -> Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    with stats.timed(x.device) if stats is not None else contextlib.nullcontext():
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def all_to_all_rows(
    x: Tensor, recv_splits: list[int], send_splits: list[int], group, stats: CommStats | None = None
) -> Tensor:
    """Send rows x[sum(send_splits[:i]) : ...][send_splits[i]] to rank i of ``group``, receive recv_splits[i] rows
    from it (differentiable; timed into ``stats`` when given, backward included)."""
    return _AllToAll.apply(x, recv_splits, send_splits, group, stats)


class LatentAllToAll:
    """``MoE.expert_dispatch`` for one EP group: ``(moe, z [N, D], topk_idx [N, k], topk_weight [N, k]) -> [N, D]``.

    ``last_send_counts`` (ints, one per EP rank) is how many rows the last forward sent to each rank (for tests and
    load statistics); ``stats`` (:class:`CommStats`, shared by the layers of a model) accumulates all-to-all time
    and row counts."""

    def __init__(self, group, ep_size: int, ep_rank: int, num_experts: int, stats: CommStats | None = None):
        if num_experts % ep_size:
            raise ValueError(f"ep={ep_size} must divide the number of routed experts ({num_experts})")
        self.group, self.ep_size, self.ep_rank = group, ep_size, ep_rank
        self.num_experts, self.num_local = num_experts, num_experts // ep_size
        self.last_send_counts: list[int] | None = None
        self.stats = stats if stats is not None else CommStats()

    def __call__(self, moe: MoE, z: Tensor, topk_idx: Tensor, topk_weight: Tensor) -> Tensor:
        n, k = topk_idx.shape
        width = z.shape[-1]
        flat_expert = topk_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)  # rows grouped by expert, so by destination rank too
        token = order // k  # flat (token, slot) index -> token
        # [E] rows per global expert = [ep, E/ep] rows per (destination rank, its local expert)
        send_counts = torch.bincount(flat_expert, minlength=self.num_experts)
        recv_counts = torch.empty_like(send_counts)
        with self.stats.timed(z.device):  # [ep, E/ep]: (source, local expert)
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        counts = torch.stack([send_counts, recv_counts]).cpu()  # one host read per layer: the split sizes
        send_splits = counts[0].view(self.ep_size, self.num_local).sum(1).tolist()
        recv_splits = counts[1].view(self.ep_size, self.num_local).sum(1).tolist()
        self.last_send_counts = send_splits
        self.stats.rows_sent += sum(send_splits)
        self.stats.rows_received += sum(recv_splits)

        rows = z.index_select(0, token)  # [N*k, D], sorted by (destination, local expert)
        received = all_to_all_rows(rows, recv_splits, send_splits, self.group, self.stats)
        local_ids = torch.arange(self.num_local, device=z.device).repeat(self.ep_size)
        local_idx = torch.repeat_interleave(local_ids, recv_counts.to(z.device))
        out = local_experts(moe, received, local_idx)
        back = all_to_all_rows(out, send_splits, recv_splits, self.group, self.stats)
        weight = upcast(topk_weight.reshape(-1).index_select(0, order)).unsqueeze(-1)
        y = torch.zeros(n, width, dtype=torch.promote_types(z.dtype, torch.float32), device=z.device)
        return y.index_add(0, token, upcast(back) * weight).to(z.dtype)


def local_experts(moe: MoE, rows: Tensor, local_idx: Tensor) -> Tensor:
    """E_{local_idx[i]}(rows[i]) for rows sent to this rank's experts (routing weight 1; ``local_idx``: slots of
    this rank's bank): plain, QAT or packed MXFP4 banks, plain tensors or DTensor shards."""
    if rows.shape[0] == 0:  # keep the graph connected: the backward all-to-all must run on every rank
        return rows * 0
    ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    if getattr(moe.experts, "packed", False):  # this rank's packed bank: only the experts received are read
        return moe_experts_packed(rows, local_idx.unsqueeze(1), ones, moe.experts, moe.glu)
    w1, w2, w3 = (local_shard(getattr(moe.experts, name)) for name in EXPERT_WEIGHTS)
    idx = local_idx.unsqueeze(1)
    if moe.qat is None:
        return moe_experts(rows, idx, ones, w1, w2, w3, moe.glu)
    q = moe.qat
    return moe_experts(rows, idx, ones, q.weight(w1), q.weight(w2), q.weight(w3), moe.glu, act_quant=q.act_quant)


def _check_divides(ep: int, experts: int) -> None:
    if experts % ep:
        raise ValueError(f"--ep={ep} must divide the number of routed experts ({experts})")


def _keep_packed_shard(experts: nn.Module, lo: int, hi: int, device_type: str) -> None:
    """Keep experts [lo, hi) of a packed bank (k3.quant.packed.PackedExperts): its code and scale buffers sliced in
    place, plain local tensors (inference: no gradient, and a checkpoint is loaded before EP is applied)."""
    for name in EXPERT_WEIGHTS:
        for kind in ("packed", "scale"):
            full = getattr(experts, f"{name}_{kind}")
            if full.device.type != device_type:
                raise ValueError(f"expert weights on {full.device.type} but the mesh is on {device_type}")
            setattr(experts, f"{name}_{kind}", full[lo:hi].clone())


def comm_stats(model: nn.Module) -> CommStats | None:
    """The :class:`CommStats` of a model under expert parallelism (None without)."""
    return next(
        (m.expert_dispatch.stats for m in moe_layers(model) if isinstance(m.expert_dispatch, LatentAllToAll)), None
    )


def expert_parameters(model: nn.Module, expert_parallel_only: bool = False) -> list[nn.Parameter]:
    """The routed-expert stacks (w1, w2, w3 of every MoE layer), in module order; with ``expert_parallel_only``
    only those split by :func:`apply_expert_parallel` (not FSDP-sharded or plain ones). Packed banks hold no
    parameters and are left out."""
    return [
        getattr(m.experts, name)
        for m in moe_layers(model)
        if not getattr(m.experts, "packed", False)
        and (not expert_parallel_only or isinstance(m.expert_dispatch, LatentAllToAll))
        for name in EXPERT_WEIGHTS
    ]


def apply_expert_parallel(model: nn.Module, meshes) -> nn.Module:
    """Keep only this rank's E/ep experts of every MoE layer (DTensors, Shard(0) on ``meshes.ep``) and route the
    latent rows through :class:`LatentAllToAll`. In place; returns the model. No-op when ep == 1.

    Call on the built (and initialised / loaded) model, identical on every rank, BEFORE ``apply_fsdp`` (which
    leaves these DTensors to EP) and before building the optimiser. Parameters are sliced on their current
    device, which must be the mesh's device type. Packed experts (inference) keep their shard as plain buffers.
    """
    mesh = meshes.ep
    ep = mesh.size()
    layers = moe_layers(model)
    if ep == 1 or not layers:
        return model
    rank = mesh.get_local_rank()
    group = mesh.get_group()
    stats = CommStats()
    for moe in layers:
        if moe.expert_dispatch is not None:
            raise ValueError(f"MoE layer {moe.layer_idx} already has an expert dispatch (EP applied twice?)")
        if getattr(moe.experts, "packed", False):
            e = moe.experts.w1_packed.shape[0]
            _check_divides(ep, e)
            _keep_packed_shard(moe.experts, rank * (e // ep), (rank + 1) * (e // ep), mesh.device_type)
            moe.expert_dispatch = LatentAllToAll(group, ep, rank, e, stats)
            continue
        w1 = moe.experts.w1
        if not isinstance(w1, nn.Parameter) or isinstance(w1, DTensor):
            raise ValueError(
                f"apply_expert_parallel: MoE layer {moe.layer_idx} has no plain [E, I, D] expert "
                "parameters (already sharded?)"
            )
        e = w1.shape[0]
        _check_divides(ep, e)
        lo, hi = rank * (e // ep), (rank + 1) * (e // ep)
        for name in EXPERT_WEIGHTS:
            full = getattr(moe.experts, name)
            if full.device.type != mesh.device_type:
                raise ValueError(f"expert weights on {full.device.type} but the mesh is on {mesh.device_type}")
            local = full.detach()[lo:hi].clone()
            dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            setattr(moe.experts, name, nn.Parameter(dt, requires_grad=full.requires_grad))
        moe.expert_dispatch = LatentAllToAll(group, ep, rank, e, stats)
    return model
