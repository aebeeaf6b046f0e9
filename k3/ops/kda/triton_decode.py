"""A KDA layer's decode step after its short convs, in one Triton launch (k3.ops.kda.kda_decode_core).

For each token n and head h (q, k [K], v [V] of the head, the state S [K, V] of sequence slot_n; fp32 inside):

  f     = W_fb[h] f_a                                   the forget gate's second low-rank map, [K]
  g     = lb sigmoid(e^A_log (f + dt_bias))   (K3)   or   -e^A_log softplus(f + dt_bias)   (Kimi Linear)
  q, k  = q / sqrt(|q|^2 + eps), k / sqrt(|k|^2 + eps);   beta = sigmoid(b)
  S     = Diag(e^g) S;   S = S + k (beta (v - S^T k))^T;   o = K^-1/2 S^T q            S written back in place
  gate  = W_gb[h] g_a  (low-rank output gate)   or the full-rank gate's row
  y     = o / rms(o) * w_norm * sigmoid(gate)                                           [V], in y's dtype

the reference composition in k3.ops.kda (f_b_proj, kda_decode_step, g_b_proj, the gated RMSNorm) without the five
kernels around the recurrence (two GEMVs, two casts of its inputs, the norm) or the bf16 roundings between them
(docs/decisions.md, "KDA decode: our own kernel for the core, fla's for everything else"). One program per (token,
head): states up to 64 x 64 held whole; larger ones (K3's 128 x 128) 64 x 64 elements at a time in two passes over the
value columns (the first sums the output's squares for the norm, the second writes the state and the output), so several
programs fit an SM. K, V <= 128.

Forward only, for no-grad calls (decode); k3.ops.kda.decode_core_kernel picks it and logs which path runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.ops.kda import CORE_MAX_DIM as MAX_DIM, core_dims_supported as supported
from k3.ops.pdl import launch, wait_then_release


@triton.jit
def _kda_decode_kernel(
    Q,
    Kt,
    Vt,
    FA,
    WFB,
    Bt,
    G,
    WGB,
    A_LOG,
    DT_BIAS,
    NORM_W,
    STATE,
    SLOTS,
    Y,
    stride_q,
    stride_k,
    stride_v,
    stride_fa,
    stride_b,
    stride_g,
    stride_y,
    H,
    lower_bound,
    scale,
    eps_l2,
    eps_norm,
    K: tl.constexpr,
    V: tl.constexpr,
    RF: tl.constexpr,
    RG: tl.constexpr,
    BOUNDED: tl.constexpr,
    BLOCK_RF: tl.constexpr,
    BLOCK_RG: tl.constexpr,
    VC: tl.constexpr,
    PDL: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ks = tl.arange(0, K)
    vs = tl.arange(0, V)
    # the slot and the state are read before the wait (k3.ops.pdl: the kernel before this one does not write them)
    slot = tl.load(SLOTS + n).to(tl.int64)
    s_base = STATE + ((slot * H + h) * K + ks[:, None]) * V
    if VC == V:
        s = tl.load(s_base + vs[None, :])  # [K, V]
    wait_then_release(PDL)
    q = tl.load(Q + n * stride_q + h * K + ks).to(tl.float32)
    k = tl.load(Kt + n * stride_k + h * K + ks).to(tl.float32)
    rf = tl.arange(0, BLOCK_RF)
    fa = tl.load(FA + n * stride_fa + rf, mask=rf < RF, other=0.0).to(tl.float32)
    wfb = tl.load(WFB + (h * K + ks)[:, None] * RF + rf[None, :], mask=(rf < RF)[None, :], other=0.0)
    x = tl.sum(wfb.to(tl.float32) * fa[None, :], axis=1) + tl.load(DT_BIAS + h * K + ks).to(tl.float32)
    rate = tl.exp(tl.load(A_LOG + h).to(tl.float32))
    if BOUNDED:
        g = lower_bound * tl.sigmoid(rate * x)
    else:
        g = -rate * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # softplus, torch's threshold
    beta = tl.sigmoid(tl.load(Bt + n * stride_b + h).to(tl.float32))
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps_l2)
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps_l2)
    decay = tl.exp(g)[:, None]
    if VC == V:  # the whole state in registers: one pass
        v = tl.load(Vt + n * stride_v + h * V + vs).to(tl.float32)
        s = s.to(tl.float32) * decay
        u = beta * (v - tl.sum(k[:, None] * s, axis=0))
        s = s + k[:, None] * u[None, :]
        tl.store(s_base + vs[None, :], s.to(STATE.dtype.element_ty))
        o = scale * tl.sum(q[:, None] * s, axis=0)  # [V]
        gate = _output_gate(G, WGB, n, h, stride_g, vs, V, RG, BLOCK_RG)
        y = o / tl.sqrt(tl.sum(o * o, axis=0) / V + eps_norm) * tl.load(NORM_W + vs).to(tl.float32) * tl.sigmoid(gate)
        tl.store(Y + n * stride_y + h * V + vs, y.to(Y.dtype.element_ty))
    else:
        # VC columns of the state at a time, twice: the norm needs all of o first. With D = Diag(e^g) S,
        # u = beta (v - D^T k) and o = K^-1/2 (D^T q + u (k . q)) = K^-1/2 S_new^T q column by column; the first
        # pass sums o^2, the second (its columns again from the cache) writes S_new = D + k u^T and y.
        kq = tl.sum(k * q, axis=0)
        vc = tl.arange(0, VC)
        ssq = tl.sum(tl.zeros([VC], tl.float32), axis=0)
        for c0 in range(0, V, VC):
            d = tl.load(s_base + (c0 + vc)[None, :]).to(tl.float32) * decay  # [K, VC]
            v = tl.load(Vt + n * stride_v + h * V + c0 + vc).to(tl.float32)
            u = beta * (v - tl.sum(k[:, None] * d, axis=0))
            o = scale * (tl.sum(q[:, None] * d, axis=0) + u * kq)
            ssq += tl.sum(o * o, axis=0)
        inv_rms = 1.0 / tl.sqrt(ssq / V + eps_norm)
        for c0 in range(0, V, VC):
            d = tl.load(s_base + (c0 + vc)[None, :]).to(tl.float32) * decay
            v = tl.load(Vt + n * stride_v + h * V + c0 + vc).to(tl.float32)
            u = beta * (v - tl.sum(k[:, None] * d, axis=0))
            o = scale * (tl.sum(q[:, None] * d, axis=0) + u * kq)
            tl.store(s_base + (c0 + vc)[None, :], (d + k[:, None] * u[None, :]).to(STATE.dtype.element_ty))
            gate = _output_gate(G, WGB, n, h, stride_g, c0 + vc, V, RG, BLOCK_RG)
            y = o * inv_rms * tl.load(NORM_W + c0 + vc).to(tl.float32) * tl.sigmoid(gate)
            tl.store(Y + n * stride_y + h * V + c0 + vc, y.to(Y.dtype.element_ty))


@triton.jit
def _output_gate(G, WGB, n, h, stride_g, cols, V: tl.constexpr, RG: tl.constexpr, BLOCK_RG: tl.constexpr):
    """The output gate's logits at value columns ``cols`` of head h: the low-rank gate's second map, or the
    full-rank gate's entries."""
    if RG > 0:
        rg = tl.arange(0, BLOCK_RG)
        ga = tl.load(G + n * stride_g + rg, mask=rg < RG, other=0.0).to(tl.float32)
        wgb = tl.load(WGB + (h * V + cols)[:, None] * RG + rg[None, :], mask=(rg < RG)[None, :], other=0.0)
        return tl.sum(wgb.to(tl.float32) * ga[None, :], axis=1)
    return tl.load(G + n * stride_g + h * V + cols).to(tl.float32)


