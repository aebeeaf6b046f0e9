"""KDA on the GPU through fla-core's Triton kernels (``pip install k3[gpu]``).

fla's ``chunk_kda`` (training / prefill, autograd) and ``fused_recurrent_kda`` (decode, forward only) take the
same time-major layout, log-space g, post-sigmoid beta, fp32 initial state and ``cu_seqlens`` (B == 1) as our
reference. Pinned: ``FLA_FLASH_KDA=0`` keeps fla on its own Triton kernels (it would otherwise switch to
FlashKDA silently when that package is installed). fla supports chunk sizes 32 / 64 only and the result does
not depend on the chunk size (the chunked form is exact), so other sizes run at 64.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from k3.ops.segments import Segments, as_segments

os.environ.setdefault("FLA_FLASH_KDA", "0")
SAFE_GATE_BOUND = -5.0  # the lowest gate lower bound fla's safe_gate path accepts
L2NORM_EPS = 1e-6  # the epsilon of fla's in-kernel q / k L2 norm


def available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("fla") is not None


def _inputs(q, k, v, g, beta, initial_state):
    dtype = v.dtype
    state = None if initial_state is None else initial_state.float()
    return q.to(dtype), k.to(dtype), v, g.float(), beta.to(dtype), state


def _norms_outside(q: Tensor, k: Tensor, eps: float) -> tuple[Tensor, Tensor, bool]:
    """(q, k, whether fla's kernel normalises them): fla's kernels take only their own epsilon; with another,
    q and k are normalised here (k3.ops.kda.l2norm) and passed on as they are."""
    if eps == L2NORM_EPS:
        return q, k, True
    from k3.ops.kda import l2norm

    return l2norm(q, eps), l2norm(k, eps), False


def _offsets(segments: Segments | Tensor | None) -> Tensor | None:
    """fla's ``cu_seqlens``: the offsets tensor (of a Segments: the same one for every layer of a forward)."""
    return segments.offsets if isinstance(segments, Segments) else segments


def _cpu(segments: Segments | None) -> Tensor | None:
    """fla's ``cu_seqlens_cpu``: one CPU tensor per Segments (see :attr:`k3.ops.segments.Segments.cpu`)."""
    return None if segments is None else segments.cpu


def _chunk(chunk_size: int) -> int:
    """fla's KDA chunk: 32 or 64 (the chunked form is exact, so any other size runs at 64)."""
    return chunk_size if chunk_size in (32, 64) else 64


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Segments | Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Same contract as :func:`k3.ops.kda.reference.chunk_kda` (computed in v's dtype, state in fp32)."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    q, k, v, g, beta, state = _inputs(q, k, v, g, beta, initial_state)
    cu_seqlens = as_segments(cu_seqlens, q.device)
    return fla_chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=state,
        output_final_state=output_final_state,
        cu_seqlens=_offsets(cu_seqlens),
        cu_seqlens_cpu=_cpu(cu_seqlens),
        chunk_size=_chunk(chunk_size),
    )


@torch.compiler.disable  # fla's launch wrappers (autotuners, caches) stay out of traced graphs
def chunk_kda_raw(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    f: Tensor,
    b: Tensor,
    *,
    A_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float | None,
    l2norm_eps: float = 1e-6,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Segments | Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Same contract as :func:`k3.ops.kda.reference.chunk_kda_raw`, the way fla's own KDA layer calls its kernels:
    the L2 norms (when eps is the kernel's 1e-6), the gate (fused with its chunk cumsum; gradients for A_log and
    dt_bias included) and beta's sigmoid inside fla's autograd function; with K3's bounded gate, fla's
    ``safe_gate`` path (16-row tensor-core blocks for gates in [lower_bound, 0); fla takes it for bounds in
    [-5, 0) and computes lower bounds below -5 without it); the state in fla's V-first layout ([N, H, V, K],
    transposed here on the way in and out)."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    dtype = v.dtype
    q, k, fused_norm = _norms_outside(q, k, l2norm_eps)
    state = None if initial_state is None else initial_state.float().transpose(-1, -2).contiguous()
    cu_seqlens = as_segments(cu_seqlens, q.device)
    safe = lower_bound is not None and SAFE_GATE_BOUND <= lower_bound < 0  # fla rejects safe_gate below -5
    o, final = fla_chunk_kda(
        q.to(dtype),
        k.to(dtype),
        v,
        f,
        b.to(dtype),
        A_log=A_log,
        dt_bias=dt_bias,
        scale=scale,
        initial_state=state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=fused_norm,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        safe_gate=safe,
        lower_bound=lower_bound,
        state_v_first=True,
        cu_seqlens=_offsets(cu_seqlens),
        cu_seqlens_cpu=_cpu(cu_seqlens),
        chunk_size=_chunk(chunk_size),
    )
    return o, None if final is None else final.transpose(-1, -2)


@torch.compiler.disable  # fla's launch wrappers (autotuners, caches) stay out of traced graphs
def recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Segments | Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Same contract as :func:`k3.ops.kda.reference.recurrent_kda`; forward only (fla has no backward for it)."""
    from fla.ops.kda import fused_recurrent_kda

    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
        raise RuntimeError("fla's fused_recurrent_kda has no backward: use chunk_kda for training")
    q, k, v, g, beta, state = _inputs(q, k, v, g, beta, initial_state)
    return fused_recurrent_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=state,
        output_final_state=output_final_state,
        cu_seqlens=_offsets(cu_seqlens),  # read on the device only: no conversion (a tensor stays unread)
    )


def kda_decode_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    f: Tensor,
    b: Tensor,
    *,
    A_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float | None,
    state: Tensor,
    slots: Tensor,
    l2norm_eps: float = 1e-6,
    scale: float | None = None,
) -> Tensor:
    """Same contract as :func:`k3.ops.kda.reference.kda_decode_step`: one fla kernel that normalises q and k,
    computes the gate and beta, reads each sequence's state from the pool by slot and writes it back in place.
    The inputs are laid out here, where a compiled decode step fuses the casts and copies into its own kernels."""
    dtype = v.dtype
    q, k, fused_norm = _norms_outside(q, k, l2norm_eps)
    return _decode_launch(
        q[:, None].to(dtype).contiguous(),
        k[:, None].to(dtype).contiguous(),
        v[:, None].contiguous(),
        f[:, None].float().contiguous(),
        b[:, None].float().contiguous(),
        A_log.float(),
        dt_bias.float(),
        state,
        slots.to(torch.int32),
        fused_norm,
        lower_bound,
        scale,
    )


@torch.library.custom_op("k3::kda_decode_launch", mutates_args=("state",))
def _decode_launch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    slots: Tensor,
    fused_norm: bool,
    lower_bound: float | None,
    scale: float | None,
) -> Tensor:
    """fla's fused recurrent KDA forward on [N, 1, H, *] inputs, the state pool updated in place -> o [N, H, dv].
    A custom op that mutates ``state``: a compiled decode step keeps it inside its graph (inductor calls it on
    the cache's own tensor, no copy), where a ``torch.compiler.disable``d launch cut the graph at every KDA layer."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    o, _ = fused_recurrent_kda_fwd(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        A_log=A_log,
        dt_bias=dt_bias,
        scale=scale,
        initial_state=state,
        inplace_final_state=True,
        ssm_state_indices=slots,
        use_qk_l2norm_in_kernel=fused_norm,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        lower_bound=lower_bound,
        out=torch.empty_like(v),
    )  # every element is written: no zero fill
    return o[:, 0]


@_decode_launch.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, state, slots, fused_norm, lower_bound, scale):
    return v.new_empty(v.shape[0], v.shape[2], v.shape[3])
