"""Optimiser for K3 (docs/architecture.md#muon): per-head Muon + AdamW in one ``torch.optim.Optimizer``, the cosine
schedule and gradient clipping (QK-Clip for the MLA layers: k3.train.qk_clip).

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

import functools
import math
from collections.abc import Iterable
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor, nn

from k3.model.kda import KimiDeltaAttention
from k3.model.lora import LoRA
from k3.model.mla import MultiheadLatentAttention
from k3.model.moe import RoutedExperts, Router
from k3.ops.dtypes import autocast_off

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_BATCH_BYTES = 256 << 20  # most bytes (in the NS dtype) orthogonalised in one batched Newton-Schulz call
KINDS = ("muon_head", "muon_expert", "muon", "adamw")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _dtype_name(dtype: torch.dtype | str | None) -> str:
    if dtype is None:
        return "float32"
    if isinstance(dtype, torch.dtype):
        for name, d in _DTYPES.items():
            if d == dtype:
                return name
        raise ValueError(f"ns_dtype={dtype} is not supported; choose one of {list(_DTYPES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"ns_dtype={dtype!r} is not supported; choose one of {list(_DTYPES)}")
    return dtype


# --------------------------------------------------------------------------------------------------------------
# Newton-Schulz
# --------------------------------------------------------------------------------------------------------------


@autocast_off  # runs in its ``dtype`` also if called under autocast
def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coeffs: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype | str | None = None,
) -> Tensor:
    """Approximate orthogonalisation U S' V^T (S'_ii roughly in (0.5, 1.5)) of every matrix in G [..., A, B].

    Each matrix is divided by max(||X||_F, eps) (the placement ``torch.optim.Muon`` uses) and iterated ``steps``
    times with X <- a X + P X, P = b XX^T + c (XX^T)^2, on its wide form (X^T when A > B). The whole computation runs
    in ``dtype`` (None = fp32); the result has shape [..., A, B] and that dtype — the caller casts.
    A tall matrix is iterated in its own layout, as the transpose of that recurrence (Gram matrix X^T X,
    X <- a X + X P^T): the same products without copying transposed views, so faster, and bitwise equal to iterating
    X^T in our measurements (docs/decisions.md, "Newton-Schulz in a tall block's own layout").
    """
    if G.dim() < 2:
        raise ValueError(f"newton_schulz needs a [..., A, B] tensor, got shape {tuple(G.shape)}")
    a, b, c = coeffs
    X = G.to(_DTYPES[_dtype_name(dtype)])
    rows, cols = X.shape[-2:]
    lead = X.shape[:-2]
    X = X.reshape(-1, rows, cols)
    tall = rows > cols
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = X.mT @ X if tall else X @ X.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # P = b gram + c gram^2
        X = torch.baddbmm(X, X, poly.mT, beta=a) if tall else torch.baddbmm(X, poly, X, beta=a)  # a X + P X
    return X.reshape(*lead, rows, cols)


def block_shape(group: dict, shape) -> tuple[int, int]:
    """[rows, cols] of the blocks Newton-Schulz orthogonalises one by one in a parameter of ``shape`` of a Muon
    ``group``: a head [head_dim, in] (muon_head), else the last two dims (an expert matrix, or the whole matrix)."""
    return (group["head_dim"], shape[1]) if group["kind"] == "muon_head" else tuple(shape[-2:])


def ns_batches(items: Iterable[tuple], budget: int) -> dict:
    """[(key, elements, item)] -> {key: [[item, ...], ...]}: the items of each key (blocks of one shape, on one
    device) in order, batched for one Newton-Schulz call each: a new batch whenever an item would take a non-empty
    one past ``budget`` elements (an item larger than the budget gets a batch of its own)."""
    batches: dict = {}
    filled: dict = {}  # key -> elements in its last batch
    for key, size, item in items:
        queue = batches.setdefault(key, [[]])
        if queue[-1] and filled[key] + size > budget:
            queue.append([])
            filled[key] = 0
        queue[-1].append(item)
        filled[key] = filled.get(key, 0) + size
    return batches


def muon_scale(rows: int, cols: int, rule: str = "match_rms_adamw") -> float:
    """The lr multiplier for one orthogonalised [rows, cols] block: Moonlight 0.2*sqrt(max) or Keller's original."""
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"scale_rule={rule!r} must be 'match_rms_adamw' or 'original'")


