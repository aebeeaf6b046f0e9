"""The optimiser for K3 (docs/architecture.md#muon): :class:`K3Muon`, per-head Muon + AdamW in one
``torch.optim.Optimizer``. Its parameter groups come from k3.train.param_groups, the lr schedule and gradient
clipping from k3.train.schedule, Newton-Schulz from k3.train.newton_schulz (QK-Clip for the MLA layers:
k3.train.qk_clip).

Muon update of one matrix (or one block of it) with gradient G, momentum buffer B (EMA form, as in
``torch.optim.Muon``), mu = 0.95, Nesterov:

    B <- lerp(B, G, 1 - mu)                    U = lerp(G, B, mu)      (U = B without Nesterov)
    O = NS5(U)                                 quintic Newton-Schulz, Frobenius-normalised, tall blocks transposed
    W <- W * (1 - lr * wd)                     decoupled weight decay with the unadjusted lr
    W <- W - lr * 0.2 * sqrt(max(A, B)) * O    Moonlight "match RMS of AdamW" scale, A x B = the block's shape

The EMA form is (1 - mu) times the classical sum form; NS divides by the norm first, so the update is the same.

Parameter-group kinds (key ``kind``):
  ``muon_head``   2-D [H*d_h, in] viewed as H blocks [d_h, in]; one NS per block (batched); scale per block
                  0.2*sqrt(max(d_h, in)). The per-block scale is our choice on an open point (docs/decisions.md):
                  it keeps every block's update RMS at ~0.2, like a whole-matrix Muon update.
  ``muon_expert`` 3-D stacks [E, out, in]; one NS per expert matrix; scale 0.2*sqrt(max(out, in)).
  ``muon``        the whole 2-D matrix; scale 0.2*sqrt(max(A, B)).
  ``adamw``       AdamW (betas 0.9/0.95, eps 1e-8) with the same decoupled weight decay rule.
One learning rate for every group (Moonlight scaling lets AdamW's lr carry over); a group may carry
``lr_scale`` (default 1), which multiplies its lr for both the update and the weight decay.
The Newton-Schulz dtype is the group key ``ns_dtype`` ("float32" default; the trainer passes "bfloat16" on
GPU, which is what ``torch.optim.Muon`` always uses).

State (per parameter): ``momentum_buffer`` for Muon kinds; ``exp_avg``, ``exp_avg_sq`` and an int ``step``
for AdamW. Everything lives in the standard ``Optimizer.state_dict()`` so a resumed run is bitwise identical.

Distributed parameters (DTensors: FSDP2 shards, expert-parallel stacks; see k3.distributed): the state has the
parameter's placements (so torch.distributed.checkpoint reshards it) and every element-wise step runs on the
local shards. Newton-Schulz needs whole matrices: a ``muon_expert`` stack sharded only along its expert dim (EP,
or FSDP's Shard(0)) holds whole expert matrices locally and is orthogonalised in place; any other sharded matrix
has its update gathered (``full_tensor``), orthogonalised whole (per head), and each rank keeps its own shard.
For plain tensors the arithmetic is exactly the single-device one.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from k3.train.newton_schulz import (
    NS_COEFFICIENTS,
    _DTYPES,
    _dtype_name,
    block_shape,
    muon_scale,
    newton_schulz,
    ns_batches,
)
from k3.train.shards import _full, _is_dtensor, _shard_like, _sharded_only_on_dim0, local_shard

NS_BATCH_BYTES = 256 << 20  # most bytes (in the NS dtype) orthogonalised in one batched Newton-Schulz call
KINDS = ("muon_head", "muon_expert", "muon", "adamw")


class K3Muon(torch.optim.Optimizer):
    """Per-head Muon + AdamW. Every param group has a ``kind`` (see the module docstring).

    Defaults (overridable per group): lr, weight_decay 0.1, kind "muon", lr_scale 1, head_dim None (required
    for ``muon_head``), momentum 0.95, nesterov True, ns_coefficients, ns_steps 5, eps 1e-7 (NS), ns_dtype
    "float32", scale_rule "match_rms_adamw", betas (0.9, 0.95), adam_eps 1e-8.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        kind: str = "muon",
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_steps: int = 5,
        eps: float = 1e-7,
        ns_dtype: torch.dtype | str | None = None,
        scale_rule: str = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        lr_scale: float = 1.0,
        head_dim: int | None = None,
    ):
        if lr < 0:
            raise ValueError(f"lr={lr} must be >= 0")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            kind=kind,
            lr_scale=lr_scale,
            head_dim=head_dim,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            ns_steps=ns_steps,
            eps=eps,
            ns_dtype=_dtype_name(ns_dtype),
            scale_rule=scale_rule,
            betas=tuple(betas),
            adam_eps=adam_eps,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["ns_dtype"] = _dtype_name(group["ns_dtype"])
        kind = group["kind"]
        if kind not in KINDS:
            raise ValueError(f"param group kind={kind!r} must be one of {KINDS}")
        muon_scale(2, 1, group["scale_rule"])  # validates the rule
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"momentum={group['momentum']} must be in [0, 1)")
        if group["weight_decay"] < 0:
            raise ValueError(f"weight_decay={group['weight_decay']} must be >= 0")
        for p in group["params"]:
            if kind == "muon" and p.dim() != 2:
                raise ValueError(f"kind 'muon' needs 2-D parameters, got shape {tuple(p.shape)}")
            if kind == "muon_expert" and p.dim() < 3:
                raise ValueError(f"kind 'muon_expert' needs [E, out, in] stacks, got shape {tuple(p.shape)}")
            if kind == "muon_head":
                hd = group["head_dim"]
                if not isinstance(hd, int) or hd <= 0:
                    raise ValueError(f"kind 'muon_head' needs a positive int head_dim, got {hd!r}")
                if p.dim() != 2 or p.shape[0] % hd:
                    raise ValueError(f"kind 'muon_head' needs [H*{hd}, in] parameters, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the largest groups first: their GPU work (the experts' Newton-Schulz) runs while the host launches the
        # many small kernels of the rest; every group's update is independent of the others'
        for group in sorted(self.param_groups, key=lambda g: -sum(p.numel() for p in g["params"])):
            if group["kind"] == "adamw":
                self._adamw_group(group)
            else:
                self._muon_group(group)
        return loss

    def _with_grads(self, group: dict):
        """(parameter, gradient, state) for every parameter of the group that has a gradient."""
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse or torch.is_complex(p):
                raise RuntimeError("K3Muon supports dense real parameters only")
            yield p, p.grad, self.state[p]

    def _muon_group(self, group: dict) -> None:
        """Momentum, then Newton-Schulz on every matrix block, batched over the group's parameters whose blocks
        have the same shape and device (up to NS_BATCH_BYTES per call: one call orthogonalises many small
        matrices), then the decoupled weight decay and the scaled update. The momentum, weight decay and update run
        as foreach kernels per batch (small-1b's 'muon' group holds 114 matrices; launched one by one, its step
        was host-bound on a GPU); each Nesterov update is written straight into the batch in the NS dtype."""
        lr = group["lr"] * group["lr_scale"]
        wd, mu, kind = group["weight_decay"], group["momentum"], group["kind"]
        ns_dtype = _DTYPES[group["ns_dtype"]]

        def queued():  # ((device, rows, cols), elements, _Queued) of each parameter with a gradient
            for p, g, state in self._with_grads(group):
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
                gathered = _is_dtensor(p) and not (kind == "muon_expert" and _sharded_only_on_dim0(p))
                shape = p.shape if gathered else local_shard(g).shape  # gathered: NS sees the whole matrix
                yield (
                    (local_shard(g).device, *block_shape(group, shape)),
                    math.prod(shape),
                    _Queued(p, local_shard(g), local_shard(state["momentum_buffer"]), gathered, shape),
                )

        budget = NS_BATCH_BYTES // torch.empty((), dtype=ns_dtype).element_size()  # elements per call
        for (_, rows, cols), queue in ns_batches(queued(), budget).items():
            scale = muon_scale(rows, cols, group["scale_rule"])
            for batch in queue:
                params = [local_shard(q.param) for q in batch]
                torch._foreach_lerp_([q.buf for q in batch], [q.grad for q in batch], 1 - mu)
                counts = [math.prod(q.shape) // (rows * cols) for q in batch]
                blocks = torch.empty(sum(counts), rows, cols, dtype=ns_dtype, device=params[0].device)
                for q, dst in zip(batch, blocks.split(counts)):
                    dst = dst.view(q.shape)  # the update goes straight into the batch, in the NS dtype
                    if q.gathered:  # whole matrices: gather the update, orthogonalise it whole, keep this rank's shard
                        dst.copy_(_full(q.grad.lerp(q.buf, mu) if group["nesterov"] else q.buf, q.param))
                    elif group["nesterov"]:
                        torch.lerp(q.grad, q.buf, mu, out=dst)
                    else:
                        dst.copy_(q.buf)
                ortho = newton_schulz(blocks, group["ns_steps"], group["ns_coefficients"], group["eps"], ns_dtype)
                ortho = [
                    _shard_like(o.reshape(q.param.shape), q.param) if q.gathered else o.reshape(p.shape)
                    for o, p, q in zip(ortho.split(counts), params, batch)
                ]
                _mul_(params, 1 - lr * wd)
                torch._foreach_add_(params, ortho, alpha=-lr * scale)

    def _adamw_group(self, group: dict) -> None:
        """AdamW with foreach kernels: a few launches per group instead of a few per tensor (the group holds every
        norm, bias and conv: ~150 small tensors in small-1b). Tensors are batched by (step count, device, dtype);
        step counts differ only for parameters that had no gradient on some earlier step."""
        lr = group["lr"] * group["lr_scale"]
        wd, (beta1, beta2), eps = group["weight_decay"], group["betas"], group["adam_eps"]
        batches: dict[tuple, tuple[list, list, list, list]] = {}
        for p, g, state in self._with_grads(group):
            if "step" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            tensors = [local_shard(t) for t in (p, g, state["exp_avg"], state["exp_avg_sq"])]
            lists = batches.setdefault((state["step"], tensors[0].device, tensors[0].dtype), ([], [], [], []))
            for dst, t in zip(lists, tensors):
                dst.append(t)
        for (t, _, _), (ps, gs, ms, vs) in batches.items():
            _mul_(ps, 1 - lr * wd)
            torch._foreach_lerp_(ms, gs, 1 - beta1)
            _mul_(vs, beta2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, math.sqrt(1 - beta2**t))
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(ps, ms, denom, value=-lr / (1 - beta1**t))


class _Queued(NamedTuple):
    """A parameter waiting for its batched Newton-Schulz: grad and momentum buffer are this rank's shards; shape is
    what Newton-Schulz sees (the whole matrix when gathered)."""

    param: Tensor
    grad: Tensor
    buf: Tensor
    gathered: bool
    shape: torch.Size


def _mul_(tensors: list[Tensor], c: float) -> None:
    """t *= c for every tensor, as ``t.mul_(c)`` computes it (in fp32 for bf16 / fp16 tensors). The foreach form
    runs on fp32 / fp64 lists; reduced-precision tensors go one by one, because ``torch._foreach_mul_`` rounds c
    to their dtype first on CPU (bf16: 1 - 2e-3 -> 0.99609, a decay twice too strong)."""
    wide = [t for t in tensors if t.dtype in (torch.float32, torch.float64)]
    if wide:
        torch._foreach_mul_(wide, c)
    for t in tensors:
        if t.dtype not in (torch.float32, torch.float64):
            t.mul_(c)
