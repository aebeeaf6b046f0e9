"""The KDA decode core's equations (k3.ops.kda.triton_decode) composed of the reference ops in float64: the
yardstick of its CPU-interpreter and GPU tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.model.norm import gated_rms_norm
from k3.ops.kda import reference


def core_float64(
    q, k, v, f_a, w_fb, b, gate_in, w_gb, A_log, dt_bias, norm_w, pool, slots, lower_bound, norm_eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arguments (state pool [S, H, K, V] not modified) -> (y [N, H*V], the new pool), float64:
    f_b_proj, the reference decode step, g_b_proj (where low-rank) and the gated RMSNorm."""
    n, (_, h, kd, vd) = q.shape[0], pool.shape
    new_pool = pool.double()
    f = F.linear(f_a.double(), w_fb.double())
    o = reference.kda_decode_step(
        q.double().view(n, h, kd),
        k.double().view(n, h, kd),
        v.double().view(n, h, vd),
        f.view(n, h, kd),
        b.double(),
        A_log=A_log.double(),
        dt_bias=dt_bias.double(),
        lower_bound=lower_bound,
        state=new_pool,
        slots=slots,
    )
    gate = gate_in.double() if w_gb is None else F.linear(gate_in.double(), w_gb.double())
    return gated_rms_norm(o, gate.view(n, h, vd), norm_w.double(), norm_eps).reshape(n, h * vd), new_pool