# --------------------------------------------------------------------------------------------------------------
# The optimiser
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# DTensor parameters (FSDP2 / expert parallelism): local views, and whole matrices for Newton-Schulz
# --------------------------------------------------------------------------------------------------------------


@functools.cache
def _dtensor_type():
    """torch.distributed.tensor.DTensor, imported on first use (None on builds without torch.distributed)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(t: Tensor) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_shard(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view: in-place updates reach the DTensor); plain tensors unchanged."""
    return t.to_local() if _is_dtensor(t) else t


def _sharded_only_on_dim0(p: Tensor) -> bool:
    """Every shard of the DTensor p holds whole slices along dim 0 (for an expert stack: whole expert matrices)."""
    from torch.distributed.tensor import Replicate, Shard

    return all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in p.placements)


def _full(local: Tensor, like: Tensor) -> Tensor:
    """The whole tensor of which ``local`` is this rank's shard, sharded like the DTensor ``like`` (all-gather)."""
    cls = _dtensor_type()
    return cls.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    ).full_tensor()


def _shard_like(full: Tensor, like: Tensor) -> Tensor:
    """This rank's shard of ``full`` (identical on every rank) under the placements of ``like`` (no communication)."""
    from torch.distributed.tensor import Replicate

    cls, mesh = _dtensor_type(), like.device_mesh
    replicated = cls.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()


# --------------------------------------------------------------------------------------------------------------
# Parameter groups
# --------------------------------------------------------------------------------------------------------------


def _head_dims(config) -> dict[type, dict[str, int]]:
    """Rows per head of every per-head projection, keyed by attention class and projection name."""
    k, m = config.kda, config.mla
    return {
        KimiDeltaAttention: {
            "q_proj": k.head_dim,
            "k_proj": k.head_dim,
            "v_proj": k.v_head_dim,
            "g_proj": k.v_head_dim,
        },
        MultiheadLatentAttention: {
            "q_proj": m.qk_head_dim,
            "q_b_proj": m.qk_head_dim,
            "kv_b_proj": m.qk_nope_head_dim + m.v_head_dim,
            "g_proj": m.v_head_dim,
        },
    }


def classify_parameters(
    model: nn.Module, per_head: bool = True, router: str = "muon", config=None
) -> list[tuple[str, Tensor, str, int | None, bool]]:
    """(name, param, kind, head_dim, decay) for every trainable parameter, in ``named_parameters`` order.

    Rules, first match wins:
      LoRA adapters (lora_A, lora_B; k3.model.lora)        -> adamw, no decay
      embeddings, lm_head                                  -> adamw, decay
      convs (q/k/v_conv1d, any *conv* weight)              -> adamw, no decay
      AttnRes *_res_proj / *_res_norm                      -> adamw, no decay
      1-D (norms, biases, A_log, dt_bias)                  -> adamw, no decay
      routed expert stacks (experts.w1/w2/w3)              -> muon_expert
      MoE router gate.weight                               -> ``router`` ("muon" default, or "adamw" with decay)
      KDA q/k_proj (head_dim), v/g_proj (v_head_dim);
      MLA q_proj | q_b_proj (qk_nope+qk_rope), kv_b_proj (qk_nope+v), g_proj (v)   -> muon_head (muon if not per_head)
      any other 2-D matrix                                 -> muon
      anything else (e.g. a >2-D non-expert weight)        -> adamw, no decay
    """
    if router not in ("muon", "adamw"):
        raise ValueError(f"router={router!r} must be 'muon' or 'adamw'")
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError("param_groups_for needs model.config (a K3Config) or config=")
    heads = _head_dims(config)
    modules = dict(model.named_modules())
    lm_head = getattr(model, "lm_head", None)
    out, seen = [], set()
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{pname}" if mod_name else pname
            parent_name, _, leaf = mod_name.rpartition(".")
            parent = modules.get(parent_name)
            if isinstance(mod, LoRA):  # low-rank factors: AdamW, as LoRA trains them
                out.append((name, p, "adamw", None, False))
            elif isinstance(mod, nn.Embedding) or (lm_head is not None and mod is lm_head):
                out.append((name, p, "adamw", None, True))
            elif isinstance(mod, nn.modules.conv._ConvNd) or "conv" in pname:
                out.append((name, p, "adamw", None, False))
            elif leaf.endswith(("_res_proj", "_res_norm")):
                out.append((name, p, "adamw", None, False))
            elif p.dim() < 2:
                out.append((name, p, "adamw", None, False))
            elif isinstance(mod, RoutedExperts):
                out.append((name, p, "muon_expert", None, True))
            elif isinstance(mod, Router):
                out.append((name, p, router, None, True))
            elif p.dim() == 2:
                # isinstance, not type(): FSDP2 swaps a sharded module's class for a subclass of it
                per_class = next((v for cls, v in heads.items() if isinstance(parent, cls)), {})
                hd = per_class.get(leaf) if isinstance(mod, nn.Linear) else None
                if hd is not None and per_head:
                    if p.shape[0] % hd:
                        raise ValueError(f"{name} has {p.shape[0]} rows, not a multiple of its head size {hd}")
                    out.append((name, p, "muon_head", hd, True))
                else:
                    out.append((name, p, "muon", None, True))
            else:
                out.append((name, p, "adamw", None, False))
    return out


