"""Context parallelism (CP) for training: every rank of a CP group of size C holds the contiguous columns
[r*T/C, (r+1)*T/C) of every row of the [B, T] batch; documents (cu_seqlens segments) may cross rank boundaries.

    ids, labels, cu, ctx = shard_batch(input_ids, labels, cu_seqlens, cp_rank, cp_size)
    apply_context_parallel(model, meshes.cp.get_group())          # once, on the built K3ForCausalLM
    with cp_context(model, ctx):
        out = model(ids, cu_seqlens=cu)                            # local logits [B, T/C, V]

The model files are untouched: ``apply_context_parallel`` replaces the ``forward`` of every KDA / MLA layer
instance with a CP-aware one that falls back to the original when no context is active.

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
import contextlib
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MultiheadLatentAttention
from k3.model.rope import rotate_half_rope
from k3.ops.conv import causal_conv1d
from k3.ops.dtypes import upcast
from k3.ops.kda import chunk_kda
from k3.ops.segments import attach_host, host_list

__all__ = [
    "CPContext",
    "shard_batch",
    "apply_context_parallel",
    "cp_context",
    "kda_context_parallel",
    "recompute_context",
]


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

    def key_plan(self, device) -> tuple[Tensor, Tensor]:
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
            cu_k = attach_host(torch.tensor(bounds, dtype=torch.int64).to(device), bounds)
            self._cache[key] = (index.to(device), cu_k)
        return self._cache[key]


def shard_batch(
    input_ids: Tensor, labels: Tensor, cu_seqlens: Tensor, cp_rank: int, cp_size: int
) -> tuple[Tensor, Tensor, Tensor, CPContext]:
    """input_ids, labels [B, T]; cu_seqlens [S+1] over the B*T flattened tokens (every row boundary included) ->
    (ids [B, T/C], labels [B, T/C], local cu_seqlens [S_local+1] (same dtype and device, host copy attached),
    CPContext). Raises one ValueError for a T not divisible by C or an invalid cu_seqlens."""
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
    cu = host_list(cu_seqlens) if cu_seqlens.device.type == "cpu" else cu_seqlens.tolist()
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
    local = attach_host(torch.tensor(local_cu, dtype=cu_seqlens.dtype).to(cu_seqlens.device), local_cu)
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


def _select_tokens(cu: list[int], segments: list[int], device) -> tuple[Tensor, Tensor]:
    """Token indices [n] of the given local segments (in order) and their own cu_seqlens [len+1]."""
    index = torch.cat([torch.arange(cu[s], cu[s + 1]) for s in segments]).to(device)
    bounds = [0]
    for s in segments:
        bounds.append(bounds[-1] + cu[s + 1] - cu[s])
    return index, attach_host(torch.tensor(bounds, dtype=torch.int64).to(device), bounds)


def kda_context_parallel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
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
    cu = host_list(cu_seqlens)
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
    bounds = host_list(cu2)
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


def _kda_forward(self: KimiDeltaAttention, x: Tensor, cu_seqlens: Tensor, state=None, seq_ids=None) -> Tensor:
    """CP-aware KimiDeltaAttention.forward (same contract): x [N, d] local packed tokens -> [N, d]."""
    cp = self._k3_cp
    if cp.ctx is None:
        return type(self).forward(self, x, cu_seqlens, state, seq_ids)
    if state is not None:
        raise ValueError("context parallelism runs training forwards only (no cache)")
    ctx = cp.ctx
    projected = self.project(x)  # q|k|v [N, Ch]
    width = self.q_conv1d.weight.shape[-1]
    init = None
    if ctx.any_crossing:
        L = ctx.local_len
        m = min(width - 1, L)
        rows = torch.arange(L - m, L, device=x.device) + L * torch.arange(ctx.batch, device=x.device)[:, None]
        tails = _gather(projected[rows], cp.group)  # [C, B, m, Ch]
        history = _conv_history(tails, ctx, width)  # [B, Ch, W-1]
        full = history.new_zeros(len(ctx.seg_doc), history.shape[1], width - 1)
        init = _Anchor.apply(full.index_copy(0, torch.tensor(ctx.heads, device=x.device), history), tails)
    y = causal_conv1d(
        projected.unsqueeze(0), self.conv_weight(), cu_seqlens=cu_seqlens, initial_state=init, activation="silu"
    )[0]
    qkv = list(y[0].split(self.qkv_widths(), dim=-1))
    q, k, v, g, beta = self.recurrence_inputs(x, qkv)
    o = kda_context_parallel(q, k, v, g, beta, cu_seqlens, ctx, cp.group, chunk_size=self.chunk_size)
    return self._output(x, o[0])


# ---------------------------------------------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------------------------------------------


def _mla_forward(
    self: MultiheadLatentAttention, x: Tensor, cu_seqlens: Tensor, state=None, seq_ids=None, absorb: bool | None = None
) -> Tensor:
    """CP-aware MultiheadLatentAttention.forward (same contract): x [N, d] local packed tokens -> [N, d]."""
    cp = self._k3_cp
    if cp.ctx is None or (state is None and not cp.ctx.any_crossing):  # no document crosses a rank: local
        return type(self).forward(self, x, cu_seqlens, state, seq_ids, absorb)
    if state is not None:
        raise ValueError("context parallelism runs training forwards only (no cache)")
    ctx = cp.ctx
    q_nope, q_pe, c_kv, k_pe = self.project(x)
    if self.rope_theta is not None:
        positions = ctx.positions(x.device)
        q_pe = rotate_half_rope(q_pe, positions, self.rope_theta)
        k_pe = rotate_half_rope(k_pe, positions, self.rope_theta)
    rows = _gather(torch.cat([c_kv, k_pe], dim=-1), cp.group).flatten(0, 1)  # [C*N, r + dr]
    index, cu_k = ctx.key_plan(x.device)
    keys = rows.index_select(0, index)  # [M, r + dr]: per local segment, its document's keys up to its end
    absorb = bool(self.absorb) if absorb is None else absorb
    o = self.attend(q_nope, q_pe, keys, cu_seqlens, cu_k, absorb)
    return self._output(x, o)


# ---------------------------------------------------------------------------------------------------------------
# Model wiring
# ---------------------------------------------------------------------------------------------------------------


class _CPState:
    """Shared by the model and its attention layers: the CP process group and the active context (or None)."""

    def __init__(self, group):
        self.group = group
        self.ctx: CPContext | None = None


def apply_context_parallel(model, cp_group) -> None:
    """Make a built K3ForCausalLM CP-aware over ``cp_group`` (e.g. ``meshes.cp.get_group()``): each KDA / MLA
    layer instance gets a forward that, inside :func:`cp_context`, runs the exchanges above; outside it the
    model behaves exactly as before. Idempotent for the same group."""
    state = _CPState(cp_group)
    model._k3_cp = state
    for layer in model.model.layers:
        attn = layer.self_attn
        attn._k3_cp = state
        impl = _kda_forward if isinstance(attn, KimiDeltaAttention) else _mla_forward
        attn.forward = types.MethodType(impl, attn)


def recompute_context(model):
    """A ``context_fn`` for activation checkpointing (k3.train.activation_checkpoint) of a CP-prepared model: a
    sub-layer recomputed in the backward pass (which runs after :func:`cp_context` has exited) runs inside the CP
    context its forward ran in."""
    state = getattr(model, "_k3_cp", None)
    if state is None:
        raise ValueError("call apply_context_parallel(model, cp_group) before recompute_context")

    def context_fn():
        ctx = state.ctx
        return contextlib.nullcontext(), cp_context(model, ctx) if ctx is not None else contextlib.nullcontext()

    return context_fn


@contextlib.contextmanager
def cp_context(model, ctx: CPContext):
    """Within the block, forwards of ``model`` (prepared by :func:`apply_context_parallel`) treat their input as
    the CP shard described by ``ctx`` (from :func:`shard_batch`). Backward may run after the block exits."""
    state = getattr(model, "_k3_cp", None)
    if state is None:
        raise ValueError("call apply_context_parallel(model, cp_group) before cp_context")
    size, rank = dist.get_world_size(state.group), dist.get_rank(state.group)
    if (ctx.size, ctx.rank) != (size, rank):
        raise ValueError(
            f"the batch was sharded for CP rank {ctx.rank} of {ctx.size}, but this process is rank "
            f"{rank} of the {size}-rank CP group"
        )
    previous, state.ctx = state.ctx, ctx
    try:
        yield ctx
    finally:
        state.ctx = previous
