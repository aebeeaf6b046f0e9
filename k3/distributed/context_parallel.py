"""Context parallelism (CP) for training: every rank of a CP group of size C holds the contiguous columns
[r*T/C, (r+1)*T/C) of every row of the [B, T] batch; documents (cu_seqlens segments) may cross rank boundaries.

    cp = ContextParallel(meshes.cp.get_group())                    # the CP group; the model stays as built
    ids, labels, segments = cp.shard(input_ids, labels, cu_seqlens)  # this rank's columns, CPShard attached
    out = model(ids, cu_seqlens=segments)                            # local logits [B, T/C, V]

Nothing of the model is patched or wrapped: the local offsets are a :class:`k3.ops.segments.Segments` whose
``shard`` is a :class:`CPShard` (the batch's :class:`CPContext` and the group), and the KDA and MLA layers, handed
such segments, run the shard's forms below (``CPShard.kda`` / ``CPShard.mla``); every other layer, and any forward
given plain offsets, runs as always. The state travels with the batch, so a sub-layer recomputed by activation
checkpointing in the backward pass (k3.train.activation_checkpoint) gets the same shard and runs the same
exchanges again.

KDA (docs/architecture.md#kda), exact. The delta rule is linear in the state entering a segment: S_t = P_t S_in +
S_t^0, with
P_t the product of the transitions (I - beta k k^T) Diag(exp g) so far and S_t^0 the state from a zero start.
Per rank and row: (1) ``chunk_kda`` on the local tokens from zero states gives o^0 and the final state B of
the row's last segment; (2) ``chunk_kda`` with v = 0 and initial state I_K, on the row's first segment only
and only when it continues a document from the previous rank, gives scale P_t^T q_t per token and (final
state) P of the segment. (P, B) are all-gathered and scanned, S_in(r) = P_{r-1} S_in(r-1) + B_{r-1}, with a
reset wherever a document starts inside rank r-1; then o_t += S_in^T (scale P_t^T q_t) on that first
segment. The short convs take their W-1 history from the previous ranks' last projected inputs.

MLA (docs/architecture.md#mla): every rank all-gathers the latent rows [c_kv (after kv_a_layernorm), k_pe] of all
ranks and
its queries attend to their document's keys up to their own position (``attention`` with Lq local queries
as the last Lq of Lk keys). RoPE, when set, uses positions within the document.

Communication per layer (forward), one all-gather each, N = B*T/C local tokens, W the conv width; each rank
contributes the elements below and receives C-1 times as many; the backward all-reduces the gathered gradient
(C times that volume; a reduce-scatter would move less) and keeps its own slice:
  KDA conv tails   B * min(W-1, T/C) * (2*H*K + H*V)   activation dtype
  KDA (P, B)       B * H * K * (K + V)                  fp32, independent of T
  MLA latents      N * (r + dr)                          activation dtype
K3 (H=96, K=V=128, W=4, r+dr=576): per KDA layer and row 110,592 conv values (216 KiB in bf16) + 12 MiB of
(P, B); per MLA layer each rank receives (C-1)/C * B*T*576 latent values (1.1 KiB per token in bf16). Where a
document starts is known on every rank from cu_seqlens (no flags are exchanged), and when no document
crosses a rank boundary nothing is exchanged at all.
Limitations: the MLA gather holds every rank's latents (O(B*T*(r+dr)) per layer) and the up-projected keys
of the rank's documents up to its last position; with contiguous shards the attention work grows with the
rank (causal imbalance, no zig-zag ordering). KDA always runs ``chunk_kda`` under CP (no cache, no decode).
Every rank must run the same layers in the same order (backward collectives must match); gathered tensors
a rank does not need are still tied into its graph with a zero gradient for that reason.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MultiheadLatentAttention
from k3.model.rope import rotate_half_rope
from k3.ops.conv import causal_conv1d
from k3.ops.dtypes import upcast
from k3.ops.kda import chunk_kda
from k3.ops.segments import Segments, as_segments

__all__ = ["CPContext", "CPShard", "ContextParallel", "shard_batch", "kda_context_parallel"]


@dataclass
class CPContext:
    """What the layers of CP rank ``rank`` need about the sharded batch (host lists, identical on all ranks for
    the shared fields). Local segment i covers local tokens [cu[i], cu[i+1]) of the flattened [B, T/C] slice."""

    rank: int
    size: int
    batch: int  # B
    seqlen: int  # global T
    seg_doc: list[int]  # global segment (document) index of each local segment
    seg_offset: list[int]  # position of each local segment's first token within its document
    seg_start: list[int]  # global flat position (over B*T) of each local segment's first token
    seg_length: list[int]
    doc_start: list[int]  # global flat position of each local segment's document start
    heads: list[int]  # per row: index of the row's first local segment
    tails: list[int]  # per row: index of the row's last local segment
    continues: list[list[bool]]  # [rank][row]: that rank's first segment of the row continues a document
    inside: list[list[bool]]  # [rank][row]: that rank's row slice lies inside one document begun before it
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def local_len(self) -> int:
        return self.seqlen // self.size

    @property
    def any_crossing(self) -> bool:
        """Some document crosses some rank boundary (same answer on every rank: no communication otherwise)."""
        return any(any(row) for row in self.continues)

    def positions(self, device) -> Tensor:
        """[N] int64: each local token's position within its document."""
        key = ("positions", str(device))
        if key not in self._cache:
            self._cache[key] = torch.cat([torch.arange(o, o + n) for o, n in zip(self.seg_offset, self.seg_length)]).to(
                device
            )
        return self._cache[key]

    def key_plan(self, device) -> tuple[Tensor, Segments]:
        """(index [M] into the all-gathered [C*N] local rows, cu_seqlens_k [S+1]): local segment s attends to the
        keys of its document from the document start to its own last token (Lk = offset + length)."""
        key = ("keys", str(device))
        if key not in self._cache:
            n_local, L, T = self.batch * self.local_len, self.local_len, self.seqlen
            spans = [torch.arange(d, s + n) for d, s, n in zip(self.doc_start, self.seg_start, self.seg_length)]
            p = torch.cat(spans)  # global flat positions
            row, col = p // T, p % T
            index = (col // L) * n_local + row * L + col % L  # [rank, row, column] of the gathered rows
            bounds = [0]
            for s in spans:
                bounds.append(bounds[-1] + s.numel())
            self._cache[key] = (index.to(device), Segments.from_host(bounds, device))
        return self._cache[key]


def shard_batch(
    input_ids: Tensor, labels: Tensor, cu_seqlens: Segments | Tensor, cp_rank: int, cp_size: int
) -> tuple[Tensor, Tensor, Segments, CPContext]:
    """input_ids, labels [B, T]; cu_seqlens [S+1] over the B*T flattened tokens (every row boundary included;
    Segments or a tensor) -> (ids [B, T/C], labels [B, T/C], the local Segments [S_local+1] (offsets of the same
    dtype and device, no shard attached: :meth:`ContextParallel.shard` attaches it), CPContext). Raises one
    ValueError for a T not divisible by C or an invalid cu_seqlens."""
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and labels must both be [B, T], got {tuple(input_ids.shape)} and {tuple(labels.shape)}"
        )
    B, T = input_ids.shape
    if not 0 <= cp_rank < cp_size or T % cp_size:
        raise ValueError(
            f"context parallelism needs the sequence length T={T} divisible by the CP size "
            f"{cp_size} and 0 <= cp_rank={cp_rank} < {cp_size}"
        )
    segments = as_segments(cu_seqlens)
    cu = list(segments.host)
    if (
        cu[0] != 0
        or cu[-1] != B * T
        or any(b <= a for a, b in zip(cu[:-1], cu[1:]))
        or not set(range(0, B * T, T)) <= set(cu)
    ):
        raise ValueError(
            f"cu_seqlens must increase from 0 to B*T={B * T} and contain every row boundary "
            f"(multiples of T={T}); got {cu}"
        )
    L = T // cp_size
    starts = set(cu[:-1])
    continues = [[b * T + j * L not in starts for b in range(B)] for j in range(cp_size)]
    inside = [
        [
            continues[j][b] and bisect.bisect_right(cu, b * T + j * L) == bisect.bisect_left(cu, b * T + (j + 1) * L)
            for b in range(B)
        ]
        for j in range(cp_size)
    ]  # no document starts inside the slice

    seg_doc, seg_offset, seg_start, seg_length, doc_start, heads, tails = [], [], [], [], [], [], []
    local_cu = [0]
    for b in range(B):
        w0, w1 = b * T + cp_rank * L, b * T + (cp_rank + 1) * L
        cuts = [w0] + cu[bisect.bisect_right(cu, w0) : bisect.bisect_left(cu, w1)] + [w1]
        heads.append(len(seg_doc))
        for a, e in zip(cuts[:-1], cuts[1:]):
            doc = bisect.bisect_right(cu, a) - 1
            seg_doc.append(doc)
            seg_offset.append(a - cu[doc])
            seg_start.append(a)
            seg_length.append(e - a)
            doc_start.append(cu[doc])
            local_cu.append(local_cu[-1] + e - a)
        tails.append(len(seg_doc) - 1)
    cols = slice(cp_rank * L, (cp_rank + 1) * L)
    local = Segments.from_host(local_cu, segments.offsets.device, segments.offsets.dtype)
    ctx = CPContext(
        cp_rank, cp_size, B, T, seg_doc, seg_offset, seg_start, seg_length, doc_start, heads, tails, continues, inside
    )
    return input_ids[:, cols].contiguous(), labels[:, cols].contiguous(), local, ctx


