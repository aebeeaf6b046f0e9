"""Attention Residuals: each sub-layer's input is a learned softmax mix over depth (spec §5).

A sub-layer is an attention or an FFN; each has a pseudo-query w (``*_res_proj.weight`` [1, d], zero at
init so every mix starts uniform) and a key RMSNorm (``*_res_norm.weight``). For sources v_i (raw [N, d]):
    h = sum_i softmax_i( (norm_weight * w) . v_i / rms(v_i) ) v_i
and the sub-layer then applies its own pre-norm to h. The four modes differ only in the sources:
- ``none``:      a plain residual stream r = embedding + all outputs; the input is r.
- ``snapshot``:  r as above; at the first layer of every block (layers 0, B, 2B, ...) r is appended to a bank;
                 every sub-layer mixes [bank..., r]. This is what engines loading the K3 checkpoint do.
- ``block_sum``: the paper's Block AttnRes: sources are the embedding, each completed block's *sum of
                 sub-layer outputs*, and the current block's partial sum (when non-empty).
- ``full``:      the embedding and every previous sub-layer output.
A final mix with ``output_attn_res_{norm,proj}`` precedes the final norm in every mode but ``none``.
Blocks are counted in decoder layers (K3: 12, so 7 full blocks and a 9-layer block over 93 layers).

Inference (no autograd) keeps the sources that stay fixed during the pass (the bank, every output in ``full``)
stacked in fp32 with their inverse RMS while the stack fits in STACK_BYTES (decode steps, short prefill chunks),
so a mix costs a few kernels whatever its depth (``k3.ops.attn_res.stacked``); training, and passes whose stack
would outgrow the budget (from that depth on), mix the source list as is (no fp32 copy of S x N x d).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3.model.norm import RMSNorm
from k3.ops.attn_res import FixedSources, depth_mix, depth_mix_stacked
from k3.ops.attn_res.reference import depth_weights

STACK_BYTES = 1 << 30  # inference stacks fixed sources in fp32 while S x N x d x 4 bytes stays within this


def make_mix_params(module: nn.Module, prefix: str, dim: int, eps: float) -> None:
    """Create ``{prefix}_norm`` (RMSNorm weight, ones) and ``{prefix}_proj`` (Linear d->1, zeros) on module."""
    setattr(module, f"{prefix}_norm", RMSNorm(dim, eps=eps))
    proj = nn.Linear(dim, 1, bias=False)
    nn.init.zeros_(proj.weight)
    setattr(module, f"{prefix}_proj", proj)


def mix(sources: list[Tensor], norm: nn.Module, proj: nn.Linear) -> Tensor:
    """Depth-mix a list of [N, d] sources with the query norm.weight * proj.weight -> [N, d]."""
    if len(sources) == 1:
        return sources[0]
    return depth_mix(sources, norm.weight * proj.weight[0], norm.eps)


class ResidualStream:
    """The residual bookkeeping of one forward pass. Call ``input`` before each sub-layer, ``add`` after it."""

    def __init__(self, mode: str, block_size: int, embedding: Tensor, record: bool = False):
        self.mode, self.block_size = mode, block_size
        # when recording: (layer, sub-layer, depth weights averaged over tokens [S]) for every mix
        self.records: list[tuple[int, str, Tensor]] | None = [] if record else None
        self.r = embedding  # running residual (none / snapshot)
        self.bank: list[Tensor] = []  # snapshot: r at block starts; block_sum: embedding + completed block sums
        self.partial: Tensor | None = None  # block_sum: current block's sum of outputs
        self.outputs: list[Tensor] = [embedding]  # full: embedding + every sub-layer output
        if mode == "block_sum":
            self.bank = [embedding]
        stack = mode != "none" and not record and not torch.is_grad_enabled()
        self.fixed = FixedSources() if stack else None

    def sources(self) -> list[Tensor]:
        if self.mode == "snapshot":
            return self.bank + [self.r]
        if self.mode == "block_sum":
            return self.bank + ([] if self.partial is None else [self.partial])
        if self.mode == "full":
            return self.outputs
        return [self.r]

    def input(self, layer: int, sublayer: str, norm: nn.Module | None, proj: nn.Linear | None) -> Tensor:
        """The input h of sub-layer ``sublayer`` ('attn' or 'mlp') of decoder layer ``layer``."""
        if sublayer == "attn" and layer % self.block_size == 0:
            if self.mode == "snapshot":
                self.bank.append(self.r)
            elif self.mode == "block_sum" and self.partial is not None:
                self.bank.append(self.partial)
                self.partial = None
        if self.mode == "none":
            return self.r
        return self._mix(layer, sublayer, norm, proj)

    def _fixed_and_live(self) -> tuple[list[Tensor], list[Tensor]]:
        """The sources split into those fixed for the rest of the pass and the live ones (in source order)."""
        if self.mode == "snapshot":
            return self.bank, [self.r]
        if self.mode == "block_sum":
            return self.bank, [] if self.partial is None else [self.partial]
        return self.outputs, []

    def _mix(self, layer: int, sublayer: str, norm: nn.Module, proj: nn.Linear) -> Tensor:
        if self.fixed is not None:
            fixed, live = self._fixed_and_live()
            if len(fixed) * fixed[0].numel() * 4 > STACK_BYTES:
                self.fixed = None  # the stack would outgrow its budget: the source list from here on
            else:
                if len(fixed) + len(live) == 1:
                    return (fixed + live)[0]
                self.fixed.sync(fixed, norm.eps)
                return depth_mix_stacked(self.fixed, live, norm.weight * proj.weight[0], norm.eps, self.r.dtype)
        sources = self.sources()
        if self.records is not None:
            with torch.no_grad():
                w = depth_weights(sources, norm.weight * proj.weight[0], norm.eps)
            self.records.append((layer, sublayer, w.mean(1).cpu()))
        return mix(sources, norm, proj)

    def add(self, out: Tensor) -> None:
        """Record a sub-layer output [N, d]."""
        if self.mode in ("none", "snapshot"):
            self.r = self.r + out
        elif self.mode == "block_sum":
            self.partial = out if self.partial is None else self.partial + out
        else:
            self.outputs.append(out)

    def output(self, norm: nn.Module | None, proj: nn.Linear | None) -> Tensor:
        """The final hidden state before the final norm."""
        if self.mode == "none":
            return self.r
        return self._mix(-1, "output", norm, proj)
