"""Activation checkpointing: each sub-layer's activations recomputed in the backward pass instead of kept.

Applied to a built model (before or after k3.distributed's wrappers, which it then includes): every decoder
layer's mixer (``self_attn``: KDA or MLA) and FFN (``mlp`` or ``block_sparse_moe``) runs its forward under
``torch.utils.checkpoint`` (non-reentrant) while autograd records. Autograd then keeps only each
sub-layer's inputs (the normalised AttnRes mix, the packing offsets) and outputs; everything inside (KDA's
projections, convs, gates and chunk state, MLA's attention inputs, the MoE's routing, gathered rows and expert
activations) is computed again during the backward pass, about one more forward of every sub-layer. The AttnRes
depth mixes stay outside (cheap; the two-phase form keeps one phase-1 output per mix).
Passes without autograd (evaluation, sampling, serving) and passes that write a KV / state cache run the plain
forward: a recomputed cache write would read the state the first run already replaced.
The recomputation gets the forward's own arguments: the offsets of a context-parallel shard carry its shard
(k3.distributed.context_parallel), so a recomputed mixer runs the same exchanges again, as expert-parallel
all-to-alls do (the same order on every rank).

How: a checkpointed sub-layer's class becomes a subclass of its own with :class:`Recomputed` in front (same
``__name__``), whose ``forward`` runs the class's forward under the checkpoint: what FSDP2's ``fully_shard`` does
to the modules it shards. A wrapper module (ours, or torch's ``checkpoint_wrapper`` /
``apply_activation_checkpointing``) does not fit this model: it moves the sub-layer one level down, so module and
buffer names change (torch's renames parameters and state-dict keys back, nothing else), ``isinstance`` checks on
``layer.self_attn`` (QK-Clip's hooks, MoE lookups) see the wrapper, and attributes set through it
(``moe.fp8 = True``) land on the wrapper; the sub-layer's own hooks (FSDP2's parameter gathering, QK-Clip's
logit capture) would run inside the checkpoint and again in the recomputation, where here they run once, outside;
and torch's wrapper checkpoints every call, cache-writing ones too. torch's composable ``checkpoint(module)`` keeps
the names but also re-runs the hooks and cannot skip a call.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("k3.train")
SUBLAYERS = ("self_attn", "mlp", "block_sparse_moe")
STATE_ARG = {"self_attn": 2}  # mixers: (x, cu_seqlens, state, seq_ids); a given state means a cache write


class Recomputed(nn.Module):
    """Put in front of a sub-layer's class by :func:`apply_activation_checkpointing`: ``forward`` is the class's
    own under torch.utils.checkpoint while autograd records, unless the call writes a cache (a ``state`` given as
    keyword or at position ``state_arg``, which is None for FFNs)."""

    state_arg: int | None = None

    def forward(self, *args, **kwargs):
        inner = super().forward  # bound to this module: a copy of the model recomputes its own parameters
        i = self.state_arg
        writes_cache = i is not None and (kwargs.get("state") is not None or (len(args) > i and args[i] is not None))
        if not torch.is_grad_enabled() or writes_cache:
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)


_classes: dict[tuple[type, int | None], type] = {}


def recomputed_class(cls: type, state_arg: int | None) -> type:
    """``cls`` with :class:`Recomputed` in front, one class per (cls, state_arg), named as ``cls`` (printed models
    and the names autograd and profilers show stay as they were)."""
    key = (cls, state_arg)
    if key not in _classes:
        _classes[key] = type(
            cls.__name__, (Recomputed, cls), {"state_arg": state_arg, "__qualname__": f"Recomputed[{cls.__qualname__}]"}
        )
    return _classes[key]


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Checkpoint every mixer and FFN of ``model`` (a K3ForCausalLM or K3ForConditionalGeneration), in place;
    returns how many sub-layers were made :class:`Recomputed`. Idempotent."""
    wrapped = 0
    for layer in model.model.layers:
        for name in SUBLAYERS:
            module = getattr(layer, name, None)
            if module is None or isinstance(module, Recomputed):
                continue
            module.__class__ = recomputed_class(type(module), STATE_ARG.get(name))
            wrapped += 1
    log.info("activation checkpointing: %d sub-layers recomputed in the backward pass", wrapped)
    return wrapped