# ---------------------------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------------------------


class _Anchor(torch.autograd.Function):
    """x unchanged, with ys in its graph at zero gradient: a rank that does not use gathered tensors still runs
    the gather's backward (a collective every rank of the group must join)."""

    @staticmethod
    def forward(ctx, x, *ys):
        ctx.specs = [(y.shape, y.dtype, y.device) for y in ys]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.specs))


class _AllGather(torch.autograd.Function):
    """t [...] -> [C, ...] over ``group``; backward: each rank's slice of the summed gradients (an all-reduce, then
    the own slice: works on gloo and nccl and for any subgroup; torch.distributed.nn's gloo all-gather backward
    addresses subgroup ranks as global ranks)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t, group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _gather(t: Tensor, group) -> Tensor:
    """Differentiable all-gather: t [...] on every rank -> [C, ...] in group-rank order. Under grad mode the
    gather always enters the graph (even where t needs no gradient on this rank), so that every rank runs its
    backward collective."""
    if torch.is_grad_enabled() and not t.requires_grad:
        t = t.detach().requires_grad_()
    return _AllGather.apply(t.contiguous(), group)


# ---------------------------------------------------------------------------------------------------------------
# KDA
# ---------------------------------------------------------------------------------------------------------------


def _select_tokens(cu: tuple[int, ...], segments: list[int], device) -> tuple[Tensor, Segments]:
    """Token indices [n] of the given local segments (in order) and their own Segments [len+1]."""
    index = torch.cat([torch.arange(cu[s], cu[s + 1]) for s in segments]).to(device)
    bounds = [0]
    for s in segments:
        bounds.append(bounds[-1] + cu[s + 1] - cu[s])
    return index, Segments.from_host(bounds, device)


def kda_context_parallel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Segments | Tensor,
    ctx: CPContext,
    group,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
) -> Tensor:
    """Exact KDA over the local tokens of a CP rank: q, k (L2-normalised), g [1, N, H, K]; v [1, N, H, V];
    beta [1, N, H]; cu_seqlens [S_local+1] from :func:`shard_batch` -> o [1, N, H, V] (v.dtype), equal to the
    rows of a single-process ``chunk_kda`` over the whole batch. Collective over ``group`` (every rank calls)."""
    _, _, H, K = q.shape
    V = v.shape[-1]
    B, r = ctx.batch, ctx.rank
    cu_seqlens = as_segments(cu_seqlens, q.device)  # the ops read the offsets only, never the shard
    cu = cu_seqlens.host
    o, finals = chunk_kda(
        q, k, v, g, beta, scale=scale, output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=chunk_size
    )
    if not ctx.any_crossing:
        return o
    rows = [b for b in range(B) if ctx.continues[r][b]]  # rows whose first segment needs the incoming state
    last = finals[ctx.tails]  # [B, H, K, V]: the state each row hands on, from a zero start on this rank
    trans = last.new_zeros(B, H, K, K)  # P of rows lying inside one document (else unused: a reset)
    if rows:
        index, cu2 = _select_tokens(cu, [ctx.heads[b] for b in rows], q.device)
        pick = lambda t: t.index_select(1, index)  # noqa: E731
        eye = torch.eye(K, dtype=last.dtype, device=q.device).expand(len(rows), H, K, K)
        qp, trans_rows = chunk_kda(
            pick(q),
            pick(k),
            v.new_zeros(1, index.numel(), H, K),
            pick(g),
            pick(beta),
            scale=scale,
            initial_state=eye,
            output_final_state=True,
            cu_seqlens=cu2,
            chunk_size=chunk_size,
        )  # qp [1, n, H, K] = scale P_t^T q_t; trans P [R, H, K, K]
        inside = [i for i, b in enumerate(rows) if ctx.inside[r][b]]
        if inside:
            sel = torch.tensor(inside, device=q.device)
            trans = trans.index_copy(
                0,
                torch.tensor([rows[i] for i in inside], device=q.device),
                trans_rows.index_select(0, sel).to(trans.dtype),
            )
    gathered = _gather(torch.cat([trans, last], dim=-1), group)  # [C, B, H, K, K + V]: one collective
    if not rows:
        return _Anchor.apply(o, gathered)
    all_trans, all_last = gathered.split([K, V], dim=-1)
    state = all_last.new_zeros(B, H, K, V)  # prefix scan over the previous ranks, per row
    for j in range(r):
        keep = torch.tensor(ctx.inside[j], dtype=state.dtype, device=state.device).view(B, 1, 1, 1)
        state = all_last[j] + keep * (all_trans[j] @ state)
    bounds = cu2.host
    corr = torch.cat(
        [torch.einsum("thk,hkv->thv", upcast(qp[0, a:e]), state[b]) for b, a, e in zip(rows, bounds[:-1], bounds[1:])]
    )  # [n, H, V]
    return o.index_add(1, index, corr.unsqueeze(0).to(o.dtype))


def _conv_history(tails: Tensor, ctx: CPContext, width: int) -> Tensor:
    """All ranks' last m = min(W-1, T/C) projected inputs per row, tails [C, B, m, Ch] -> each row's conv
    history [B, Ch, W-1] (oldest first) for this rank's first segment: zero where it reaches before the
    document start (hence all zero when the segment does not continue)."""
    C, B, m, ch = tails.shape
    r, w = ctx.rank, width - 1
    prev = tails[:r].transpose(0, 1).reshape(B, r * m, ch)[:, -w:]  # the positions right before this rank
    prev = torch.cat([prev.new_zeros(B, w - prev.shape[1], ch), prev], dim=1)  # [B, W-1, Ch]
    offsets = torch.tensor([ctx.seg_offset[h] for h in ctx.heads], device=tails.device)  # tokens since doc start
    valid = torch.arange(w, device=tails.device)[None, :] >= (w - offsets)[:, None]  # [B, W-1]
    return (prev * valid[..., None].to(prev.dtype)).transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------------
# The shard the layers see, and the CP group's wrapper
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class CPShard:
    """The ``shard`` of a CP rank's local :class:`k3.ops.segments.Segments`: the batch's context and the CP
    process group. A KDA or MLA layer handed such segments calls :meth:`kda` / :meth:`mla` instead of running its
    own forward; both are collective over ``group`` (every rank runs the same layers in the same order)."""

    ctx: CPContext
    group: Any

    def kda(self, layer: KimiDeltaAttention, x: Tensor, segments: Segments, state=None) -> Tensor:
        """KimiDeltaAttention.forward on this shard (same contract): x [N, d] local packed tokens -> [N, d]."""
        if state is not None:
            raise ValueError("context parallelism runs training forwards only (no cache)")
        ctx = self.ctx
        projected = layer.project(x)  # q|k|v [N, Ch]
        width = layer.q_conv1d.weight.shape[-1]
        init = None
        if ctx.any_crossing:
            L = ctx.local_len
            m = min(width - 1, L)
            rows = torch.arange(L - m, L, device=x.device) + L * torch.arange(ctx.batch, device=x.device)[:, None]
            tails = _gather(projected[rows], self.group)  # [C, B, m, Ch]
            history = _conv_history(tails, ctx, width)  # [B, Ch, W-1]
            full = history.new_zeros(len(ctx.seg_doc), history.shape[1], width - 1)
            init = _Anchor.apply(full.index_copy(0, torch.tensor(ctx.heads, device=x.device), history), tails)
        y = causal_conv1d(
            projected.unsqueeze(0), layer.conv_weight(), cu_seqlens=segments, initial_state=init, activation="silu"
        )[0]
        qkv = list(y[0].split(layer.qkv_widths(), dim=-1))
        q, k, v, g, beta = layer.recurrence_inputs(x, qkv)
        o = kda_context_parallel(q, k, v, g, beta, segments, ctx, self.group, chunk_size=layer.chunk_size)
        return layer._output(x, o[0])

    def mla(
        self, layer: MultiheadLatentAttention, x: Tensor, segments: Segments, state=None, absorb: bool | None = None
    ) -> Tensor:
        """MultiheadLatentAttention.forward on this shard (same contract): x [N, d] local packed tokens -> [N, d];
        the layer's own local form where no document crosses a rank boundary."""
        if state is not None:
            raise ValueError("context parallelism runs training forwards only (no cache)")
        ctx = self.ctx
        if not ctx.any_crossing:
            return layer.local_forward(x, segments, absorb=absorb)
        q_nope, q_pe, c_kv, k_pe = layer.project(x)
        if layer.rope_theta is not None:
            positions = ctx.positions(x.device)
            q_pe = rotate_half_rope(q_pe, positions, layer.rope_theta)
            k_pe = rotate_half_rope(k_pe, positions, layer.rope_theta)
        rows = _gather(torch.cat([c_kv, k_pe], dim=-1), self.group).flatten(0, 1)  # [C*N, r + dr]
        index, cu_k = ctx.key_plan(x.device)
        keys = rows.index_select(0, index)  # [M, r + dr]: per local segment, its document's keys up to its end
        absorb = bool(layer.absorb) if absorb is None else absorb
        o = layer.attend(q_nope, q_pe, keys, segments, cu_k, absorb)
        return layer._output(x, o)


class ContextParallel:
    """Context parallelism over ``group`` (e.g. ``meshes.cp.get_group()``): :meth:`shard` cuts a batch to this
    rank's columns and attaches the :class:`CPShard` to its offsets. The model needs no preparation (see the
    module docstring); the group is first used when a shard's forward runs."""

    def __init__(self, group):
        self.group = group

    def shard(
        self, input_ids: Tensor, labels: Tensor, cu_seqlens: Segments | Tensor
    ) -> tuple[Tensor, Tensor, Segments]:
        """:func:`shard_batch` at this process's rank of the group -> (ids [B, T/C], labels [B, T/C], the local
        Segments with their CPShard)."""
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        ids, labels, local, ctx = shard_batch(input_ids, labels, cu_seqlens, rank, size)
        return ids, labels, replace(local, shard=CPShard(ctx, self.group))