def param_groups_for(
    model: nn.Module, lr: float, weight_decay: float = 0.1, per_head: bool = True, router: str = "muon", config=None
) -> list[dict]:
    """Param groups for :class:`K3Muon`: one group per (kind, head_dim, decay), in first-seen order.

    Each group: ``params``, ``param_names``, ``kind``, ``lr``, ``weight_decay`` (``weight_decay`` or 0 for
    the no-decay AdamW group) and ``head_dim`` (muon_head only). See :func:`classify_parameters`.
    """
    groups: dict[tuple, dict] = {}
    for name, p, kind, hd, decay in classify_parameters(model, per_head, router, config):
        key = (kind, hd, decay)
        if key not in groups:
            groups[key] = {
                "params": [],
                "param_names": [],
                "kind": kind,
                "lr": lr,
                "weight_decay": weight_decay if decay else 0.0,
            }
            if hd is not None:
                groups[key]["head_dim"] = hd
        groups[key]["params"].append(p)
        groups[key]["param_names"].append(name)
    return list(groups.values())


def describe_groups(groups: Iterable[dict]) -> str:
    """A small table (one line per group) of kind, head_dim, weight decay, tensor and element counts."""
    lines = [f"{'kind':<12} {'head_dim':>8} {'wd':>6} {'tensors':>8} {'elements':>14}"]
    totals: dict[str, int] = {}
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        totals[g["kind"]] = totals.get(g["kind"], 0) + n
        hd = g.get("head_dim")
        lines.append(
            f"{g['kind']:<12} {'-' if hd is None else hd:>8} {g['weight_decay']:>6g} {len(g['params']):>8} {n:>14,}"
        )
    total = sum(totals.values()) or 1
    lines.append("share: " + ", ".join(f"{k} {v / total:.1%}" for k, v in totals.items()))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# Schedule and clipping
# --------------------------------------------------------------------------------------------------------------


def cosine_schedule(step: int, total_steps: int, warmup_frac: float = 0.01, min_ratio: float = 0.1) -> float:
    """lr multiplier for 0-based optimiser step ``step``.

    Linear warmup over W = max(1, round(warmup_frac * total_steps)) steps: (step + 1) / W, so step 0 uses 1/W
    and step W - 1 uses 1. Then cosine from 1 at step W - 1 down to ``min_ratio`` at the last step
    total_steps - 1; later steps stay at ``min_ratio``.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps={total_steps} must be positive")
    warmup = max(1, round(warmup_frac * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    span = total_steps - warmup  # steps W-1 .. total-1
    progress = min(1.0, (step - warmup + 1) / span) if span > 0 else 1.0
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(
    opt: torch.optim.Optimizer, total_steps: int, warmup_frac: float = 0.01, min_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR with :func:`cosine_schedule`; call ``scheduler.step()`` after every ``opt.step()``."""
    fn = partial(cosine_schedule, total_steps=total_steps, warmup_frac=warmup_frac, min_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(opt, fn)


def clip_grad_norm(model_or_params, max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Clip the global gradient norm (``torch.nn.utils.clip_grad_norm_``); returns the norm before clipping."""
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
