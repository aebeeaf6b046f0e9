"""Routed experts on the GPU with ``torch._grouped_mm`` (bf16, Hopper), no host synchronisation.

Token-expert pairs are sorted by expert; each expert's group of rows is padded to a multiple of 8 (grouped_mm
needs 16-byte-aligned groups; misaligned ones give silently wrong results), all with tensor ops of static
shape: the padded buffer has N*k + 8E rows whatever the routing. Three grouped GEMMs (w1, w3, then w2 after the
GLU) and a weighted scatter-add back to the tokens. Expert weights are used in bf16 (as under autocast).
grouped_mm also needs the model and expert widths to be multiples of 8 (16-byte strides); other widths (e.g. the
matched plain experts of an ablation, I' = 85) are zero-padded: the padded GLU columns are act(0) * 0 = 0 and the
padded output columns are cut off, so the result is the unpadded one.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

ALIGN = 8


def available(device: torch.device) -> bool:
    return device.type == "cuda" and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device)[0] >= 9


def _pad(t: Tensor, pad: tuple[int, ...]) -> Tensor:
    """F.pad, but t itself when nothing is padded: F.pad copies even then, which at decode was a copy of every
    expert's weights per layer and step (1.1 of 4.5 ms per step of the decode benchmark's B=1 case)."""
    return F.pad(t, pad) if any(pad) else t


def moe_experts(x: Tensor, topk_idx: Tensor, topk_weight: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
                glu: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Same contract as :func:`k3.ops.moe.reference.moe_experts`. Under QAT the weights, inputs and GLU output
    arrive fake-quantised (k3.ops.moe.moe_experts composes them), so this is the emulated MX path:
    dequantised values through bf16 grouped GEMMs, with no host synchronisation."""
    n, d = x.shape
    e, k = w1.shape[0], topk_idx.shape[1]
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    pad_end = padded.cumsum(0)
    rank = torch.arange(n * k, device=x.device) - (counts.cumsum(0) - counts)[sorted_e]
    dest = (pad_end - padded)[sorted_e] + rank  # each sorted pair's row in the padded buffer
    tokens = order // k
    rows = n * k + ALIGN * e
    bf = torch.bfloat16
    pd, pi = -d % ALIGN, -w1.shape[1] % ALIGN
    xb = _pad(x.to(bf), (0, pd))
    w1b, w3b = (_pad(w.to(bf), (0, pd, 0, pi)) for w in (w1, w3))  # [E, I+pi, D+pd]
    w2b = _pad(w2.to(bf), (0, pi, 0, pd))  # [E, D+pd, I+pi]
    # index_select / index_copy / index_add, not x[idx]: the backward of advanced indexing is a sort-based
    # accumulate (index_put), ~136 ms of a small-1b step on an H200; index_select's is an index_add
    xs = xb.new_zeros(rows, d + pd).index_copy(0, dest, xb.index_select(0, tokens))
    offs = pad_end.to(torch.int32)
    h = glu(torch._grouped_mm(xs, w1b.transpose(1, 2), offs=offs),
            torch._grouped_mm(xs, w3b.transpose(1, 2), offs=offs))
    y = torch._grouped_mm(h.to(bf), w2b.transpose(1, 2), offs=offs)[:, :d]  # [rows, D]
    weighted = y.index_select(0, dest).float() * topk_weight.reshape(-1).index_select(0, order).float().unsqueeze(-1)
    out = torch.zeros(n, w2.shape[1], dtype=torch.float32, device=x.device).index_add(0, tokens, weighted)
    return out.to(x.dtype)
