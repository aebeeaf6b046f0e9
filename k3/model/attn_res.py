"""Attention Residuals: each sub-layer's input is a learned softmax mix over depth (docs/architecture.md#attnres).

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

Every mix runs in the two-phase form (k3.ops.attn_res.two_phase): when a block starts, phase 1 scores the
block's mixes (2 per layer, and the output mix after the last block) against the sources that stay fixed for
the block: the bank (snapshot, block_sum) or the outputs before the block (full); each mix then merges its live
sources (r; the partial sum; the block's own outputs) by online softmax, at most MERGE_SOURCES of them at once.
Phase 1 materialises o [M, N, d] for M mixes; it covers as many of the block's mixes at once as fit in
TWO_PHASE_BYTES (at least one), so long passes (1M-token prefill) do it mix by mix, and it scores at most
PHASE1_SOURCES fixed sources at a time (mode full's long lists in pieces). In modes snapshot and block_sum,
passes that build no autograd graph (inference) and passes of at most DIRECT_TOKENS tokens skip phase 1: each mix
reads all its sources in one pass (``attn_res_mix_norm``: compiled, one kernel per mix). The two forms round
differently (phase 1 stores o in the sources' dtype), so inference never switches between them by the pass's
length: a token's mix is the same whether its pass holds it alone or packed with other sequences. Recording the
depth weights (audit) mixes with the reference instead.
The stream also applies the sub-layer's pre-norm (and the final norm) to the mix, compiled together with the
merge (``attn_res_merge_norm``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3.model.norm import RMSNorm, rms_norm
from k3.ops.attn_res import attn_res_fold, attn_res_merge, attn_res_phase1_pieces, depth_mix, depth_weights
from k3.ops.attn_res.two_phase import source_logit
from k3.ops.fused import fused

TWO_PHASE_BYTES = 1 << 30  # phase 1 computes at most this many bytes of o [M, N, d] at once (at least one mix)
DIRECT_TOKENS = 512  # training passes of at most this many tokens mix every source in one pass, no phase 1, in
# modes snapshot and block_sum (inference passes always do): their few sources (the bank + 1) are cheap to re-read
# at every mix, and the compiled mix is one version per source count (mode full has a count per layer: it keeps
# the two phases)
MERGE_SOURCES = 4  # a merge takes at most this many live sources; mode full folds the block's earlier outputs
# into phase 1's result this many at a time first (attn_res_fold), so the compiled merge and fold have a few
# versions, not one per sub-layer of a block (up to 24 at K3's blocks of 12 layers)
PHASE1_SOURCES = 24  # phase 1 scores the fixed sources this many at a time (mode full: every earlier block's
# outputs, up to 169 at K3's depth), so its compiled versions take at most this many, not one version per block


@fused
def attn_res_merge_norm(
    o: Tensor,
    lse: Tensor,
    live: list[Tensor],
    query: Tensor,
    eps: float,
    weight: Tensor,
    norm_eps: float,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """The phase-2 merge (k3.ops.attn_res.two_phase.attn_res_merge) followed by the sub-layer's pre-norm
    (rms_norm with ``weight``, ``norm_eps``, ``out_dtype``), compiled as one graph on CUDA so the norm is fused
    into the merge rather than a pass of its own over h. [N, d] -> [N, d]."""
    return rms_norm.reference(attn_res_merge.reference(o, lse, live, query, eps), weight, norm_eps, out_dtype)


@fused
def attn_res_mix_norm(
    query: Tensor,
    sources: list[Tensor],
    eps: float,
    weight: Tensor,
    norm_eps: float,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """A whole mix of S >= 2 sources [N, d] in one pass, then the sub-layer's pre-norm: the phase-2 merge with the
    first source in the place of phase 1's result (its own logit as the log-sum-exp), which is the depth mix of
    all S. For passes of few tokens (a decode step): compiled, one kernel per mix and no phase 1. -> [N, d]."""
    lse = source_logit(sources[0], query, eps)
    h = attn_res_merge.reference(sources[0], lse, sources[1:], query, eps)
    return rms_norm.reference(h, weight, norm_eps, out_dtype)


def make_mix_params(module: nn.Module, prefix: str, dim: int, eps: float) -> None:
    """Create ``{prefix}_norm`` (RMSNorm weight, ones) and ``{prefix}_proj`` (Linear d->1, zeros) on module."""
    setattr(module, f"{prefix}_norm", RMSNorm(dim, eps=eps))
    proj = nn.Linear(dim, 1, bias=False)
    nn.init.zeros_(proj.weight)
    setattr(module, f"{prefix}_proj", proj)


class ResidualStream:
    """The residual bookkeeping of one forward pass. Call ``input`` before each sub-layer, ``add`` after it,
    ``output`` at the end. ``mixers``: the (key norm, pseudo-query proj) of every mix in order (attn and mlp of
    each layer, then the output mix); unused in mode ``none``."""

    def __init__(
        self,
        mode: str,
        block_size: int,
        embedding: Tensor,
        mixers: list[tuple[nn.Module, nn.Linear]] | None = None,
        record: bool = False,
    ):
        if mode != "none" and (mixers is None or len(mixers) % 2 != 1):
            raise ValueError(f"AttnRes mode {mode!r} needs 2 mixers per layer plus the output mixer")
        self.mode, self.block_size, self.mixers = mode, block_size, mixers
        self.num_layers = len(mixers) // 2 if mixers else 0
        # when recording: (layer, sub-layer, depth weights averaged over tokens [S]) for every mix
        self.records: list[tuple[int, str, Tensor]] | None = [] if record else None
        self.r = embedding  # running residual (none / snapshot)
        self.bank: list[Tensor] = []  # snapshot: r at block starts; block_sum: embedding + completed block sums
        self.partial: Tensor | None = None  # block_sum: current block's sum of outputs
        self.outputs: list[Tensor] = [embedding]  # full: embedding + every sub-layer output
        if mode == "block_sum":
            self.bank = [embedding]
        self.block_start = 1  # full: outputs[:block_start] are fixed for the current block
        self.block_end = 0  # mixes before this index belong to the current block
        self.phase1: tuple[int, tuple[Tensor, ...], tuple[Tensor, ...]] | None = None  # (first mix, M x o [N, d],
        #                                                                            M x lse [N]) of phase 1
        self._queries: Tensor | None = None

    def queries(self) -> Tensor:
        """Every mix's folded query, key-norm weight * pseudo-query: [2 * layers + 1, d], computed once per pass
        (three kernels, not one per mix). It reads every layer's AttnRes parameters at the first mix: FSDP keeps
        them in the root unit (k3.distributed.fsdp), unsharded for the whole forward."""
        if self._queries is None:
            norms = torch.stack([norm.weight for norm, _ in self.mixers])
            self._queries = norms * torch.stack([proj.weight[0] for _, proj in self.mixers])
        return self._queries

    def sources(self) -> list[Tensor]:
        fixed, live = self._fixed_and_live()
        return fixed + live

    def input(self, layer: int, sublayer: str, norm: RMSNorm) -> Tensor:
        """The input of sub-layer ``sublayer`` ('attn' or 'mlp') of decoder layer ``layer``: its depth mix h
        through the sub-layer's pre-``norm`` (compiled together with the merge)."""
        if sublayer == "attn" and layer % self.block_size == 0:
            if self.mode == "snapshot":
                self.bank.append(self.r)
            elif self.mode == "block_sum" and self.partial is not None:
                self.bank.append(self.partial)
                self.partial = None
            self.block_start, self.phase1 = len(self.outputs), None
            end = 2 * min(layer + self.block_size, self.num_layers)
            self.block_end = end + 1 if end == 2 * self.num_layers else end  # the last block has the output mix
        if self.mode == "none":
            return norm(self.r)
        return self._mix(2 * layer + (sublayer == "mlp"), layer, sublayer, norm)

    def _fixed_and_live(self) -> tuple[list[Tensor], list[Tensor]]:
        """The sources split into those fixed for the current block and the live ones (in source order)."""
        if self.mode == "snapshot":
            return self.bank, [self.r]
        if self.mode == "block_sum":
            return self.bank, [] if self.partial is None else [self.partial]
        if self.mode == "full":
            return self.outputs[: self.block_start], self.outputs[self.block_start :]
        return [self.r], []

    def _mix(self, j: int, layer: int, sublayer: str, norm: RMSNorm) -> Tensor:
        """Mix number j (2 * layer + (sublayer == 'mlp'); the output mix is 2 * num_layers), then ``norm``."""
        fixed, live = self._fixed_and_live()
        if len(fixed) + len(live) == 1:
            return norm((fixed + live)[0])
        q, eps = self.queries()[j], self.mixers[j][0].eps
        if self.records is not None:
            with torch.no_grad():
                w = depth_weights(fixed + live, q, eps)
            self.records.append((layer, sublayer, w.mean(1).cpu()))
            return norm(depth_mix(fixed + live, q, eps))
        if self.mode != "full" and (
            fixed[0].shape[0] <= DIRECT_TOKENS or not any(t.requires_grad for t in fixed + live)
        ):  # inference: one form whatever the pass's length, so a row does not depend on its batch mates
            return attn_res_mix_norm(q, fixed + live, eps, norm.weight, norm.eps, norm.out_dtype(fixed[0]))
        if self.phase1 is None or j >= self.phase1[0] + len(self.phase1[1]):
            self._phase1(j, fixed)
        first, o, lse = self.phase1
        o, lse = o[j - first], lse[j - first]
        if not live:
            return norm(o)
        out_dtype = norm.out_dtype(o) or o.dtype  # folding keeps o in fp32: the output keeps the unfolded dtype
        while len(live) > MERGE_SOURCES:
            o, lse = attn_res_fold(o, lse, live[:MERGE_SOURCES], q, eps)
            live = live[MERGE_SOURCES:]
        return attn_res_merge_norm(o, lse, live, q, eps, norm.weight, norm.eps, out_dtype)

    def _phase1(self, j: int, fixed: list[Tensor]) -> None:
        """Phase 1 for mixes j, j+1, ... of the current block (as many as fit the budget and share j's norm eps)."""
        eps = self.mixers[j][0].eps
        width = fixed[0].element_size() if len(fixed) <= PHASE1_SOURCES else max(4, fixed[0].element_size())
        count = max(1, min(self.block_end - j, TWO_PHASE_BYTES // (fixed[0].numel() * width)))  # pieces sum in fp32
        count = next((k for k in range(1, count) if self.mixers[j + k][0].eps != eps), count)
        o, lse = attn_res_phase1_pieces(self.queries()[j : j + count], fixed, eps, PHASE1_SOURCES)
        # unbound once: indexing o [M, N, d] per mix would make each mix's backward a zero-filled [M, N, d]
        # gradient, summed M times; unbind's backward stacks the M gradients once
        self.phase1 = (j, o.unbind(0), lse.unbind(0))

    def add(self, out: Tensor) -> None:
        """Record a sub-layer output [N, d]."""
        if self.mode in ("none", "snapshot"):
            self.r = self.r + out
        elif self.mode == "block_sum":
            self.partial = out if self.partial is None else self.partial + out
        else:
            self.outputs.append(out)

    def output(self, norm: RMSNorm) -> Tensor:
        """The final hidden state through the final ``norm``."""
        if self.mode == "none":
            return norm(self.r)
        return self._mix(2 * self.num_layers, -1, "output", norm)
