"""Kimi Delta Attention ops, fla-compatible signatures (time-major [B, T, H, K]; cu_seqlens needs B == 1).

``chunk_kda`` (training / prefill; ``chunk_kda_raw`` takes the layer's raw projections instead) and
``recurrent_kda`` (decode) return ``(o, final_state)``;
``kda_gate`` turns the raw forget projection into the log-space decay g; ``kda_decode_step`` runs one decode
token per sequence from the raw projections, updating a state pool in place (CUDA-graph safe).
``kda_decode`` is a KDA layer's whole decode core after its input maps and short convs (the forget gate's second
map, the recurrence, the output gate's second map and the gated norm): one Triton launch (k3.ops.kda.triton_decode)
where ``kda_decode_step`` runs its fast backend, the kernel plan chose kernel kda_decode_core and no gradient is
needed (:func:`decode_core_kernel`, logged once per choice); those four ops one after another otherwise.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops import backend
from k3.ops.kda.reference import chunk_kda as chunk_kda_reference
from k3.ops.kda.reference import chunk_kda_raw as chunk_kda_raw_reference
from k3.ops.kda.reference import kda_decode_step as kda_decode_step_reference
from k3.ops.fused import fused
from k3.ops.norm import gated_rms_norm
from k3.ops.kda.reference import kda_gate as kda_gate_reference
from k3.ops.kda.reference import l2norm as l2norm_reference
from k3.ops.kda.reference import recurrent_kda as recurrent_kda_reference

from k3.ops.kda import fla as _fla

kda_gate = fused(kda_gate_reference)  # one kernel on CUDA (k3.ops.fused)
l2norm = fused(l2norm_reference)
backend.register("chunk_kda", "reference", chunk_kda_reference)
backend.register("recurrent_kda", "reference", recurrent_kda_reference)
backend.register("chunk_kda", "fast", _fla.chunk_kda, _fla.available)
backend.register("recurrent_kda", "fast", _fla.recurrent_kda, _fla.available)
backend.register("chunk_kda_raw", "reference", chunk_kda_raw_reference)
backend.register("chunk_kda_raw", "fast", _fla.chunk_kda_raw, _fla.available)
backend.register("kda_decode_step", "reference", kda_decode_step_reference)
backend.register("kda_decode_step", "fast", _fla.kda_decode_step, _fla.available)


def chunk_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64
):
    """See :func:`k3.ops.kda.reference.chunk_kda`."""
    return backend.dispatch(
        "chunk_kda",
        q.device,
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


def chunk_kda_raw(
    q,
    k,
    v,
    f,
    b,
    *,
    A_log,
    dt_bias,
    lower_bound,
    l2norm_eps=1e-6,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size=64,
):
    """See :func:`k3.ops.kda.reference.chunk_kda_raw` (fast path: fla's chunked kernels)."""
    return backend.dispatch(
        "chunk_kda_raw",
        q.device,
        q,
        k,
        v,
        f,
        b,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        l2norm_eps=l2norm_eps,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """See :func:`k3.ops.kda.reference.recurrent_kda`."""
    return backend.dispatch(
        "recurrent_kda",
        q.device,
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


CORE_MAX_DIM = 128  # the one-launch core holds a head's [K, V] state in one program
_core_logged: set[str] = set()


def core_dims_supported(head_dim: int, v_head_dim: int) -> bool:
    """Whether the one-launch core takes these head widths: powers of two, 16..CORE_MAX_DIM."""
    return all(16 <= d <= CORE_MAX_DIM and not d & (d - 1) for d in (head_dim, v_head_dim))


def decode_core_kernel(x: torch.Tensor, state: torch.Tensor, inputs: list[torch.Tensor]) -> str:
    """'triton' or 'torch' for a KDA decode step on input x [N, d] with this state pool [S, H, K, V] and ``inputs``,
    every tensor the kernel would read (see the module docstring; :func:`k3.ops.backend.triton_or_torch`)."""

    def why_not() -> str:
        if backend.resolve("kda_decode_step", x.device)[0] != "fast":
            return "kda_decode_step runs its reference"
        if torch.is_grad_enabled() and any(t.requires_grad for t in [x, *inputs]):
            return "a gradient is needed"
        if any(t.dtype == torch.float64 for t in [state, *inputs]):
            return "fp64 inputs (the kernel computes in fp32)"
        if not core_dims_supported(*state.shape[2:]):
            return f"head widths {tuple(state.shape[2:])} (the kernel takes powers of two, 16..{CORE_MAX_DIM})"
        if not state.is_contiguous():
            return "a non-contiguous state pool"
        return ""

    return backend.triton_or_torch(
        "kda_decode_core",
        "kda decode step:",
        why_not,
        (
            "one Triton launch for its gates, recurrence and output norm (k3.ops.kda.triton_decode)",
            "f_b_proj, kda_decode_step, g_b_proj, the gated norm",
        ),
        _core_logged,
    )


def kda_decode_core(*args):
    """The one-launch core, :func:`k3.ops.kda.triton_decode.kda_decode_core` (its arguments); only where
    :func:`decode_core_kernel` says 'triton' (Triton is imported here, on use)."""
    from k3.ops.kda.triton_decode import kda_decode_core as launch

    return launch(*args)


def kda_decode_step(q, k, v, f, b, *, A_log, dt_bias, lower_bound, state, slots, l2norm_eps=1e-6, scale=None):
    """See :func:`k3.ops.kda.reference.kda_decode_step` (in-place state update, no host reads)."""
    return backend.dispatch(
        "kda_decode_step",
        q.device,
        q,
        k,
        v,
        f,
        b,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        state=state,
        slots=slots,
        l2norm_eps=l2norm_eps,
        scale=scale,
    )


def kda_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    f_a: Tensor,
    b: Tensor,
    g: Tensor,
    *,
    f_b_weight: Tensor,
    g_b_weight: Tensor | None,
    A_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float | None,
    norm_weight: Tensor,
    norm_eps: float,
    out_dtype: torch.dtype,
    state: Tensor,
    slots: Tensor,
    l2norm_eps: float = 1e-6,
) -> Tensor:
    """One decode token per sequence through a KDA layer's core (docs/architecture.md#kda): q, k [N, H*K] and
    v [N, H*V] after the short convs, f_a [N, r] (the forget gate's low-rank input), b [N, H] (beta's logits), g
    (the output gate [N, H*V], or its low-rank input [N, r] when ``g_b_weight`` [H*V, r] is given); f_b_weight
    [H*K, r]; the state pool [S, H, K, V] is updated in place at ``slots`` [N]. Returns o_proj's input
    y = RMSNorm(o) * norm_weight * sigmoid(gate) [N, H*V] in ``out_dtype``. Nothing is read back to the host."""
    n, (h, dk, dv) = q.shape[0], state.shape[1:]
    inputs = [
        q,
        k,
        v,
        f_a,
        b,
        g,
        f_b_weight,
        *([] if g_b_weight is None else [g_b_weight]),
        A_log,
        dt_bias,
        norm_weight,
    ]
    if decode_core_kernel(q, state, inputs) == "triton":
        return kda_decode_core(
            q,
            k,
            v,
            f_a,
            f_b_weight,
            b,
            g,
            g_b_weight,
            A_log,
            dt_bias,
            norm_weight,
            state,
            slots,
            lower_bound,
            l2norm_eps,
            norm_eps,
            out_dtype,
        )
    o = kda_decode_step(
        q.view(n, h, dk),
        k.view(n, h, dk),
        v.view(n, h, dv),
        F.linear(f_a, f_b_weight).view(n, h, dk),
        b,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        state=state,
        slots=slots,
        l2norm_eps=l2norm_eps,
    )
    gate = g if g_b_weight is None else F.linear(g, g_b_weight)
    return gated_rms_norm(o, gate.view(n, h, dv), norm_weight, norm_eps, out_dtype).reshape(n, h * dv)


__all__ = [
    "chunk_kda",
    "chunk_kda_raw",
    "recurrent_kda",
    "kda_decode",
    "kda_decode_step",
    "kda_gate",
    "l2norm",
    "decode_core_kernel",
    "kda_decode_core",
]
