"""The training step's floor: the work no change to our own code removes, each part timed alone at the step's shapes.

A small-1b step (8 x 4096, bf16, K3Muon) spends device time in fla's chunked KDA and its short convs (the kernels
transformers' KimiLinear runs too), in MLA's attention, in Newton-Schulz on every Muon matrix (most of it the
experts'; Muon's defining cost, which the goal's AdamW peer does not pay) and in the model's matrix products. The
parts are timed by the caller's timer in the benchmark's process, forward + backward where the step has both, on
random inputs of the step's shapes (`k3 bench model --cases floor`: the device's own work in them by torch.profiler,
k3.bench.common.device_time, which a step that keeps the device fed pays; fla's parts alone by CUDA events also wait
on the host, which launches fla's many Triton kernels more slowly than the device runs them); the matrix products
are counted as 6N FLOPs per token at the bf16 rate measured in the same process (100% of it: a bound, no kernel
reaches it). Their sum bounds the step from below, and with it
the tokens/s and the MFU any step of this model and optimizer can reach at these shapes. What the step spends above
it (norms, gates, routing, AttnRes, casts, the optimizer's element-wise work, the host) is ours to reduce.
"""

from __future__ import annotations

from typing import Callable

import torch

from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MultiheadLatentAttention
from k3.ops.conv import causal_conv1d
from k3.ops.kda import chunk_kda_raw
from k3.ops.mla import attention
from k3.ops.segments import Segments, as_segments
from k3.train.muon import NS_BATCH_BYTES
from k3.train.newton_schulz import block_shape, newton_schulz, ns_batches
from k3.train.param_groups import param_groups_for

Timer = Callable[[Callable[[], object], int, int], float]  # (fn, warmup, iters) -> seconds per call


def _randn(*shape, device, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()


def _fwd_bwd(fn: Callable[[], list[torch.Tensor]], leaves: list[torch.Tensor]) -> Callable[[], None]:
    """A call of fn() and the backward of its outputs against fixed random gradients (made on the first call). The
    ``leaves``' gradients are dropped first, so each backward writes them as the step's does, rather than adding."""
    grads: list[torch.Tensor] = []

    def run():
        for t in leaves:
            t.grad = None
        outs = fn()
        if not grads:
            grads.extend(torch.randn_like(o) for o in outs)
        torch.autograd.backward(outs, grads)

    return run


def kda_parts(layer: KimiDeltaAttention, n: int, cu_seqlens: Segments) -> dict[str, Callable[[], None]]:
    """One KDA layer's fla parts at n packed tokens: the chunked recurrence (its norms and gate inside) and the short
    convs (one conv over the stacked q|k|v channels, as the layer runs them), each forward + backward, with the
    layer's own A_log, dt_bias and conv weights."""
    dev, h, dk, dv = layer.A_log.device, layer.num_heads, layer.head_dim, layer.v_head_dim
    q, k, f = (_randn(1, n, h, dk, device=dev) for _ in range(3))
    v, b = _randn(1, n, h, dv, device=dev), _randn(1, n, h, device=dev)

    def core():
        o, _ = chunk_kda_raw(
            q,
            k,
            v,
            f,
            b,
            A_log=layer.A_log,
            dt_bias=layer.dt_bias,
            lower_bound=layer.lower_bound,
            l2norm_eps=layer.l2norm_eps,
            chunk_size=layer.chunk_size,
            cu_seqlens=cu_seqlens,
        )
        return [o]

    x = _randn(1, n, sum(layer.qkv_widths()), device=dev)  # q|k|v side by side, as the layer convolves them

    def conv_steps():
        return [causal_conv1d(x, layer.conv_weight(), cu_seqlens=cu_seqlens, activation="silu")[0]]

    convs = [layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight]
    return {
        "fla chunked KDA": _fwd_bwd(core, [q, k, v, f, b, layer.A_log, layer.dt_bias]),
        "fla short convs": _fwd_bwd(conv_steps, [x] + convs),
    }


def mla_part(layer: MultiheadLatentAttention, n: int, cu_seqlens: Segments) -> Callable[[], None]:
    """One MLA layer's attention at n packed tokens as training runs it (heads expanded), forward + backward."""
    dev = layer.kv_b_proj.weight.device
    h, dq = layer.num_heads, layer.dn + layer.dr
    q, k, v = _randn(n, h, dq, device=dev), _randn(n, h, dq, device=dev), _randn(n, h, layer.dv, device=dev)
    return _fwd_bwd(
        lambda: [attention(q, k, v, scale=layer.scale, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)], [q, k, v]
    )


def muon_batches(model: torch.nn.Module) -> list[tuple[int, int, int]]:
    """(blocks, rows, cols) of each batched Newton-Schulz call K3Muon makes per step on ``model``'s parameters (its
    own batching, :func:`k3.train.newton_schulz.ns_batches`, at NS_BATCH_BYTES of bf16 per call)."""
    calls = []
    for group in param_groups_for(model, 1e-4):
        if group["kind"] == "adamw":
            continue
        items = ((block_shape(group, p.shape), p.numel(), p) for p in group["params"])
        for (rows, cols), queue in ns_batches(items, NS_BATCH_BYTES // 2).items():
            calls += [(sum(p.numel() for p in batch) // (rows * cols), rows, cols) for batch in queue]
    return calls


def floor_parts(
    model: torch.nn.Module, batch: int, seq: int, matmul_rate: float, timer: Timer, activated_params: float
) -> dict[str, float]:
    """Seconds per training step of each part of the floor (see the module docstring) for ``batch`` sequences of
    ``seq`` tokens: each KDA and MLA layer's part timed alone and multiplied by the layer count where the layers
    share their shapes, Newton-Schulz (bf16, 5 steps) on every Muon matrix in K3Muon's batches
    (:func:`muon_batches`), and the matrix products as 6 x ``activated_params`` x tokens / ``matmul_rate``."""
    n = batch * seq
    dev = next(model.parameters()).device
    cu_seqlens = as_segments(torch.arange(0, n + 1, seq), dev)  # Segments, as the model makes them
    kda = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    mla = [m for m in model.modules() if isinstance(m, MultiheadLatentAttention)]
    parts: dict[str, float] = {}
    if kda:
        for name, fn in kda_parts(kda[0], n, cu_seqlens).items():
            parts[f"{name} (fwd+bwd) x{len(kda)}"] = timer(fn, 2, 5) * len(kda)
    if mla:
        parts[f"MLA attention (fwd+bwd) x{len(mla)}"] = timer(mla_part(mla[0], n, cu_seqlens), 2, 5) * len(mla)
    calls = muon_batches(model)
    if calls:
        inputs = [torch.randn(*call, device=dev, dtype=torch.bfloat16) for call in calls]
        parts[f"Newton-Schulz of {sum(c[0] for c in calls)} Muon matrices in {len(calls)} calls"] = timer(
            lambda: [newton_schulz(x, dtype=torch.bfloat16) for x in inputs], 1, 3
        )
    parts["matrix products at 100% of the bf16 rate"] = 6 * activated_params * n / matmul_rate
    return parts
