"""Activation checkpointing: each sub-layer's activations recomputed in the backward pass instead of kept.

Applied to a built model (before or after k3.distributed's wrappers, which it then includes): every decoder
layer's mixer (``self_attn``: KDA or MLA) and FFN (``mlp`` or ``block_sparse_moe``) gets a forward that runs
under ``torch.utils.checkpoint`` (non-reentrant) while autograd records. Autograd then keeps only each
sub-layer's inputs (the normalised AttnRes mix, the packing offsets) and outputs; everything inside (KDA's
projections, convs, gates and chunk state, MLA's attention inputs, the MoE's routing, gathered rows and expert
activations) is computed again during the backward pass, about one more forward of every sub-layer. The AttnRes
depth mixes stay outside (cheap; the two-phase form keeps one phase-1 output per mix).
Passes without autograd (evaluation, sampling, serving) and passes that write a KV / state cache run the plain
forward: a recomputed cache write would read the state the first run already replaced.
``context_fn`` (torch.utils.checkpoint's) returns the context managers around the forward and the
recomputation: context parallelism passes one that re-enters the CP context of the forward
(k3.distributed.context_parallel.recompute_context), since the backward runs after that context has exited.
Expert-parallel all-to-alls run again in the recomputation (the same order on every rank).
"""

from __future__ import annotations

import logging
import types
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("k3.train")
SUBLAYERS = ("self_attn", "mlp", "block_sparse_moe")


def _checkpointed_forward(self, *args, **kwargs):
    """The forward of a checkpointed sub-layer (bound to it, so copies of the model stay consistent)."""
    inner, context_fn, state_arg = self._k3_checkpointed
    has_state = state_arg is not None and (
        kwargs.get("state") is not None or (len(args) > state_arg and args[state_arg] is not None)
    )
    if not torch.is_grad_enabled() or has_state:
        return inner(*args, **kwargs)
    extra = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)


def apply_activation_checkpointing(model: nn.Module, context_fn: Callable | None = None) -> int:
    """Checkpoint every mixer and FFN of ``model`` (a K3ForCausalLM or K3ForConditionalGeneration); returns how
    many sub-layers were wrapped. Idempotent."""
    wrapped = 0
    for layer in model.model.layers:
        for name in SUBLAYERS:
            module = getattr(layer, name, None)
            if module is None or hasattr(module, "_k3_checkpointed"):
                continue
            state_arg = 2 if name == "self_attn" else None  # mixers: (x, cu_seqlens, state, seq_ids)
            module._k3_checkpointed = (module.forward, context_fn, state_arg)
            module.forward = types.MethodType(_checkpointed_forward, module)
            wrapped += 1
    log.info("activation checkpointing: %d sub-layers recomputed in the backward pass", wrapped)
    return wrapped