def _warps(programs: int, device: torch.device) -> int:
    """Warps per program for states up to 64 x 64 held whole: one warp (at 64 x 64: 128 state elements per thread)
    once the programs are at least 4 per SM, else 4: one warp was faster with many programs an SM, four with
    few (docs/decisions.md, "KDA decode core: one warp per program at 4 or more programs an SM"). Larger states go
    in chunks of 64 x 64 elements with four warps (not measured)."""
    if device.type != "cuda":  # Triton's interpreter (tests): no warps
        return 4
    return 1 if programs >= 4 * torch.cuda.get_device_properties(device).multi_processor_count else 4


def _v_chunk(k: int, v: int) -> int:
    """Value columns of the state a program holds at once: all of them up to 64 x 64 states, else K x VC = 64 x 64
    elements at a time (a 128 x 128 state whole took 186 registers a thread at 8 warps, one program an SM)."""
    return v if k * v <= 64 * 64 else min(v, 4096 // k)


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("k3::kda_decode_core", mutates_args=("state",))
def kda_decode_core(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    f_a: Tensor,
    w_fb: Tensor,
    b: Tensor,
    gate_in: Tensor,
    w_gb: Tensor | None,
    A_log: Tensor,
    dt_bias: Tensor,
    norm_weight: Tensor,
    state: Tensor,
    slots: Tensor,
    lower_bound: float | None,
    l2norm_eps: float,
    norm_eps: float,
    out_dtype: torch.dtype,
) -> Tensor:
    """q, k [N, H*K], v [N, H*V] (after the short convs), f_a [N, R_f] and w_fb [H*K, R_f] (the forget gate's
    maps), b [N, H] (beta logits), gate_in [N, R_g] with w_gb [H*V, R_g] (a low-rank output gate) or [N, H*V] with
    w_gb None (full rank), A_log [H], dt_bias [H*K], norm_weight [V], state [S, H, K, V] (updated in place), slots
    [N] -> y [N, H*V] in out_dtype: the module docstring's equations. A custom op (``torch.ops.k3.kda_decode_core``)
    that mutates ``state``: a compiled decode step keeps it inside its graph, on the cache's own tensor."""
    _check(q, k, v, f_a, w_fb, b, gate_in, w_gb, A_log, dt_bias, norm_weight, state, slots)
    n, (_, h, kd, vd) = q.shape[0], state.shape
    y = torch.empty(n, h * vd, dtype=out_dtype, device=q.device)
    if n:
        q, k, v, f_a, b, gate_in = (_rows(t) for t in (q, k, v, f_a, b, gate_in))
        rf = w_fb.shape[1]
        rg = 0 if w_gb is None else w_gb.shape[1]
        vc = _v_chunk(kd, vd)
        _kda_decode_kernel[(n, h)](
            q,
            k,
            v,
            f_a,
            w_fb.contiguous(),
            b,
            gate_in,
            w_fb if w_gb is None else w_gb.contiguous(),
            A_log,
            dt_bias,
            norm_weight,
            state,
            slots,
            y,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            f_a.stride(0),
            b.stride(0),
            gate_in.stride(0),
            y.stride(0),
            h,
            0.0 if lower_bound is None else lower_bound,
            kd**-0.5,
            l2norm_eps,
            norm_eps,
            K=kd,
            V=vd,
            RF=rf,
            RG=rg,
            BOUNDED=lower_bound is not None,
            BLOCK_RF=triton.next_power_of_2(rf),
            BLOCK_RG=triton.next_power_of_2(max(rg, 1)),
            VC=vc,
            num_warps=_warps(n * h, q.device) if vc == vd else 4,
            **launch(q.device),
        )
    return y


@kda_decode_core.register_fake
def _(
    q,
    k,
    v,
    f_a,
    w_fb,
    b,
    gate_in,
    w_gb,
    A_log,
    dt_bias,
    norm_weight,
    state,
    slots,
    lower_bound,
    l2norm_eps,
    norm_eps,
    out_dtype,
):
    _check(q, k, v, f_a, w_fb, b, gate_in, w_gb, A_log, dt_bias, norm_weight, state, slots)
    return q.new_empty(q.shape[0], state.shape[1] * state.shape[3], dtype=out_dtype)


def _check(q, k, v, f_a, w_fb, b, gate_in, w_gb, A_log, dt_bias, norm_weight, state, slots) -> None:
    ok = state.dim() == 4 and state.is_contiguous() and supported(*state.shape[2:])
    if ok:
        n, (_, h, kd, vd) = q.shape[0], state.shape
        ok = (
            q.shape == k.shape == (n, h * kd)
            and v.shape == (n, h * vd)
            and f_a.dim() == 2
            and f_a.shape[0] == n
            and w_fb.shape == (h * kd, f_a.shape[1])
            and b.shape == (n, h)
            and A_log.shape == (h,)
            and dt_bias.shape == (h * kd,)
            and norm_weight.shape == (vd,)
            and slots.shape == (n,)
            and not slots.is_floating_point()
            and gate_in.dim() == 2
            and gate_in.shape[0] == n
            and (gate_in.shape[1] == h * vd if w_gb is None else w_gb.shape == (h * vd, gate_in.shape[1]))
        )
    if not ok:
        raise ValueError(
            f"kda_decode_core: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, f_a "
            f"{tuple(f_a.shape)}, w_fb {tuple(w_fb.shape)}, b {tuple(b.shape)}, gate_in "
            f"{tuple(gate_in.shape)}, w_gb {None if w_gb is None else tuple(w_gb.shape)}, state "
            f"{tuple(state.shape)} (contiguous [S, H, K, V], K and V powers of two in 16..{MAX_DIM}) and "
            f"slots {tuple(slots.shape)} do not match"
        )
